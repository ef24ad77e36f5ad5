"""How much longer will a tool call last, given how long it has lasted (mean residual life)?

A point forecast of a tool call's duration (the EWMA in `router.policy.predictor`) says
little once the call has outlived it: agent tool times are heavy-tailed (MORI Fig. 3: 87 %
of calls under 2 s, yet long calls hold 58 % of all tool time), so a call that has already
run 30 s is likely to run much longer. What a placement decision needs is the expected
*remaining* time, E[D - a | D > a] at the elapsed time a. Continuum prices its KV
time-to-live from the same kind of empirical distribution.

`DurationDistribution` keeps an exponentially forgetting histogram of observed durations on
log-spaced bins (so it follows drift, and memory is constant), with suffix sums cached
between observations, so `remaining_s` is one bisection and a few multiplications: a tick can
ask it for thousands of programs.

Beyond the longest duration seen there is no data; the estimate is then the elapsed time
itself (the Lindy rule: for a Pareto tail of index 2, E[D - a | D > a] = a).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

BINS_PER_DECADE = 8
LOW_S = 0.01  # durations below land in the first bin
DECADES = 7  # 0.01 s .. 100 000 s
N_BINS = BINS_PER_DECADE * DECADES
EDGES = [LOW_S * 10 ** (i / BINS_PER_DECADE) for i in range(N_BINS + 1)]
WIDTHS = [hi - lo for lo, hi in zip(EDGES, EDGES[1:], strict=False)]
MIDDLES = [(lo + hi) / 2 for lo, hi in zip(EDGES, EDGES[1:], strict=False)]
_EDGES, _WIDTHS, _MIDDLES = np.array(EDGES), np.array(WIDTHS), np.array(MIDDLES)
LAST = N_BINS - 1
_RENORMALISE_AT = 1e100


class DurationDistribution:
    """An exponentially forgetting histogram of durations; the newest `half_life`
    observations carry half of the weight."""

    __slots__ = ("_counts", "_sums", "_weight", "_growth", "_table", "observations")

    def __init__(self, half_life: int = 500) -> None:
        if half_life < 1:
            raise ValueError("half_life must be >= 1 observation")
        self._counts = [0.0] * N_BINS
        self._sums = [0.0] * N_BINS
        self._weight = 1.0  # weight of the next observation; grows instead of decaying all
        self._growth = 2.0 ** (1.0 / half_life)
        # suffix sums of the counts and of the durations, and the weight below which
        # nothing lasted that long: computed once per observation, read by every query
        self._table: tuple[list[float], list[float], float] | None = None
        self.observations = 0

    def observe(self, duration_s: float) -> None:
        d = min(max(float(duration_s), 0.0), EDGES[-1])
        b = _bin(d)
        self._counts[b] += self._weight
        self._sums[b] += self._weight * d
        self._weight *= self._growth
        if self._weight > _RENORMALISE_AT:
            scale = 1.0 / self._weight
            self._counts = [c * scale for c in self._counts]
            self._sums = [s * scale for s in self._sums]
            self._weight = 1.0
        self._table = None
        self.observations += 1

    def mean_s(self) -> float:
        counts, sums, _ = self._suffixes()
        return sums[0] / counts[0] if counts[0] > 0 else 0.0

    def remaining_s(self, elapsed_s: float) -> float:
        """E[D - a | D > a] for a = `elapsed_s`; `elapsed_s` itself past the data."""
        a = max(0.0, float(elapsed_s))
        return self._remaining(a, self._above(a))

    def residual_many(
        self, elapsed_s: Sequence[float], more_s: Sequence[float]
    ) -> tuple[list[float], list[float | None]]:
        """`residual` of each (elapsed, more) pair: the same floats (the same operations in
        the same order, element-wise in numpy). A victim pool or an urgent step prices
        every program in a tool call on a replica, ~200-300 at 10 000 programs; one at a
        time that was a third of an event, and 90 % of one while requests were held."""
        counts, sums, floor = self._suffixes()
        suffix, per_bin = np.array(counts), np.array(self._counts)  # once per call
        a = np.maximum(np.array(elapsed_s, dtype=float), 0.0)
        b, share, n = _above_many(a, suffix, per_bin)
        past = n <= floor  # nothing lasted that long: the elapsed time itself, no survival
        count = per_bin[b]
        filled = count > 0
        mean_in_bin = np.where(
            filled, np.array(self._sums)[b] / np.where(filled, count, 1.0), _MIDDLES[b]
        )
        above_in_bin = np.where(share < 1.0, np.maximum(a, mean_in_bin), mean_in_bin)
        total = np.array(sums)[b + 1] + share * count * above_in_bin
        n = np.where(past, 1.0, n)
        left = np.where(past, a, np.maximum(0.0, total / n - a))
        later = _above_many(a + np.maximum(np.array(more_s, dtype=float), 0.0), suffix, per_bin)[2]
        stays = np.where(later <= floor, 0.0, later) / n
        return left.tolist(), [
            None if p else x for p, x in zip(past.tolist(), stays.tolist(), strict=True)
        ]

    def survival(self, elapsed_s: float, more_s: float) -> float | None:
        """P(D > a + x | D > a) for a = `elapsed_s`, x = `more_s`; None past the data."""
        a = max(0.0, float(elapsed_s))
        return self._survival(a, self._above(a)[2], more_s)

    def residual(self, elapsed_s: float, more_s: float) -> tuple[float, float | None]:
        """(`remaining_s`, `survival`) at once, from one look-up of the elapsed time's bin
        (a victim pool asks both for each of hundreds of programs)."""
        a = max(0.0, float(elapsed_s))
        above = self._above(a)
        return self._remaining(a, above), self._survival(a, above[2], more_s)

    def _remaining(self, a: float, above: tuple[int, float, float | None]) -> float:
        b, share, n = above
        if n is None:
            return a
        sums = self._suffixes()[1]
        count = self._counts[b]
        mean_in_bin = self._sums[b] / count if count > 0 else MIDDLES[b]
        above_in_bin = max(a, mean_in_bin) if share < 1.0 else mean_in_bin
        total = sums[b + 1] + share * count * above_in_bin
        return max(0.0, total / n - a)

    def _survival(self, a: float, n: float | None, more_s: float) -> float | None:
        if n is None:
            return None
        return (self._above(a + max(0.0, more_s))[2] or 0.0) / n

    def _above(self, t: float) -> tuple[int, float, float | None]:
        """(t's bin, the share of that bin above t, the weight of durations above t), the
        weight None where (almost) nothing lasted that long. A victim pool asks it for
        hundreds of programs: the bin's edges and width and the suffix sums are read from
        tables, the arithmetic is the same."""
        counts, _, floor = self._table or self._suffixes()
        b = _bin(t)
        share = 1.0 if t <= EDGES[b] else max(0.0, (EDGES[b + 1] - t) / WIDTHS[b])
        n = counts[b + 1] + share * self._counts[b]
        return b, share, (None if n <= floor else n)

    def _suffixes(self) -> tuple[list[float], list[float], float]:
        """Counts and sums of bins b.. for every b, and the weight at or below which
        nothing lasted that long (cached until the next observation)."""
        if self._table is None:
            counts = _suffix_sums(self._counts)
            self._table = (counts, _suffix_sums(self._sums), 1e-12 * (counts[0] or 1.0))
        return self._table


def _suffix_sums(values: list[float]) -> list[float]:
    """[sum(values[b:]) for every b] + [0.0], summed from the top as before (the same
    floating-point sums), at C speed: it runs after every observation."""
    out = list(accumulate(reversed(values), initial=0.0))
    out.reverse()
    return out


def _bin(d: float) -> int:
    b = bisect_right(EDGES, d) - 1
    return 0 if b < 0 else LAST if b > LAST else b


def _above_many(t: np.ndarray, suffix: np.ndarray, per_bin: np.ndarray) -> tuple[np.ndarray, ...]:
    """`DurationDistribution._above` of each of `t` (bin, share of it above, weight above),
    the weight not yet compared with the floor; `suffix`/`per_bin`: the counts as arrays."""
    b = np.clip(np.searchsorted(_EDGES, t, side="right") - 1, 0, LAST)
    share = np.where(t <= _EDGES[b], 1.0, np.maximum(0.0, (_EDGES[b + 1] - t) / _WIDTHS[b]))
    return b, share, suffix[b + 1] + share * per_bin[b]
