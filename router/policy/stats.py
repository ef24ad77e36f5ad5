"""Small statistics the policy and the tools that judge it both use.

They live in the pure core so that the policy never imports the replay or the simulator,
which import the policy (`router/replay/records.py` reports percentiles,
`router/replay/trace_stats.py` measures transition predictability with the same entropy).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def _entropy(counts: Iterable[int]) -> float:
    counts = [c for c in counts if c > 0]
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts) if total else 0.0


def entropy_reduction(rows: Mapping[str, Mapping[str, int]]) -> float:
    """R = 1 - H(next | current) / H(next) of transition counts `rows[current][next]`
    (plug-in entropies); NaN when the next agent never varies."""
    nexts: Counter[str] = Counter()
    for row in rows.values():
        nexts.update(row)
    h_next = _entropy(nexts.values())
    if h_next == 0:
        return float("nan")
    total = sum(nexts.values())
    h_cond = sum(sum(row.values()) / total * _entropy(row.values()) for row in rows.values())
    return 1 - h_cond / h_next
