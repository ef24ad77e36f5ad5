"""Fit the replica cost model's prices to probe timings, with the model as its own forward.

Each probe is replayed through a fresh `ReplicaEngine` built from candidate prices (the
setup calls, the idle hint, the timed calls at the offsets they were sent), so what is
fitted is exactly what `mori sim` and `mori emulate` will run: chunked prefill, the prefix
attention an extend recomputes, the batch's compute and host loads, decode runs of
constant batch. The residual of a timed call is the relative error of its time to first
token and of its decode span (first to last token); `scipy.optimize.least_squares`
minimises their squares over the prices, from a start that linear regressions on the
prefill and decode probes give (never from the answer).

The prices, in seconds, then become a preset: effective FLOP and byte rates for the
model's shape, the engine terms beside them (router/presets.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeResult, least_squares, nnls

from router.calibrate.forwards import Forward, priced_s
from router.calibrate.probes import Probe, Timing
from router.policy.types import EngineMode, Hint
from router.presets import GPU, Preset
from router.sim.model import CostModel, Done, FirstToken, ReplicaEngine

SHARES = ("prefix_attention", "load_serial")  # prices that are shares in [0, 1]
# A decode iteration's floor is the weights' read plus a fixed overhead: the probes see
# their sum only (the weights' read gives way to compute at batches far above theirs), so
# the overhead keeps the base preset's estimate and the read takes the rest.
ALWAYS_HELD = ("step_overhead_s",)
NOISE_SHARE = 0.25  # see fit(): how short a probe is timed to a relative error
ROBUST_SCALE = 0.1  # relative errors beyond this count linearly, not squared
TIMING_NOISE = 0.01  # a probe's relative timing error at best, for the prices' spread
UNDETERMINED = 0.25  # a fitted price with a larger spread is not pinned down by the probes
SETUP_GAP_S = 1.0  # model time between a probe's setup and its timed calls (engine idle)
# The replay is piecewise (whole iterations, whole chunks; loads under or over compute), so
# a search can stop on a flat step or another branch far from the answer. Searches start
# also from every corner of the shares (each at either end, the others from the
# regressions), then restart RESTARTS times from the best end so far with every price
# scaled by up to RESTART_SPREAD either way (a fixed seed: a refit gives the same preset).
SHARE_STARTS = (0.02, 0.98)
RESTARTS, RESTART_SPREAD, RESTART_SEED = 2, 2.0, 0


@dataclass(frozen=True, slots=True)
class Prices:
    """The fitted prices, in seconds (or shares)."""

    token_s: float  # one prompt token through the weights
    pair_s: float  # one (query, key) pair of attention in a prefill
    prefix_attention: float  # share of a cached prefix's own attention an extend recomputes
    prefill_overhead_s: float  # one prefill forward's fixed cost
    kv_s: float  # one context token's KV read in a decode iteration
    weights_s: float  # reading every weight once: a decode iteration's floor (dense model)
    step_overhead_s: float  # one decode iteration's fixed cost (beyond reading the weights)
    seq_overhead_s: float  # one running request's cost per decode iteration
    load_s: float  # one token's KV loaded from host to device
    load_serial: float  # share of the shorter of (compute, loads) a prefill batch adds

    @classmethod
    def of(cls, preset: Preset) -> Prices:
        """The prices a preset implies (for the self-check and as defaults)."""
        m = preset.model
        return cls(
            token_s=2 * m.active_params / preset.flops_s,
            pair_s=4 * m.layers * m.q_heads * m.head_dim / (preset.flops_s * preset.attn_eff),
            prefix_attention=preset.prefix_attention,
            prefill_overhead_s=preset.prefill_overhead_s,
            kv_s=preset.kv_bytes_per_token / preset.kv_read_bytes_s,
            weights_s=m.weight_bytes / preset.bytes_s,
            step_overhead_s=preset.step_overhead_s,
            seq_overhead_s=preset.seq_overhead_s,
            load_s=preset.kv_bytes_per_token / preset.pcie_bytes_s,
            load_serial=preset.load_serial,
        )

    def preset(self, base: Preset, name: str, device: str, sources: dict[str, str]) -> Preset:
        """A preset with these prices on `base`'s model, chunk size and pools: the device
        carries effective rates (efficiencies 1), `sources` says where each comes from."""
        m, kv_bytes = base.model, base.kv_bytes_per_token
        flops, weights_bytes_s = 2 * m.active_params / self.token_s, m.weight_bytes / self.weights_s
        gpu = GPU(
            name=device,
            hbm_bytes=0.0,  # the pool is measured (kv_tokens), not derived
            hbm_bytes_s=weights_bytes_s,
            bf16_flops=flops,
            pcie_bytes_s=kv_bytes / self.load_s,
            pcie_source=sources.get("pcie_bytes_s", "estimate"),
        )
        return Preset(
            name,
            gpu,
            m,
            mfu=1.0,
            bw_eff=1.0,
            step_overhead_s=self.step_overhead_s,
            seq_overhead_s=self.seq_overhead_s,
            attn_eff=4 * m.layers * m.q_heads * m.head_dim / (flops * self.pair_s),
            prefix_attention=self.prefix_attention,
            prefill_overhead_s=self.prefill_overhead_s,
            load_serial=self.load_serial,
            kv_read_eff=kv_bytes / (weights_bytes_s * self.kv_s),
            chunk_tokens=base.chunk_tokens,
            kv_tokens=base.gpu_kv_tokens,
            sources=tuple(sources.items()),
        )


NAMES = tuple(f.name for f in dataclasses.fields(Prices))


def observed(probe: Probe, times: Sequence[Timing]) -> float:
    """What a probe measures (`times`: the blocker's, then the calls'): a decode probe the
    window in which its whole batch decodes (the last first token to the first last
    token: output - 1 iterations, the batch having been prefilled together behind the
    blocker), any other its one call's first token after the blocker's."""
    blocker, calls = times[0], times[1:]
    if probe.kind == "decode":
        return min(t.done for t in calls) - max(t.first for t in calls)
    return calls[0].first - blocker.first


@dataclass(frozen=True, slots=True)
class FitResult:
    prices: Prices
    measured: list[float]  # per probe, `observed`
    fitted: list[float]  # ... and the same in the fitted model
    model: list[list[Timing]]  # every call after the setup as the fitted model times it
    free: tuple[str, ...]  # the prices fitted (the others were held)
    # per fitted price, its standard error as a share of it (a share or an overhead near 0:
    # in its own unit); over UNDETERMINED the probes did not pin it down
    spread: dict[str, float]
    forwards: tuple[Forward, ...] = ()  # the engine's logged forwards fitted beside the probes
    forwards_fitted: tuple[float, ...] = ()  # ... and each as the fitted prices price it

    def undetermined(self) -> list[str]:
        return [n for n, e in self.spread.items() if e > UNDETERMINED]

    def errors(self) -> np.ndarray:
        """Relative error of every probe's fitted quantity."""
        return np.asarray(self.fitted) / np.asarray(self.measured) - 1

    def residuals(self, probes: Sequence[Probe]) -> dict[str, float]:
        """RMS and largest relative error, overall and per kind of probe."""
        err, out = self.errors(), {}
        for kind in ("all", *dict.fromkeys(p.kind for p in probes)):
            mine = np.asarray(
                [e for e, p in zip(err, probes, strict=True) if kind in ("all", p.kind)]
            )
            out[f"{kind}_rms"] = round(float(np.sqrt(np.mean(mine**2))), 4)
            out[f"{kind}_max_abs"] = round(float(np.max(np.abs(mine))), 4)
        for kind, decode in (("forward-decode", True), ("forward-prefill", False)):
            mine = np.asarray(
                [p / f.took_s - 1 for f, p in zip(self.forwards, self.forwards_fitted, strict=True)
                 if f.decode == decode]
            )  # fmt: skip
            if mine.size:
                out[f"{kind}_rms"] = round(float(np.sqrt(np.mean(mine**2))), 4)
                out[f"{kind}_median"] = round(float(np.median(mine)), 4)
        return out


