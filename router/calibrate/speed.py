"""How fast a replica runs a calibrated preset's forwards now: a short probe before a run.

A calibration prices the engine at the minute it ran. On a shared machine the same engine
later runs the same forwards 0.8x to 1.5x as long (bench/results/2026-12-02-engine-
prediction.md: a prediction grid's error followed the runs' forward slowdown with a
correlation of 0.94), so a prediction made with the calibration's prices misses by what
the machine's speed moved, not by what the model gets wrong. This probe times a few of
the calibration's own probes (prefills of a quarter, half and the whole span; decode
batches of 4 and 8 on longer contexts, where agents' steps decode) on the replica just
before a measured run and finds the factor by which the preset's cost model is slow for
them (`slowdown_of`): the run's slowdown, measured before its outcome is known;
`router.presets.at_speed` prices the run's prediction at it. One factor moves every
price, so the model's shape (what a hit saves, what a batch costs) stays the fit's.

Measured (bench/results/2026-12-02-speed-probe.md): it reads the idle engine, which ran
0.87-1.03 of the calibrated prices before runs whose own forwards ran 0.94-1.16, so priced
at it the predictions moved further off; `bench/real_engine_ab.py` makes it opt-in.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar

from router.calibrate.fit import observed, replay
from router.calibrate.probes import Endpoint, Probe, Timing, measure, schedule, span_for
from router.presets import Preset, at_speed

PREFILL_SHARES = (1 / 4, 1 / 2, 1.0)  # of the span
DECODE_BATCHES = (4, 8)  # the calibration's decode probes of these batch sizes
DECODE_TOKENS = 32
BOUNDS = (math.log(0.2), math.log(5.0))  # the slowdowns searched (log scale)


@dataclass(frozen=True, slots=True)
class Speed:
    """A probe's verdict: how many times as long as the preset prices them the replica
    ran the probes' forwards (1.3: 30 % slower), over all of them and per kind."""

    slowdown: float
    prefill: float
    decode: float
    seconds: float  # what the probes measured, in all


def speed_schedule(span: int, pool: int) -> list[Probe]:
    """The probes timed: the calibration schedule's prefills of `PREFILL_SHARES` of the
    span and its decode batches of `DECODE_BATCHES` (one repetition, no host hits)."""
    probes = schedule(span, pool, reps=1, decode_tokens=DECODE_TOKENS, host=False)
    prefills = {max(1, int(span * f)) for f in PREFILL_SHARES}
    return [
        p
        for p in probes
        if (p.kind == "prefill" and p.calls[0].tokens in prefills)
        or (p.kind == "decode" and len(p.calls) in DECODE_BATCHES)
    ]


def slowdown_of(
    probes: list[Probe], timings: list[list[Timing]], preset: Preset, host_pool: int = 0
) -> Speed:
    """The factor by which `preset` is slow for these timings: the `at_speed` of it whose
    replay of the probes (their calls sent when they were, `fit.replay`) best matches
    what they measured, in relative error (least squares over one factor). Not a ratio of
    sums: a call that reached the engine after its blocker had answered measures an idle
    gap no speed stretches, which the replay reproduces and a ratio would not. Fitted
    over all the probes, then over the prefills and the decodes apart; a probe whose
    calls never ran together is left out."""
    kept = [(p, t) for p, t in zip(probes, timings, strict=True) if observed(p, t) > 0]
    prefills = [k for k in kept if k[0].kind != "decode"]
    decodes = [k for k in kept if k[0].kind == "decode"]
    if not prefills or not decodes:
        raise RuntimeError("the speed probe measured no prefill or no decode")

    def best(chosen: list[tuple[Probe, list[Timing]]]) -> float:
        mine, times = [p for p, _ in chosen], [t for _, t in chosen]
        measured = np.asarray([observed(p, t) for p, t in chosen])

        def loss(log_s: float) -> float:
            model = replay(mine, times, at_speed(preset, math.exp(log_s)), host_pool)
            priced = np.asarray([observed(p, t) for p, t in zip(mine, model, strict=True)])
            return float(np.sum((priced / measured - 1) ** 2))

        found = minimize_scalar(loss, bounds=BOUNDS, method="bounded")
        return math.exp(found.x)

    return Speed(
        slowdown=best(kept),
        prefill=best(prefills),
        decode=best(decodes),
        seconds=sum(observed(p, t) for p, t in kept),
    )


async def probe_speed(url: str, preset: Preset) -> Speed:
    """Time the speed schedule on the replica at `url` (its own pool sizes the span, as
    a calibration's does) against `preset` with that pool."""
    endpoint = Endpoint(url)
    try:
        described = await endpoint.describe()
        info = described["server_info"]
        pool = int(described.get("device_capacity_tokens") or info["max_total_num_tokens"])
        probes = speed_schedule(span_for(pool), pool)
        timings = await measure(endpoint, probes, hints="host_capacity_tokens" in described)
    finally:
        await endpoint.close()
    return slowdown_of(probes, timings, dataclasses.replace(preset, kv_tokens=pool))
