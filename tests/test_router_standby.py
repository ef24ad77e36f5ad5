"""Active/standby with fencing (router/owner/leadership.py): two real routers over the same
emulated replicas. The standby takes over on its first request, from the replicas'
residency, with an epoch of a new term; the replicas then refuse the old active's batches,
and the old active stands by (its held requests answered 503, retried elsewhere).

The same pair behind a real HAProxy, with kill -9 under load: tests/test_ha_proxy.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import openai
import pytest

from router.config import load_config
from router.owner.controller import Router
from router.owner.leadership import TERM_SHIFT, epoch_above
from tests.router_harness import chat, client, emulators, metric, programs, router


def _health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=5).json()


def _hint(replica: str, pid: str) -> str | None:
    row = httpx.get(replica + "/mori/residency", timeout=5).json()["programs"].get(pid)
    return None if row is None else row["hint"]


def _until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_epoch_above_opens_a_new_term():
    assert epoch_above([], jitter=0) == 1 << TERM_SHIFT
    assert epoch_above([-1, 5], jitter=0) == 1 << TERM_SHIFT
    seen = [(7 << TERM_SHIFT) + 12345, 3]
    assert epoch_above(seen, jitter=0) == 8 << TERM_SHIFT
    assert epoch_above(seen, jitter=4) == 12 << TERM_SHIFT
    assert epoch_above(seen) > max(seen)  # random jitter: still a higher term


def test_the_standby_takes_over_and_fences_the_old_active():
    """A (active at start) serves a program; B (standby) pushes nothing until a request
    reaches it, then adopts the program where its KV is, fences A, and serves it with a
    cache hit. A's next batch is refused by the replica and A stands by: the program's
    hint on the replica stays B's. A request to A makes A take over again, fencing B, whose
    next batch is refused in turn."""
    with (
        emulators(1, "--time-scale", "20") as (replica,),
        router([replica]) as a,
        router([replica], standby=True) as b,
    ):
        assert _health(a)["role"] == "active" and _health(b)["role"] == "standby"
        text = "job " + "word " * 600
        out = client(a).chat.completions.create(**chat("job", text))
        text += out.choices[0].message.content
        a_epoch = _health(a)["epoch"]
        assert _hint(replica, "job") == "busy"
        assert metric(b, "mori_hint_pushes_total") == 0  # a standby steers nothing

        raw = client(b).chat.completions.with_raw_response.create(
            **chat("job", text + " more", extra_body={"return_cached_tokens_details": True})
        )
        split = raw.parse().model_extra["sglext"]["cached_tokens_details"]
        assert split["device"] + split["host"] > 500  # its KV, where B found it
        assert raw.headers["x-mori-replica"] == replica
        b_view = _health(b)
        assert b_view["role"] == "active"
        assert b_view["epoch"] >> TERM_SHIFT > a_epoch >> TERM_SHIFT
        assert metric(b, "mori_takeovers_total") == 1
        assert metric(b, "mori_reconciled_programs_total", kind="adopted") == 1

        # A still believes it is active: its next batch (the full sync, every 1 s) is refused
        _until(lambda: metric(a, "mori_step_downs_total") == 1)
        assert metric(a, "mori_hint_pushes_total", result="stale") >= 1
        assert _health(a)["role"] == "standby"
        assert _hint(replica, "job") == "busy"  # refused: B's hint stands

        client(a).chat.completions.create(**chat("other", "hello"))  # traffic: A again
        assert _health(a)["role"] == "active" and metric(a, "mori_takeovers_total") == 2
        assert _health(a)["epoch"] > _health(b)["epoch"]
        _until(lambda: _health(b)["role"] == "standby")


def test_a_fenced_router_answers_its_held_requests_503():
    """A holds a request at its gate (its one replica's GPU tier is full; the paper's policy
    never moves an idle program for a new one); B takes over; A's next full sync is
    refused and its held request is answered `503 router_standby` at once, not at the gate
    timeout: the client retries through the proxy."""
    with emulators(1, "--time-scale", "20") as (replica,):
        spec = [{"url": replica, "gpu_tokens": 3000, "cpu_tokens": 0}]
        slow = {"gate_timeout_s": 30.0, "policy": "mori-paper"}
        with router(spec, **slow) as a, router(spec, standby=True, **slow) as b:
            client(a).chat.completions.create(**chat("first", "first " + "word " * 1600))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                held = pool.submit(
                    client(a).chat.completions.create, **chat("second", "second " + "word " * 1600)
                )
                _until(lambda: programs(a)["gate"]["waiting"] == 1)
                started = time.monotonic()
                client(b).chat.completions.create(**chat("third", "hi"))
                with pytest.raises(openai.InternalServerError) as refused:
                    held.result(timeout=10)
            assert refused.value.status_code == 503
            assert refused.value.body["code"] == "router_standby"
            assert time.monotonic() - started < 5  # the next full sync (1 s), not 30 s
            assert programs(a)["gate"] == {"waiting": 0, "turns": 0}


async def test_its_own_batches_never_fence_a_router():
    """Two of one router's hint batches in flight at once (the hint loop's and a rejoin's
    full sync, or a warm-up's): the first is slow on the wire. Sent concurrently, the
    second would reach the replica first and the first be refused as stale, so the router
    would stand down as if another had taken over (and start from a fresh policy at the
    next request). Its batches go one at a time, in epoch order."""
    with emulators(1, "--time-scale", "20") as (url,):
        live = Router(load_config(None, {"replicas": [url], "tick_s": 600}, env={}))
        replica = live.replicas[url]
        await live.start()
        try:
            assert live.active
            push, slow = replica.push_hints, [True]

            async def slow_first(*args, **kwargs):  # the real push, the first one late
                if slow.pop() if slow else False:
                    await asyncio.sleep(0.3)
                return await push(*args, **kwargs)

            replica.push_hints = slow_first
            first = asyncio.create_task(live.sync_hints(full=True))
            await asyncio.sleep(0.1)  # its batch is on the wire
            await asyncio.gather(first, live.sync_hints(full=True))
            assert live.active
            assert live.metrics.hint_pushes.labels(url, "stale")._value.get() == 0
        finally:
            await live.stop()