def replay(
    probes: Sequence[Probe],
    timings: Sequence[Sequence[Timing]],
    preset: Preset,
    host_pool: int,
) -> list[list[Timing]]:
    """Every call sent after a probe's setup (its blocker, then its timed calls) as
    `preset`'s engine times it, each probe on a fresh engine with the endpoint's pools:
    sent when it was, reusing the prefix the endpoint reported cached."""
    mode = EngineMode("typed", host_pool > 0)
    out = []
    for probe, times in zip(probes, timings, strict=True):
        engine = ReplicaEngine(preset, mode, preset.gpu_kv_tokens, host_pool)
        t = 0.0
        for i, call in enumerate(probe.setup):
            engine.submit(f"s{i}", call.program, call.tokens, call.output, t)
            t = _drain(engine, t)[1]
        if probe.idle:
            engine.apply_hints(dict.fromkeys((c.program for c in probe.setup), Hint.IDLE), t)
        start = t + SETUP_GAP_S
        for j in sorted(range(len(times)), key=lambda j: times[j].sent):
            call, m = probe.sent[j], times[j]
            reused = m.cached_device + m.cached_host
            engine.submit(f"c{j}", call.program, call.tokens, call.output, start + m.sent, reused)
        events = _drain(engine, start)[0]
        first = {e.rid: e for e in events if isinstance(e, FirstToken)}
        done = {e.rid: e.t for e in events if isinstance(e, Done)}
        row = []
        for j, m in enumerate(times):
            ev = first[f"c{j}"]
            row.append(
                Timing(
                    m.sent, ev.t - start, done[f"c{j}"] - start, m.prompt_tokens,
                    m.output_tokens, ev.cached_device, ev.cached_host,
                )
            )  # fmt: skip
        out.append(row)
    return out


