"""Faults: replicas that die, hang or reject hints, and clients that leave early.

After each, the router's state is clean: nothing stuck REASONING or GATED, no gate
turn or in-flight request left (`assert_clean`), and later requests still succeed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.router_harness import (
    ScriptedReplica,
    assert_clean,
    chat,
    client,
    emulator,
    metric,
    programs,
    router,
    serve,
)
from tests.servers import free_port, mori, spawn

SLOW = ("--time-scale", "1")  # real-time decoding: a long answer streams for seconds


def _replica_of(base: str, program_id: str) -> str:
    return httpx.get(base + f"/v1/programs/{program_id}").json()["last_replica"]


def _healthy(base: str) -> dict[str, bool]:
    return {r["url"]: r["healthy"] for r in httpx.get(base + "/v1/replicas").json()["data"]}


def test_replica_killed_mid_stream():
    with emulator(*SLOW) as (url_a, proc_a), emulator(*SLOW) as (url_b, proc_b):
        procs = {url_a: proc_a, url_b: proc_b}
        with router([url_a, url_b]) as base:
            c = client(base)
            stream = c.chat.completions.create(
                **chat("victim", max_tokens=400, extra_body={"ignore_eos": True}), stream=True
            )
            first = next(iter(stream))
            assert first.choices
            doomed = _replica_of(base, "victim")
            os.killpg(procs[doomed].pid, signal.SIGKILL)
            with pytest.raises(openai.APIError):
                for _ in stream:
                    pass
            assert_clean(base)
            # the program's next step is served by the surviving replica
            again = c.chat.completions.create(**chat("victim", "retry"))
            assert again.choices[0].message.content
            assert _replica_of(base, "victim") != doomed
            assert _healthy(base)[doomed] is False
            assert metric(base, "mori_requests_total", outcome="error") >= 1
            assert_clean(base)
            # a replica back on its address rejoins (fresh capacity read, full hint sync)
            port = doomed.rsplit(":", 1)[1]
            with spawn(mori("emulate", "--port", port, *SLOW), int(port)):
                deadline = time.monotonic() + 10
                while not _healthy(base)[doomed]:
                    assert time.monotonic() < deadline, "replica did not rejoin"
                    time.sleep(0.1)
                assert metric(base, "mori_replica_healthy") == 2


@contextlib.contextmanager
def hanging_server() -> Iterator[str]:
    """Accepts TCP connections and never answers a byte (a wedged engine)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_hanging_replica_is_retried_elsewhere_and_drained():
    with hanging_server() as hung, emulator() as (good, _):
        # The hung replica has the most room, so new programs are placed there first.
        specs = [
            {"url": hung, "gpu_tokens": 1_000_000, "cpu_tokens": 1_000_000},
            {"url": good, "gpu_tokens": 100_000, "cpu_tokens": 100_000},
        ]
        with router(specs, request_timeout_s=1.0, health_interval_s=30.0) as base:
            c = client(base, timeout=10)
            started = time.monotonic()
            answer = c.chat.completions.create(**chat("wedged"))
            assert answer.choices[0].message.content
            assert 1.0 <= time.monotonic() - started < 5
            assert metric(base, "mori_requests_total", outcome="retried") == 1
            assert _healthy(base) == {hung: False, good: True}
            assert _replica_of(base, "wedged") == good
            assert_clean(base)


@pytest.mark.parametrize(("status", "result"), [(500, "error"), (404, "unsupported")])
def test_hint_endpoint_failures_do_not_stop_serving(status, result):
    replica = ScriptedReplica(hints_status=status)
    with serve(replica) as url, router([url]) as base:
        c = client(base)
        for i in range(3):
            assert c.chat.completions.create(**chat(f"h{i}")).choices[0].message.content
        deadline = time.monotonic() + 5
        while metric(base, "mori_hint_pushes_total", result=result) < 1:
            assert time.monotonic() < deadline, "no hint push was attempted"
            time.sleep(0.05)
        unsupported = metric(base, "mori_hint_unsupported_total")
        assert (unsupported >= 1) is (status == 404)
        assert _healthy(base) == {url: True}
        assert_clean(base)
    if status == 404:  # after the first 404 only the periodic full sync retries
        assert replica.hint_calls <= 3


def test_client_disconnect_while_gated():
    """(The paper's policy, which holds the leaver behind an idle holder; the default
    would move the holder off the GPU for it.)"""
    with emulator() as (url, _):
        spec = {"url": url, "gpu_tokens": 3000, "cpu_tokens": 0}
        with router([spec], gate_timeout_s=30.0, policy="mori-paper") as base:
            big = "word " * 1600  # two programs' prompts share nothing (else counted once)
            client(base).chat.completions.create(**chat("holder", "holder " + big))
            leaver = chat("leaver", "leaver " + big)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    base + "/v1/chat/completions",
                    json={**leaver, **leaver["extra_body"]},
                    timeout=0.5,
                )
            view = assert_clean(base)
            leaver = next(p for p in view["data"] if p["program_id"] == "leaver")
            assert leaver["status"] == "acting" and leaver["steps"] == 0
            assert metric(base, "mori_requests_total", outcome="client_disconnect") == 1
            # the holder's next step and the leaver's (once room exists) still work
            httpx.post(base + "/v1/programs/holder/end").raise_for_status()
            assert client(base).chat.completions.create(**chat("leaver", "leaver " + big)).choices


