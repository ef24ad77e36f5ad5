"""The data plane speaks HTTP correctly to every client, checked on the wire.

Every answer here is read by h11, a strict HTTP/1.1 parser no one here wrote, over raw
sockets (the SDKs hide the framing): happy and error paths on one kept-alive connection,
HEAD, HTTP/1.0 clients, slow and idle clients, a client that writes an oversize body
whole before it reads, and a router with no reachable replica.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import h11
import pytest

from tests.router_harness import emulator, router
from tests.servers import free_port

TIMEOUTS = {"header_timeout_s": 0.5, "keepalive_timeout_s": 1.0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with (
        emulator("--time-scale", "50") as (replica, _),
        router([replica], **TIMEOUTS) as base,
    ):
        yield int(base.rsplit(":", 1)[1])


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(30)
    return sock


def _answer(sock: socket.socket, parser: h11.Connection) -> tuple[h11.Response, bytes]:
    """The next answer on `sock`, parsed by h11 (raises on any framing error)."""
    response, body = None, b""
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return response, body


def _raw(port: int, data: bytes, method: str = "POST") -> tuple[h11.Response, bytes, bytes]:
    """Send `data` (any HTTP version) on a fresh connection; the answer as h11 parses it
    for the client of a `method` request, and what follows it before the close."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=method, target="/", headers=[("host", "r")]))
    parser.send(h11.EndOfMessage())
    with _connect(port) as sock:
        sock.sendall(data)
        response, body = _answer(sock, parser)
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
    return response, body, rest


def _headers(response: h11.Response) -> dict[bytes, bytes]:
    return dict(response.headers)


def _closed_after(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the router closes `sock` (reading and dropping what it sends), or
    None if it is still open after `limit_s`."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


# --- a strict client over the happy and error paths -----------------------------------------
def _exchanges() -> list[tuple[str, str, dict | bytes | None, int]]:
    """(method, target, body, status) in the order one client sends them."""
    stream = {**CHAT, "stream": True, "program_id": "h11-s"}
    return [
        ("POST", "/v1/chat/completions", {**CHAT, "program_id": "h11-a"}, 200),
        ("POST", "/v1/chat/completions", stream, 200),
        ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, 200),
        ("POST", "/v1/messages", {**CHAT, "stream": True}, 200),
        ("GET", "/v1/models", None, 200),
        ("GET", "/health", None, 200),
        ("HEAD", "/health", None, 200),
        ("GET", "/metrics", None, 200),
        ("GET", "/v1/programs", None, 200),
        ("POST", "/v1/programs/h11-a/tool_start", {"tool": "bash"}, 200),
        ("HEAD", "/v1/chat/completions", None, 405),
        ("GET", "/v1/chat/completions", None, 405),
        ("POST", "/v1/chat/completions", b"{not json", 400),
        ("POST", "/v1/messages", {"model": "m", "max_tokens": 0, "messages": []}, 400),
        ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400),
        ("GET", "/v1/programs/nobody", None, 404),
        ("POST", "/v1/nope", b"{}", 404),
    ]


def test_happy_and_error_paths_on_one_kept_alive_connection(port):
    """One HTTP/1.1 connection carries every exchange in turn: h11 frames each answer
    (a HEAD's without a body) and the next one starts exactly where it ended."""
    parser = h11.Connection(h11.CLIENT)
    with _connect(port) as sock:
        for method, target, doc, status in _exchanges():
            body = (
                doc if isinstance(doc, bytes) else b"" if doc is None else json.dumps(doc).encode()
            )
            headers = [("host", "router"), ("content-type", "application/json")]
            if method == "POST":
                headers.append(("content-length", str(len(body))))
            sock.sendall(parser.send(h11.Request(method=method, target=target, headers=headers)))
            sock.sendall(parser.send(h11.Data(data=body)) if body else b"")
            sock.sendall(parser.send(h11.EndOfMessage()))
            response, content = _answer(sock, parser)
            assert response.status_code == status, (method, target, content[:200])
            if method == "HEAD":
                assert content == b""
            elif status >= 400:
                assert "error" in json.loads(content), content
            elif doc and isinstance(doc, dict) and doc.get("stream"):
                assert content.rstrip().endswith((b"data: [DONE]", b'{"type":"message_stop"}'))
            parser.start_next_cycle()


@pytest.mark.parametrize(
    ("doc", "end"),
    [
        ({**CHAT, "stream": True}, b"data: [DONE]\n\n"),
        ({**CHAT, "stream": False}, b"}"),
        ({**CHAT, "max_tokens": 0}, b"}"),  # an error answer
    ],
)
def test_http10_answers_are_well_formed(port, doc, end):
    """An HTTP/1.0 client: a streamed answer is close-delimited (1.0 has no chunked
    encoding), every answer ends the connection, and h11 reads each whole."""
    body = json.dumps(doc).encode()
    head = b"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
    response, content, rest = _raw(port, head + b"content-length: %d\r\n\r\n" % len(body) + body)
    headers = _headers(response)
    assert b"transfer-encoding" not in headers
    assert headers.get(b"connection") == b"close"
    assert content.endswith(end) and rest == b""