def _drain(engine: ReplicaEngine, t: float) -> tuple[list, float]:
    events = []
    while (nt := engine.next_event_time()) is not None:
        events += engine.advance(nt)
        t = nt
    return events, t


def start_prices(
    probes: Sequence[Probe], timings: Sequence[Sequence[Timing]], held: Prices
) -> Prices:
    """Where the search starts: prefill and decode by linear regression (non-negative),
    the shares at one half, the load rate from the host hits' excess over a miss."""
    rows, y = [], []
    for probe, times in zip(probes, timings, strict=True):
        if probe.kind == "prefill":
            n = times[1].prompt_tokens
            rows.append([1.0, n, n * n / 2])
            y.append(observed(probe, times))
    (over, token_s, pair_s), _ = nnls(np.asarray(rows), np.asarray(y))
    rows, y = [], []
    for probe, times in zip(probes, timings, strict=True):
        out = probe.calls[0].output
        if probe.kind == "decode" and out > 1:
            b = len(probe.calls)
            rows.append([1.0, b, sum(t.prompt_tokens for t in times[1:]) + b * out / 2])
            y.append(observed(probe, times) / (out - 1))
    (step, seq, kv_s), _ = nnls(np.asarray(rows), np.asarray(y)) if rows else ((0, 0, 0), 0)
    loads = [
        (observed(probe, times) - over - token_s * (t.prompt_tokens - t.cached_host))
        / t.cached_host
        for probe, times in zip(probes, timings, strict=True)
        if probe.kind == "host-hit" and (t := times[1]).cached_host
    ]
    positive = [x for x in loads if x > 0]
    return Prices(
        token_s=max(token_s, 1e-12),
        pair_s=max(pair_s, 1e-15),
        prefix_attention=0.5,
        prefill_overhead_s=over,
        kv_s=max(kv_s, 1e-12),
        weights_s=max(step - held.step_overhead_s, 1e-9),
        step_overhead_s=held.step_overhead_s,
        seq_overhead_s=seq,
        load_s=float(np.median(positive)) if positive else held.load_s,
        load_serial=0.5 if positive else held.load_serial,
    )


