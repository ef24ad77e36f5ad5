"""Hostile requests for the router, from a seeded generator, sent over raw sockets.

Each `Case` is one HTTP request as an adversarial client would send it (bytes on the
wire: headers with stray whitespace or non-UTF-8 bytes, program ids with control
characters or lone surrogates at every source, deep nesting, large, oversize and slow
bodies, slow heads, HEAD and HTTP/1.0 requests, both APIs, streamed or not) plus what a
correct router answers: the allowed statuses and, for a refusal, a word the error message
must contain. `send` writes the request itself, because well-behaved clients (httpx, the
SDKs) refuse to send most of these, always whole before it reads (as a simple client
does, even when the router refuses early), and reads the answer with `h11`, a strict
HTTP/1.1 parser no one here wrote: a malformed answer (bad framing, a body after a HEAD,
bytes after the answer of a `connection: close` request) fails the case.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

import h11

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
}
BAD_TEXT = ["\x00", "\n", "\r", "\x7f", "\x1b[31m", "\u200b", "\ud800", "\udfff"]
GOOD_IDS = ["task-42", "任务-7", "a/b/c", "x" * 256, "user_ab12_account__session_9f", "ü ö"]
HEADERS = ["x-request-id", "anthropic-version", "anthropic-beta"]
SLOW_DECLARED_EXTRA = 100  # bytes a slow client announces but never sends
SLOW_HEAD_PIECES = 5  # a slow head arrives in this many pieces
RESET = 0  # status of an answer lost to a connection reset (the server closed early)
HEAD_PATHS = [  # HEAD requests and what their GET would answer (no keys configured)
    ("/health", (200,)),
    ("/metrics", (200,)),
    ("/v1/models", (200,)),
    ("/v1/programs", (200,)),
    ("/v1/chat/completions", (405,)),
    ("/v1/messages", (405,)),
    ("/v1/nope", (404,)),
]


@dataclass
class Case:
    """One request and the answers a correct router may give."""

    kind: str  # what is hostile about it (for the report)
    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    expect: tuple[int, ...] = (200,)
    needle: str | None = None  # must appear in the error message of a 4xx
    declared: int | None = None  # Content-Length announced (default: the body's)
    drip_s: float = 0.0  # seconds between body pieces (slow but complete)
    head_drip_s: float = 0.0  # seconds between pieces of the request head
    hang_up: bool = False  # send half the body, then close: no answer expected
    method: str = "POST"
    http10: bool = False  # an HTTP/1.0 request line


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()  # lone surrogates go out as \\udXXX escapes


def _base(rng: random.Random, api: str, stream: bool) -> dict[str, Any]:
    tokens = rng.randint(1, 6)
    text = rng.choice(["hello", "fix the bug", "word " * rng.randint(1, 50)])
    if api == "completions":
        return {"model": "m", "prompt": text, "max_tokens": tokens, "stream": stream}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "stream": stream,
    }
    if api == "chat" and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    return body


def _pid(rng: random.Random) -> str:
    return f"p{rng.randrange(200)}"  # a few hundred programs: ids repeat, turns queue


class Generator:
    """Seeded cases; `case()` draws one kind by weight."""

    def __init__(self, seed: int, limits: dict[str, Any] | None = None) -> None:
        self.rng = random.Random(seed)
        limits = limits or {}
        self.max_body = limits.get("max_body_bytes", 2 << 20)
        self.header_timeout_s = limits.get("header_timeout_s", 1.0)
        self.kinds = [
            (self.valid, 14),
            (self.bad_header, 14),
            (self.bad_id, 18),
            (self.good_id, 6),
            (self.nesting, 8),
            (self.junk, 12),
            (self.bad_field, 10),
            (self.size, 4),
            (self.slow, 1),
            (self.drip, 2),
            (self.hang_up, 3),
            (self.auth_and_admin, 4),
            (self.program_urls, 4),
            (self.head_request, 4),
            (self.http10, 5),
            (self.slow_head, 2),
        ]

    def case(self) -> Case:
        build = self.rng.choices([k for k, _ in self.kinds], [w for _, w in self.kinds])[0]
        return build()

    def _api(self) -> tuple[str, bool]:
        return self.rng.choice(list(PATHS)), self.rng.random() < 0.4

    def valid(self) -> Case:
        api, stream = self._api()
        body = _base(self.rng, api, stream)
        body["program_id"] = _pid(self.rng)
        return Case("valid", PATHS[api], _json(body))

    def bad_header(self) -> Case:
        """Forwarded headers with whitespace, non-ASCII or odd bytes: never a 5xx, never a
        drain; a bad X-Program-Id / X-Agent-Role is a 400 naming it."""
        rng = self.rng
        api, stream = self._api()
        body = _base(rng, api, stream)
        body["program_id"] = _pid(rng)
        name = rng.choice(HEADERS)
        value = rng.choice(
            [b"  x ", b"\t x\t", b"\xff\xfe", b"caf\xc3\xa9", b"a" * 5000, b"", b" ", b"a\tb"]
        )
        case = Case("header:" + name, PATHS[api], _json(body), [(name.encode(), value)])
        if rng.random() < 0.4:
            label = rng.choice([b"x-program-id", b"x-agent-role"])
            bad = rng.choice([b"\xff\xfe", b"\xc3", b"ok-\xe4\xbd\xa0\xe5\xa5\xbd", b"  spaced  "])
            case.headers.append((label, bad))
            body.pop("program_id")
            case.body = _json(body)
            if bad in (b"\xff\xfe", b"\xc3"):
                case.kind, case.expect, case.needle = "header:" + label.decode(), (400,), "UTF-8"
        return case

    def bad_id(self) -> Case:
        """A program id that cannot be stored, at any of its four sources: 400 naming it."""
        rng = self.rng
        api, stream = self._api()
        body = _base(rng, api, stream)
        value = rng.choice(
            [
                rng.choice(BAD_TEXT),
                "id" + rng.choice(BAD_TEXT) + "x",
                "",
                " padded",
                "x" * 257,
                {"nested": 1},
                [1],
                True,
                1.5,
            ]
        )
        source = rng.choice(["program_id", "extra_body", "metadata", "header"])
        case = Case("id:" + source, PATHS[api], b"", expect=(400,))
        if source == "program_id":
            body["program_id"], case.needle = value, "program_id"
        elif source == "extra_body":
            body["extra_body"], case.needle = {"program_id": value}, "extra_body.program_id"
        elif source == "metadata":
            body["metadata"], case.needle = {"user_id": value}, "metadata.user_id"
        else:
            if not isinstance(value, str) or value.strip() == "" or "\n" in value or "\r" in value:
                value = "id\x01x"  # what a header can carry (no CR/LF, no surrounding space)
            elif value != value.strip():  # HTTP strips a header value's surrounding space
                case.expect = (200,)
            raw = value.encode("utf-8", "surrogatepass")
            case.headers.append((b"x-program-id", raw))
            case.needle = "X-Program-Id"
        case.body = _json(body)
        return case

    def good_id(self) -> Case:
        """Unusual but valid ids (Unicode, slashes, the maximum length, numbers): served."""
        api, stream = self._api()
        body = _base(self.rng, api, stream)
        value: Any = self.rng.choice([*GOOD_IDS, self.rng.randrange(10**6)])
        body["metadata" if api == "messages" else "program_id"] = (
            {"user_id": value} if api == "messages" else value
        )
        return Case("id:good", PATHS[api], _json(body))

    def nesting(self) -> Case:
        depth = self.rng.choice([10, 60, 66, 200, 970, 5000, 100_000])
        api, stream = self._api()
        body = _base(self.rng, api, stream)
        body["program_id"] = _pid(self.rng)
        inner = '"x"'
        for _ in range(depth):
            inner = "[" + inner + "]" if self.rng.random() < 0.5 else '{"k":' + inner + "}"
        raw = _json(body)[:-1] + b', "deep": ' + inner.encode() + b"}"
        expect = (200,) if depth + 1 <= 64 else (400,)  # the body itself is one level
        return Case(f"nesting:{depth}", PATHS[api], raw, expect=expect)

    def junk(self) -> Case:
        api = self.rng.choice(list(PATHS))
        raw = self.rng.choice(
            [
                b"",
                b"{",
                b"[1,2]",
                b"null",
                b'"text"',
                b'{"messages": NaN}',
                b'{"a": Infinity}',
                bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 64))),
                b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2, '
                b'"model": "m", "prompt": "\\udfff"}',
                '{"prompt": "caf\u00e9", "model": "m"}'.encode("latin-1"),
            ]
        )
        expect = (200, 400) if b"\\ud800" in raw else (400,)
        return Case("junk", PATHS[api], raw, expect=expect)

    def bad_field(self) -> Case:
        """Wrong types for the fields the router reads (and a few it passes on)."""
        rng = self.rng
        api, stream = self._api()
        body = _base(rng, api, stream)
        name, value, expect = rng.choice(
            [
                ("max_tokens", -1, (400,)),
                ("max_tokens", "9", (400,)),
                ("stream", "yes", (400,)),
                ("stream_options", [1], (400,)),
                ("messages", [], (400,)),
                ("messages", [{"role": 1}], (400,)),
                ("model", 5, (400,)),
                ("agent", "\x00", (400,)),
                ("agent", 7, (400,)),
                ("rid", "r\n1", (400,)),
                ("rid", 12, (400,)),
                ("temperature", "hot", (400,)),
                ("tools", {"a": 1}, (400,)),
                ("session_id", "\x00", (200,)),  # the router overwrites it
                ("n", 0, (400,)),
            ]
        )
        if api == "completions" and name == "messages":
            name, value = "prompt", value
        body[name] = value
        return Case("field:" + name, PATHS[api], _json(body), expect=expect)

    def size(self) -> Case:
        """Large bodies (parsed off the event loop), over the limit (413), lying lengths."""
        rng = self.rng
        api, _ = self._api()
        body = _base(rng, api, False)
        body["program_id"] = _pid(rng)
        choice = rng.choice(["large", "many", "over", "declared"])
        if choice == "large":  # one long string: ~0.4-1.5 MiB, under the 2 MiB limit
            filler = "word " * rng.randint(80_000, 300_000)
            key = "prompt" if api == "completions" else "messages"
            body[key] = filler if api == "completions" else [{"role": "user", "content": filler}]
            return Case("size:large", PATHS[api], _json(body), expect=(200, 400))
        if choice == "many":  # many small objects: the slowest kind of JSON to decode
            body["extra"] = [{"k": i} for i in range(rng.randint(20_000, 80_000))]
            return Case("size:many", PATHS[api], _json(body))
        if choice == "over":  # sent whole before the answer is read: 413, never a reset
            body["pad"] = "x" * rng.choice([self.max_body + 1, self.max_body * 3 // 2])
            return Case("size:over", PATHS[api], _json(body), expect=(413,))
        raw = _json(body)
        return Case("size:declared", PATHS[api], raw, expect=(413,), declared=1 << 40)

    def slow(self) -> Case:
        """Announces more bytes than it sends: 408 once the body timeout passes."""
        api, stream = self._api()
        raw = _json({**_base(self.rng, api, stream), "program_id": _pid(self.rng)})
        return Case("slow", PATHS[api], raw, expect=(408,), declared=len(raw) + SLOW_DECLARED_EXTRA)

    def drip(self) -> Case:
        """A slow but complete body (well inside the timeout): served normally."""
        api, stream = self._api()
        raw = _json({**_base(self.rng, api, stream), "program_id": _pid(self.rng)})
        return Case("drip", PATHS[api], raw, drip_s=0.05)

    def hang_up(self) -> Case:
        api, stream = self._api()
        raw = _json({**_base(self.rng, api, stream), "program_id": _pid(self.rng)})
        return Case("hang-up", PATHS[api], raw, hang_up=True, expect=())

    def head_request(self) -> Case:
        """HEAD: at once, the status and head its GET would get, and no body."""
        path, expect = self.rng.choice(HEAD_PATHS)
        return Case("head", path, b"", expect=expect, method="HEAD")

    def http10(self) -> Case:
        """A valid request from an HTTP/1.0 client: a streamed answer must not be chunked."""
        case = self.valid()
        case.kind, case.http10 = "http10", True
        return case

    def slow_head(self) -> Case:
        """A head arriving in pieces: served when whole inside the header timeout, else 408
        (the answer of a slowloris client, whose connection is then closed)."""
        case = self.valid()
        late = self.rng.random() < 0.5
        # the last piece goes (pieces - 1) gaps after the first: twice the timeout (well
        # past the timeout plus the server's sweep), or a fifth of it
        last = self.header_timeout_s * (2.0 if late else 0.2)
        case.kind, case.head_drip_s = "slow-head", last / (SLOW_HEAD_PIECES - 1)
        if late:
            case.expect, case.needle = (408,), "head"
        return case

    def auth_and_admin(self) -> Case:
        """Endpoints around inference: odd paths, methods, tool_start bodies."""
        rng = self.rng
        pid = _pid(rng)
        path, raw, expect = rng.choice(
            [
                (f"/v1/programs/{pid}/tool_start", _json({"tool": "\x00"}), (400,)),
                (f"/v1/programs/{pid}/tool_start", _json({"tool": "\ud800"}), (400,)),
                (f"/v1/programs/{pid}/tool_start", _json({"tool": "bash", "agent": "\n"}), (400,)),
                (f"/v1/programs/{pid}/tool_start", b"[[[[[[[[", (400,)),
                (f"/v1/programs/{pid}/tool_end", b"", (200, 404)),
                ("/v1/programs/%ff%fe/end", b"", (404,)),
                ("/v1/programs/%00/end", b"", (404,)),
                ("/v1/nope", b"{}", (404,)),
                ("/v1/messages/count_tokens", b"{}", (400,)),  # relayed: no model, no messages
            ]
        )
        return Case("admin", path, raw, expect=expect)

    def program_urls(self) -> Case:
        """Every stored id can be named in a URL: ending a live program by its id."""
        pid = _pid(self.rng)
        return Case("end", f"/v1/programs/{pid}/end", b"", expect=(200, 404))


# --- the wire ----------------------------------------------------------------------------
async def send(port: int, case: Case, timeout_s: float) -> Answer | None:
    """Send `case` on a fresh connection; its answer (None for a client that hung up).
    Raises h11.RemoteProtocolError when the answer is not well-formed HTTP/1.1."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(timeout_s):
            length = case.declared if case.declared is not None else len(case.body)
            version = b"HTTP/1.0" if case.http10 else b"HTTP/1.1"
            head = [
                case.method.encode() + b" " + case.path.encode() + b" " + version,
                b"host: router",
                b"content-type: application/json",
                b"connection: close",
                b"content-length: " + str(length).encode(),
                *(name + b": " + value for name, value in case.headers),
            ]
            with contextlib.suppress(ConnectionError):  # refused early: read its answer
                await _write(writer, b"\r\n".join(head) + b"\r\n\r\n", case.head_drip_s)
                body = case.body[: len(case.body) // 2] if case.hang_up else case.body
                await _write(writer, body, case.drip_s)
            if case.hang_up:
                return None
            try:
                return await read_answer(reader, case.method)
            except ConnectionError:
                return Answer(RESET, {}, b"")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _write(writer: asyncio.StreamWriter, data: bytes, drip_s: float) -> None:
    """All of `data`, or in pieces `drip_s` apart."""
    if not drip_s:
        writer.write(data)
        await writer.drain()
        return
    step = max(1, -(-len(data) // SLOW_HEAD_PIECES))
    for i in range(0, len(data), step):
        writer.write(data[i : i + step])
        await writer.drain()
        await asyncio.sleep(drip_s)


async def read_answer(reader: asyncio.StreamReader, method: str = "POST") -> Answer:
    """One answer, parsed by h11 as the client of a `connection: close` request of
    `method` (it knows a HEAD answer has no body); then the connection must close with no
    byte more."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=method, target="/", headers=[("host", "router")]))
    parser.send(h11.EndOfMessage())
    status, headers, body = 0, {}, b""
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            status, headers = event.status_code, dict(event.headers)
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
    if status in (0, 100):
        raise h11.RemoteProtocolError("no final answer")
    extra = await reader.read()
    if extra:
        raise h11.RemoteProtocolError(f"{len(extra)} bytes after the answer: {extra[:80]!r}")
    return Answer(status, headers, body)