def test_head_is_answered_at_once_with_no_body(port):
    """HEAD /health (what uptime monitors send): the status and head of the GET, at once."""
    started = time.monotonic()
    request = b"HEAD /health HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n"
    response, content, rest = _raw(port, request, "HEAD")
    assert time.monotonic() - started < 1.0
    assert response.status_code == 200 and content == rest == b""
    with _connect(port) as sock:  # a HEAD on a kept-alive connection: no body leaks after it
        sock.sendall(
            b"HEAD /health HTTP/1.1\r\nhost: r\r\n\r\nGET /health HTTP/1.1\r\nhost: r\r\n\r\n"
        )
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method="HEAD", target="/health", headers=[("host", "r")]))
        parser.send(h11.EndOfMessage())
        head, empty = _answer(sock, parser)
        parser.start_next_cycle()
        parser.send(h11.Request(method="GET", target="/health", headers=[("host", "r")]))
        parser.send(h11.EndOfMessage())
        get, content = _answer(sock, parser)
    assert empty == b"" and json.loads(content)["status"] == "ok"
    assert _headers(head)[b"content-length"] == _headers(get)[b"content-length"]


def test_slow_heads_and_idle_connections_are_closed(port):
    """Slowloris heads get a 408 and are closed after `header_timeout_s`; idle kept-alive
    connections and connections that never send a byte are closed after their timeout.
    Fifty of each, at once: none is held."""
    slow, idle, silent = [], [], []
    for _ in range(50):
        sock = _connect(port)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n")  # never ends
        slow.append(sock)
        sock = _connect(port)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: r\r\n\r\n")
        idle.append(sock)
        silent.append(_connect(port))
    try:
        for sock in idle:
            parser = h11.Connection(h11.CLIENT)
            parser.send(h11.Request(method="GET", target="/health", headers=[("host", "r")]))
            parser.send(h11.EndOfMessage())
            assert _answer(sock, parser)[0].status_code == 200
        grace = 1.5  # the timeout, the server's sweep (a quarter of it) and a loaded machine
        for socks, timeout in ((slow, 0.5), (idle, 1.0), (silent, 0.5)):
            for sock in socks:
                took = _closed_after(sock, timeout + grace)
                assert took is not None, "connection still open"
        response, content, _ = _raw(port, b"GET /health HTTP/1.1\r\nhost: r\r\n", "GET")
        assert response.status_code == 408 and b"header_timeout" in content
    finally:
        for sock in slow + idle + silent:
            sock.close()


def test_an_oversize_body_sent_whole_before_reading_gets_its_413(port):
    """The 413 is decided from the declared length, before the body is read; a client that
    writes all 20 MiB before reading still gets it (lingering close), never a reset."""
    body = b"x" * (20 << 20)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
    with _connect(port) as sock:
        sock.sendall(head + b"content-length: %d\r\n\r\n" % len(body))
        sock.sendall(body)  # raises if the router reset the connection meanwhile
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method="POST", target="/", headers=[("host", "r")]))
        parser.send(h11.EndOfMessage())
        response, content = _answer(sock, parser)
    assert response.status_code == 413
    assert json.loads(content)["error"]["code"] == "body_too_large"
    assert _headers(response).get(b"connection") == b"close"


def test_no_reachable_replica_is_a_502_at_once():
    """A wrong replica URL (nothing listens there) is not overload: every request is a 502
    that says no replica is reachable, at once, not after `gate_timeout_s`; so is a
    request that arrives after the only replica died."""
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        emulator("--time-scale", "50") as (alive, proc),
        router([dead], ready="/metrics", gate_timeout_s=60) as base,
    ):
        port = int(base.rsplit(":", 1)[1])
        body = json.dumps(CHAT).encode()
        request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\nconnection: close\r\n"
        request += b"content-length: %d\r\n\r\n" % len(body) + body
        started = time.monotonic()
        response, content, _ = _raw(port, request)
        assert time.monotonic() - started < 2.0
        assert response.status_code == 502
        assert "no engine replica is reachable" in json.loads(content)["error"]["message"]
    with emulator("--time-scale", "50") as (alive, proc), router([alive]) as base:
        port = int(base.rsplit(":", 1)[1])
        proc.kill()
        proc.wait()
        started = time.monotonic()
        response, content, _ = _raw(port, request)
        assert time.monotonic() - started < 10.0
        assert response.status_code == 502, content


def test_many_clients_at_once_keep_their_framing(port):
    """Eight threads, each a kept-alive connection of streamed and plain answers: h11 keeps
    every answer's framing (a regression net for the timeouts' bookkeeping)."""
    errors: list[BaseException] = []

    def client(i: int) -> None:
        parser = h11.Connection(h11.CLIENT)
        try:
            with _connect(port) as sock:
                for n in range(10):
                    doc = {**CHAT, "stream": n % 2 == 0, "program_id": f"many-{i}"}
                    body = json.dumps(doc).encode()
                    headers = [("host", "r"), ("content-length", str(len(body)))]
                    request = h11.Request(
                        method="POST", target="/v1/chat/completions", headers=headers
                    )
                    sock.sendall(parser.send(request) + parser.send(h11.Data(data=body)))
                    sock.sendall(parser.send(h11.EndOfMessage()))
                    assert _answer(sock, parser)[0].status_code == 200
                    parser.start_next_cycle()
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