def fit(
    probes: Sequence[Probe],
    timings: Sequence[Sequence[Timing]],
    base: Preset,
    host_pool: int,
    hold: Sequence[str] = (),
    forwards: Sequence[Forward] = (),
) -> FitResult:
    """Least squares over the prices not in `hold` (those keep `base`'s), on `base`'s
    model and pools. Without host-hit probes the load rate and overlap are held.

    `forwards`, the engine's own log of the forwards the probes ran, are fitted beside
    the probes: each forward's relative error against its price, the forwards together
    weighing as much as the probes (there are ten times as many). They see what a probe
    timed over HTTP blurs: a decode iteration's price at its exact batch and context."""
    held = Prices.of(base)
    if not any(p.kind == "host-hit" for p in probes):
        hold = (*hold, "load_s", "load_serial")
    hold = (*hold, *ALWAYS_HELD)
    start = start_prices(probes, timings, held)
    free = tuple(n for n in NAMES if n not in hold)
    # the search runs on prices divided by their scale, so every variable moves by ~1
    floors = _floors(probes, timings, start)
    scale = np.asarray([max(getattr(start, n), floors[n]) for n in free])
    upper = np.asarray([1.0 if n in SHARES else np.inf for n in free]) / scale
    z0 = np.asarray([getattr(start, n) for n in free]) / scale
    lower = np.full(len(free), 1e-9)  # a rate's price stays positive (a division follows)
    measured = np.asarray([observed(p, t) for p, t in zip(probes, timings, strict=True)])

    def unpack(z: np.ndarray) -> Prices:
        values = {n: getattr(held, n) for n in NAMES} | dict(zip(free, z * scale, strict=True))
        return Prices(**{n: float(v) for n, v in values.items()})

    def preset_of(z: np.ndarray) -> Preset:
        return unpack(z).preset(base, base.name, base.gpu.name, {})

    # relative errors, but a probe of a few milliseconds is timed no better than a few
    # milliseconds: its error counts against a quarter of the shortest prefill probe
    floor = NOISE_SHARE * floors["prefill_overhead_s"]

    took = np.asarray([f.took_s for f in forwards])
    weight = np.sqrt(len(probes) / max(1, len(forwards)))

    def priced(preset: Preset) -> np.ndarray:
        cost = CostModel(preset)
        return np.asarray([priced_s(cost, f) for f in forwards])

    def residuals(z: np.ndarray) -> np.ndarray:
        preset = preset_of(z)  # one per evaluation, for the probes' replay and the forwards
        rows = replay(probes, timings, preset, host_pool)
        fitted = [observed(p, r) for p, r in zip(probes, rows, strict=True)]
        probed = (np.asarray(fitted) - measured) / (measured + floor)
        if not forwards:
            return probed
        return np.concatenate([probed, weight * (priced(preset) / took - 1)])

    shares = [i for i, n in enumerate(free) if n in SHARES]  # scale 1: z is the share
    found = _search(residuals, np.clip(z0, lower, upper), lower, upper, shares)
    solution = found[0]
    best = preset_of(solution.x)
    rows = replay(probes, timings, best, host_pool)
    fitted = [observed(p, r) for p, r in zip(probes, rows, strict=True)]
    spread = _spread(found, scale, free)
    return FitResult(
        unpack(solution.x), list(measured), fitted, rows, free, spread,
        tuple(forwards), tuple(float(x) for x in priced(best)) if forwards else (),
    )  # fmt: skip


def _search(
    residuals: Callable[[np.ndarray], np.ndarray],
    z0: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    shares: list[int],
) -> list[OptimizeResult]:
    """Least-squares searches from `z0`, from `z0` with the shares (indices `shares`,
    unscaled) at each corner of SHARE_STARTS, then RESTARTS from the best end so far
    scaled at random; every search's end, the lowest cost first."""
    starts = [z0]
    for corner in itertools.product(SHARE_STARTS, repeat=len(shares)):
        start = z0.copy()
        start[shares] = corner
        starts.append(start)
    rng = np.random.default_rng(RESTART_SEED)
    spread = np.log(RESTART_SPREAD)
    found: list[OptimizeResult] = []
    with _jacobian_workers(residuals, z0.size) as workers:
        for i in range(len(starts) + RESTARTS):
            start = (
                starts[i]
                if i < len(starts)
                else found[0].x * np.exp(rng.uniform(-spread, spread, z0.size))
            )
            # soft_l1: a probe a busy machine slowed down (a shared box) pulls less than a square
            found.append(
                least_squares(
                    residuals, np.clip(start, lower, upper), bounds=(lower, upper),
                    diff_step=1e-3, max_nfev=300, loss="soft_l1", f_scale=ROBUST_SCALE,
                    workers=workers,
                )
            )  # fmt: skip
            found.sort(key=lambda f: f.cost)
    return found


_RESIDUALS: Callable[[np.ndarray], np.ndarray] | None = None  # what a Jacobian worker runs


def _evaluate(z: np.ndarray) -> np.ndarray:
    return _RESIDUALS(z)  # type: ignore[misc]


