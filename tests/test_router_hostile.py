"""The hostile-input suite: seeded adversarial requests against a live router.

A `mori serve` process in front of two `mori emulate` replicas takes every case of
`tests/hostile.py` over raw sockets (headers, program ids at every source, nesting,
sizes, oversize bodies sent whole before the answer is read, slow and abandoned bodies,
slow heads, HEAD and HTTP/1.0 requests, both APIs, streamed or not), and reads every
answer with h11 (a strict HTTP/1.1 parser). Whatever the input:

- every answer is well-formed HTTP (a HEAD answer has no body), none is lost to a
  connection reset;
- no 5xx from the router, and every refusal is a 4xx in the endpoint's error shape
  naming what is wrong (an HTTP parser refusal of a malformed header line names no field);
- no traceback in the router's log, no replica drained or ejected;
- no hang: every case is answered within its bound (`body_timeout_s` for slow bodies);
- afterwards nothing is leaked (gate, turns, in-flight all 0) and valid requests work.

The default run sends a few hundred cases; `pytest -m slow` sends 10 000 and prints the
figures recorded in the closing note.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path

import h11
import httpx
import pytest

from tests.hostile import PATHS, RESET, Answer, Case, Generator, send
from tests.router_harness import assert_clean, chat, client, emulators, metric, router

SETTINGS = {
    "max_body_bytes": 2 << 20,
    "body_timeout_s": 1.0,
    "header_timeout_s": 1.0,
    "gate_timeout_s": 20.0,
    "log_level": "info",  # the log is checked for tracebacks and per-request noise
}
CONCURRENCY = 16
CASE_TIMEOUT_S = 30.0  # a case unanswered after this is a hang
PARSER_REFUSAL = b'"code": "malformed_http"'  # the router's HTTP parser refused the request
HEADER_TIMEOUT = b'"code": "header_timeout"'  # the HTTP layer's answer to a slow head


def problem(case: Case, answer: Answer | None) -> str | None:
    """What is wrong with the router's answer to `case`, or None."""
    if answer is None:
        return None if case.hang_up else "no answer"
    if answer.status == RESET:
        return "connection reset"
    if case.method == "HEAD":
        return None if answer.status in case.expect else f"HEAD answered {answer.status}"
    if answer.status >= 500:
        return f"{answer.status}: {answer.body[:200]!r}"
    if answer.status == 408 and HEADER_TIMEOUT in answer.body:  # before the API is known
        return None if 408 in case.expect and case.head_drip_s else "head timed out"
    if answer.status == 400 and PARSER_REFUSAL in answer.body:  # refused before parsing JSON
        return None if case.headers else "parser refusal of a request without odd headers"
    if answer.status not in case.expect:
        return f"status {answer.status}, expected {case.expect}: {answer.body[:200]!r}"
    if answer.status >= 400:
        return _error_problem(case, answer)
    if b"text/event-stream" in answer.headers.get(b"content-type", b""):
        return _stream_problem(case, answer.body)
    return None


def _error_problem(case: Case, answer: Answer) -> str | None:
    try:
        doc = json.loads(answer.body)
    except ValueError:
        return f"error body is not JSON: {answer.body[:200]!r}"
    if case.path.startswith("/v1/messages"):
        ok = doc.get("type") == "error" and set(doc.get("error", {})) == {"type", "message"}
    else:
        ok = set(doc.get("error", {})) == {"message", "type", "param", "code"}
    if not ok:
        return f"error body has the wrong shape: {doc}"
    if case.needle and case.needle not in doc["error"]["message"]:
        return f"error message does not name {case.needle!r}: {doc['error']['message']!r}"
    return None


def _stream_problem(case: Case, body: bytes) -> str | None:
    if b'"error"' in body or b"event: error" in body:
        return f"stream ended with an error: {body[-300:]!r}"
    end = b"event: message_stop" if case.path == PATHS["messages"] else b"data: [DONE]"
    return None if end in body else f"stream did not finish: {body[-300:]!r}"


async def _run(port: int, cases: list[Case]) -> tuple[list[str], collections.Counter, float]:
    problems: list[str] = []
    tally: collections.Counter = collections.Counter()
    slowest = 0.0
    queue = collections.deque(cases)

    async def worker() -> None:
        nonlocal slowest
        while queue:
            case = queue.popleft()
            started = time.monotonic()
            try:
                answer = await send(port, case, CASE_TIMEOUT_S)
            except TimeoutError:
                problems.append(f"{case.kind} {case.path}: no answer in {CASE_TIMEOUT_S:g} s")
                continue
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                problems.append(f"{case.kind} {case.path}: connection failed: {e!r}")
                continue
            except h11.RemoteProtocolError as e:
                problems.append(f"{case.kind} {case.path}: malformed answer: {e}")
                continue
            took = time.monotonic() - started
            if case.kind != "slow" and not case.drip_s and not case.head_drip_s:
                slowest = max(slowest, took)
            status = answer.status if answer else "hung up"
            if answer and PARSER_REFUSAL in answer.body:
                status = "400 (HTTP parser)"
            tally[(case.kind.split(":")[0], status)] += 1
            if (why := problem(case, answer)) is not None:
                problems.append(f"{case.kind} {case.path} {case.body[:80]!r}: {why}")

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return problems, tally, slowest


def hostile_run(tmp_path: Path, count: int, seed: int) -> dict:
    """Send `count` generated cases; assert the suite's promises; return the figures."""
    generator = Generator(seed, SETTINGS)
    cases = [generator.case() for _ in range(count)]
    log = tmp_path / "router.log"
    # KV budgets above the largest body's estimate (2 MiB / 4 chars per token): the large
    # cases are served, not refused as larger than any replica (context_length_exceeded)
    emulated = ("--time-scale", "50", "--gpu-tokens", "1000000")
    with emulators(2, *emulated) as urls, router(urls, log=log, **SETTINGS) as base:
        port = int(base.rsplit(":", 1)[1])
        started = time.monotonic()
        problems, tally, slowest = asyncio.run(_run(port, cases))
        wall = time.monotonic() - started
        assert not problems, f"{len(problems)} bad answers, e.g.:\n" + "\n".join(problems[:15])
        ejections = metric(base, "mori_replica_ejections_total")
        healthy = metric(base, "mori_replica_healthy")
        assert_clean(base, timeout_s=10.0)
        # the router still serves ordinary traffic, and every stored id is listable
        assert client(base).chat.completions.create(**chat("after-the-storm")).choices
        assert httpx.get(base + "/v1/programs", timeout=10).status_code == 200
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[text.index("Traceback") - 500 :][:3000]
    assert "drained" not in text, text[text.index("drained") - 300 :][:1000]
    assert ejections == 0 and healthy == 2, (ejections, healthy)
    assert "HTTP Request:" not in text  # no httpx INFO line per hint push or health check
    statuses = collections.Counter()
    for (_, status), n in tally.items():
        statuses[status] += n
    return {
        "cases": count,
        "wall_s": round(wall, 1),
        "slowest_s": round(slowest, 2),
        "statuses": dict(statuses),
        "kinds": len({kind for kind, _ in tally}),
    }


def test_hostile_input_never_breaks_the_router(tmp_path):
    figures = hostile_run(tmp_path, count=300, seed=1)
    print(f"hostile suite: {figures}")
    assert figures["statuses"].get(200, 0) >= 60  # the valid share reaches the engines
    assert figures["statuses"].get(400, 0) >= 60


@pytest.mark.slow
def test_hostile_input_10k(tmp_path):
    figures = hostile_run(tmp_path, count=10_000, seed=2026)
    print(f"hostile suite: {figures}")