def test_client_disconnect_mid_stream_aborts_the_engine_request():
    replica = ScriptedReplica(tokens=200, delay_s=0.02)
    with serve(replica) as url, router([url]) as base:
        body = {**chat("quitter"), **chat("quitter")["extra_body"], "stream": True}
        body.pop("extra_body")
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break
        deadline = time.monotonic() + 5
        while not replica.aborts and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(replica.aborts) == 1
        assert metric(base, "mori_requests_total", outcome="client_disconnect") == 1
        view = assert_clean(base)
        assert view["data"][0]["steps"] == 1  # the cut step still ended the reasoning interval
        assert client(base).chat.completions.create(**chat("quitter", "again")).choices


def test_client_disconnect_mid_stream_on_emulator():
    with emulator(*SLOW) as (url, _), router([url]) as base:
        body = {**chat("gone", max_tokens=400), "stream": True, "program_id": "gone"}
        body.pop("extra_body")
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        assert_clean(base)
        assert programs(base)["data"][0]["steps"] == 1
        assert client(base).chat.completions.create(**chat("gone", "back")).choices


def test_client_that_leaves_a_long_prefill_frees_the_engine():
    """A 333k-token prompt (70 engine seconds of prefill, 7 s here at x10) whose client
    leaves once the engine is computing it: the router aborts it and the engine stops at
    the end of the prefill chunk under way, so the next program's request is served at
    once, not after the abandoned prompt was computed whole."""
    big = ("--time-scale", "10", "--gpu-tokens", "1000000")
    with emulator(*big) as (url, _), router([url], gate_timeout_s=60) as base:
        prompt = "word " * (333_000 * 4 // 5)  # 4 characters a token
        body = json.dumps({**chat("abandoned", prompt), "program_id": "abandoned"}).encode()
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n"
            sock.sendall(head % len(body) + body)
            deadline = time.monotonic() + 30
            while httpx.get(url + "/mori/residency").json()["running"] == 0:
                assert time.monotonic() < deadline, "the long prompt never reached the engine"
                time.sleep(0.05)
        started = time.monotonic()  # the client has left, mid-prefill
        answer = client(base, timeout=30).chat.completions.create(**chat("next", max_tokens=2))
        took = time.monotonic() - started
        assert answer.choices[0].message.content
        assert took < 2.0, f"the next request waited {took:.1f} s behind the abandoned prefill"
        assert_clean(base)


def test_client_that_leaves_after_done_was_served():
    """The OpenAI SDK closes the connection at `[DONE]`, before the engine ends its
    response: that request was served (its usage reaches the policy, no abort is sent),
    not a client disconnect."""
    engine = ScriptedReplica(linger_s=0.5, count_prompt=True)
    with serve(engine) as url, router([url]) as base:
        c = client(base)
        for i in range(3):
            chunks = list(c.chat.completions.create(**chat(f"done-{i}", "x" * 400), stream=True))
            assert chunks[-1].choices[0].delta.content == "x"
        time.sleep(1.0)  # every engine response has ended
        assert metric(base, "mori_requests_total", outcome="ok") == 3
        assert metric(base, "mori_requests_total", outcome="client_disconnect") == 0
        assert engine.aborts == []
        prompt = len(json.dumps([{"role": "user", "content": "x" * 400}])) // 4  # the engine's
        contexts = [p["context_tokens"] for p in programs(base)["data"]]
        assert contexts == [prompt + engine.tokens] * 3  # the policy learnt every answer's size
        assert_clean(base)


# --- data-plane workers ------------------------------------------------------------------
def _worker_pids(owner: int) -> set[int]:
    """The owner's data-plane worker processes (`python -m router.plane.worker`)."""
    with open(f"/proc/{owner}/task/{owner}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    pids = set()
    for pid in children:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"router.plane.worker" in f.read():
                pids.add(pid)
    return pids


def test_a_killed_data_plane_worker_is_replaced(tmp_path):
    """A worker process that dies is replaced and the port keeps serving; stopping the
    router (SIGTERM to its process group, workers included) is not mistaken for a death."""
    log, config = tmp_path / "router.log", tmp_path / "router.yaml"
    with emulator() as (url, _):
        port = free_port()
        config.write_text(json.dumps({"replicas": [url], "port": port, "workers": 2}))
        with spawn(mori("serve", "--config", str(config)), port, log=log) as owner:
            (first,) = _worker_pids(owner.pid)
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not (_worker_pids(owner.pid) - {first}) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _worker_pids(owner.pid) - {first}, "no worker replaced the killed one"
            base = f"http://127.0.0.1:{port}"
            for i in range(6):  # both data planes accept on the port
                assert client(base).chat.completions.create(**chat(f"w{i}")).choices
            assert_clean(base)
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"worker {first} exited (-9)" in errors[0], errors
