"""A request whose program was just promoted from the CPU tier is forwarded only after the
engine answered the hint push carrying its `busy` hint (the load-back starts first)."""

from __future__ import annotations

import time

import httpx

from tests.router_harness import ScriptedReplica, chat, client, metric, programs, router, serve


def _tiers(base: str) -> dict[str, str]:
    return {p["program_id"]: p["tier"] for p in programs(base)["data"]}


def test_promoted_request_waits_for_its_busy_hint():
    engine = ScriptedReplica(hint_delay_s=0.3, count_prompt=True)  # a race would show
    spec = {"url": "", "gpu_tokens": 300, "cpu_tokens": 1000}
    with serve(engine) as url, router([{**spec, "url": url}]) as base:
        c = client(base)
        c.chat.completions.create(**chat("a", "x" * 300))  # ~100 tokens each: both fit
        c.chat.completions.create(**chat("b", "x" * 300))
        c.chat.completions.create(**chat("a", "x" * 900))  # a grows: over budget
        deadline = time.monotonic() + 5
        while sorted(_tiers(base).values()) != ["cpu", "gpu"] and time.monotonic() < deadline:
            time.sleep(0.05)  # a tick demotes the more idle program to the CPU tier
        tiers = _tiers(base)
        assert sorted(tiers.values()) == ["cpu", "gpu"], tiers
        (on_cpu,) = (p for p, t in tiers.items() if t == "cpu")
        (on_gpu,) = (p for p, t in tiers.items() if t == "gpu")
        httpx.post(f"{base}/v1/programs/{on_gpu}/end", timeout=5).raise_for_status()  # room
        engine.events.clear()
        c.chat.completions.create(**chat(on_cpu, "x" * 320))  # CPU -> GPU, then forwarded
        busy = next(i for i, (kind, body) in enumerate(engine.events)
                    if kind == "hints" and body.get(on_cpu) == "busy")  # fmt: skip
        assert engine.events.index(("request", on_cpu)) > busy, engine.events
        assert metric(base, "mori_hint_ack_wait_seconds_count") == 1
        assert metric(base, "mori_hint_ack_wait_seconds_sum") >= 0.2