@contextlib.contextmanager
def _jacobian_workers(
    residuals: Callable[[np.ndarray], np.ndarray], prices: int
) -> Iterator[Callable[[Callable, Iterable[np.ndarray]], list[np.ndarray]] | None]:
    """A map of the Jacobian's finite-difference steps over worker processes, one a CPU
    up to one a price (None: scipy's own, in this process). A fit is ~90 % Jacobians, one
    replay of every probe per price, each independent of the others: 2 CPUs fit in ~0.7 of
    the time, to the same bit (the replay is deterministic). The workers are forked after
    `residuals` is made, so they run the closure as it is (a closure does not pickle); the
    map hands them the steps, not scipy's wrapper of `residuals`, which only makes the
    result an array (it is one)."""
    global _RESIDUALS
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if min(cpus, prices) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield None
        return
    _RESIDUALS = residuals
    try:
        with multiprocessing.get_context("fork").Pool(min(cpus, prices)) as pool:
            yield lambda _fun, steps: pool.map(_evaluate, list(steps), chunksize=1)
    finally:
        _RESIDUALS = None


def _spread(
    found: Sequence[OptimizeResult], scale: np.ndarray, free: tuple[str, ...]
) -> dict[str, float]:
    """Each fitted price's spread over the searches' ends that fit as well as the best (a
    sum of squares within one variance of its): the largest of their standard errors from
    the Jacobian, the residuals' spread taken as at least TIMING_NOISE (a perfect fit would
    otherwise claim certainty), and of their distances from the best. A price the probes
    cannot tell from another (the load rate and the overlap share when every load hides
    under compute) comes out large on a ridge the Jacobian sees, or between the branches of
    the piecewise model that only another end shows."""
    best = found[0]
    sigma2 = max(float(np.mean(best.fun**2)), TIMING_NOISE**2)
    sse = float(np.sum(best.fun**2))
    near = [f for f in found if float(np.sum(f.fun**2)) - sse <= sigma2]
    out = dict.fromkeys(free, 0.0)
    for end in near:
        info = end.jac.T @ end.jac
        # not a pseudo-inverse: a direction the probes do not see must come out unbounded
        ridge = 1e-12 * max(float(np.trace(info)), 1e-300)
        cov = np.linalg.inv(info + ridge * np.eye(len(end.x))) * sigma2
        std = np.sqrt(np.clip(np.diag(cov), 0.0, None))
        for i, name in enumerate(free):
            spread = max(_share(name, std[i], end.x[i], scale[i]),
                         _share(name, abs(end.x[i] - best.x[i]), best.x[i], scale[i]))  # fmt: skip
            out[name] = max(out[name], spread)
    return out


def _share(name: str, dz: float, z: float, scale: float) -> float:
    """A move `dz` of a scaled price `z` as a share of it; a share (or a price near 0) in
    its own unit."""
    return float(dz * scale if name in SHARES or z < 1e-6 else dz / z)


def _floors(
    probes: Sequence[Probe], timings: Sequence[Sequence[Timing]], start: Prices
) -> dict[str, float]:
    """The magnitude each price moves on when its start is degenerate (a regression's
    zero): from the probes themselves, so no estimate of the answer enters."""
    span = max(c.tokens for p in probes for c in p.sent)
    prefill = [observed(p, t) for p, t in zip(probes, timings, strict=True) if p.kind == "prefill"]
    iteration = [
        observed(p, t) / (p.calls[0].output - 1)
        for p, t in zip(probes, timings, strict=True)
        if p.kind == "decode"
    ]
    prefill = [x for x in prefill if x > 0] or [1.0]
    iteration = [x for x in iteration if x > 0] or [min(prefill)]
    batch = max((len(p.calls) for p in probes if p.kind == "decode"), default=1)
    return {
        "token_s": max(prefill) / span,
        "pair_s": max(prefill) / span**2,  # attention as dear as the weights at `span` tokens
        "prefix_attention": 1.0,
        "prefill_overhead_s": min(prefill),
        "kv_s": min(iteration) / span,
        "weights_s": min(iteration),
        "step_overhead_s": min(iteration),
        "seq_overhead_s": min(iteration) / batch,
        "load_s": max(prefill) / span,
        "load_serial": 1.0,
    }
