"""What one measured step looks like, and the run summary every report uses (MORI 6.2).

The simulator and the live replay both produce `StepRecord`s and reduce them with
`summarize`, so their tables, JSON, CSV and plots are comparable field by field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import fmean


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One inference step as the client saw it; times in seconds on the run's clock."""

    program_id: str
    replica: str | None
    arrival_s: float  # request reached the router (TTFT counts from here)
    first_token_s: float
    finish_s: float
    input_tokens: int
    output_tokens: int
    cached_device: int = 0  # prompt tokens found in device KV
    cached_host: int = 0  # prompt tokens loaded back from host DRAM
    ok: bool = True


@dataclass(slots=True)
class RunResult:
    """One row of a comparison: a policy at a concurrency and CPU ratio."""

    policy: str
    concurrency: int
    cpu_ratio: float
    output_tok_s: float
    steps_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_max_s: float
    gpu_util: float
    hit_device: float
    hit_host: float
    miss: float
    churn: float
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        row = asdict(self)
        row.update(row.pop("extra"))
        return row


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def churn(records: list[StepRecord]) -> float:
    """Share of programs whose steps ran on more than one replica."""
    seen: dict[str, set[str]] = {}
    for r in records:
        if r.replica is not None:
            seen.setdefault(r.program_id, set()).add(r.replica)
    return sum(len(s) > 1 for s in seen.values()) / len(seen) if seen else 0.0


def summarize(
    records: list[StepRecord],
    duration_s: float,
    *,
    policy: str,
    concurrency: int,
    cpu_ratio: float,
    gpu_util: float,
    extra: dict | None = None,
) -> RunResult:
    """Reduce the steps of one run to the metrics of MORI 6.2."""
    done = [r for r in records if r.ok and r.finish_s <= duration_s]
    ttft = [r.first_token_s - r.arrival_s for r in done]
    prompt = sum(r.input_tokens for r in done) or 1
    device = sum(r.cached_device for r in done)
    host = sum(r.cached_host for r in done)
    span = max(duration_s, 1e-9)
    return RunResult(
        policy=policy,
        concurrency=concurrency,
        cpu_ratio=cpu_ratio,
        output_tok_s=sum(r.output_tokens for r in done) / span,
        steps_s=len(done) / span,
        ttft_mean_s=fmean(ttft) if ttft else 0.0,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        ttft_max_s=max(ttft, default=0.0),
        gpu_util=gpu_util,
        hit_device=device / prompt,
        hit_host=host / prompt,
        miss=max(0.0, 1 - (device + host) / prompt),
        churn=churn(done),
        extra=dict(extra or {}),
    )
