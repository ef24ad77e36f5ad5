"""What one measured step looks like, and the run summary every report uses (MORI 6.2).

The simulator and the live replay both produce `StepRecord`s and reduce them with
`summarize`, so their tables, JSON, CSV and plots are comparable field by field.

Besides MORI's per-step metrics, a run reports its applications (Tokencake §7.1): a task
(a main program and its subagents, the records of one `session`) is done when its main
program's last step is; its end-to-end latency runs from its first request to that answer.
An agent instance (a program) runs from its first request to its last step's answer; it is
*abnormal* when that takes more than 1.5x the mean of its agent type in the run.

And its All-Gather rounds (TokenDance §6.1): a round (the steps that name one round id)
runs from its first request's arrival to its last agent's answer; only complete rounds
count, those with as many answered steps as the largest round of their task (a round cut by
the end of the run is not one). `kv_tokens_per_agent` is the KV the replicas store (all
tiers, each token once) per live agent, averaged over the run; the replayer measures it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from statistics import fmean

from router.policy.stats import percentile

ABNORMAL_X = 1.5  # an agent instance slower than this x its type's mean is abnormal


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
    session: str | None = None  # the task (its main program's id); None: the program's own
    agent: str | None = None  # the program's agent role
    last: bool = False  # the program's last step
    round: str | None = None  # the All-Gather round the step belongs to (unique in the run)
    first: bool = False  # the program's first step: a start (its wait is the start's)
    first_arrival_s: float | None = None  # its first attempt (None: `arrival_s`)
    retries: int = 0  # attempts the client repeated after an error (`ClientRetries`)
    refusals: int = 0  # times the router's door told the start to come back

    @property
    def ttft_s(self) -> float:
        """From the arrival of the attempt that was served to its first token."""
        return self.first_token_s - self.arrival_s

    @property
    def start_wait_s(self) -> float:
        """From the first attempt to the first token: what a start waited in all."""
        first = self.arrival_s if self.first_arrival_s is None else self.first_arrival_s
        return self.first_token_s - first


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
    app_e2e_mean_s: float = 0.0  # tasks answered in the run: first request to answer
    app_e2e_p99_s: float = 0.0
    apps_done: int = 0
    agents_done: int = 0  # agent instances (programs) whose last step was answered
    abnormal_agents: int = 0  # of them, slower than ABNORMAL_X x their type's mean
    agent_latency_s: dict = field(default_factory=dict)  # agent type -> mean execution s
    round_latency_mean_s: float = 0.0  # complete rounds: first request to last answer
    round_latency_p99_s: float = 0.0
    rounds_done: int = 0
    kv_tokens_per_agent: float = 0.0  # KV stored (all tiers) per live agent, run average
    # overload (docs/policy.md "Overload"): steps whose last attempt failed, steps retried,
    # starts told to come back; TTFT of the steps of programs in flight (not their first),
    # and what starts waited from their first attempt
    failed_steps: int = 0
    retried_steps: int = 0
    refused_starts: int = 0
    ttft_p99_inflight_s: float = 0.0
    ttft_max_inflight_s: float = 0.0
    start_wait_mean_s: float = 0.0
    start_wait_p99_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        row = asdict(self)
        row.update(row.pop("extra"))
        return row


def churn(records: list[StepRecord]) -> float:
    """Share of programs whose steps ran on more than one replica."""
    seen: dict[str, set[str]] = {}
    for r in records:
        if r.replica is not None:
            seen.setdefault(r.program_id, set()).add(r.replica)
    return sum(len(s) > 1 for s in seen.values()) / len(seen) if seen else 0.0


@dataclass(frozen=True, slots=True)
class AppStats:
    """Application-level figures of a run (see the module docstring)."""

    e2e_s: list[float]  # per answered task
    agents_done: int
    abnormal: int
    agent_latency_s: dict[str, float]  # agent type -> mean execution time


def app_stats(records: list[StepRecord], duration_s: float) -> AppStats:
    """Tasks answered and agent instances finished by `duration_s`."""
    first: dict[str, float] = {}  # session -> first request
    start: dict[str, float] = {}  # program -> first request
    done: dict[str, tuple[str, float]] = {}  # program -> (agent type, execution s)
    answered: dict[str, float] = {}  # session -> its main program's answer
    for r in records:
        session = r.session or r.program_id
        first[session] = min(first.get(session, r.arrival_s), r.arrival_s)
        start[r.program_id] = min(start.get(r.program_id, r.arrival_s), r.arrival_s)
        if r.last and r.ok and r.finish_s <= duration_s:
            done[r.program_id] = (r.agent or "-", r.finish_s - start[r.program_id])
            if r.program_id == session:
                answered[session] = r.finish_s
    by_type: dict[str, list[float]] = defaultdict(list)
    for agent, seconds in done.values():
        by_type[agent].append(seconds)
    means = {agent: fmean(times) for agent, times in sorted(by_type.items())}
    abnormal = sum(s > ABNORMAL_X * means[a] for a, s in done.values())
    e2e = [end - first[session] for session, end in answered.items()]
    return AppStats(e2e, len(done), abnormal, {a: round(m, 3) for a, m in means.items()})


def round_latencies(records: list[StepRecord]) -> list[float]:
    """Seconds from each complete round's first request to its last answer (records
    already cut to the run). A round is complete when it has as many answered steps as the
    largest round of its task."""
    steps: dict[str, list[StepRecord]] = defaultdict(list)
    for r in records:
        if r.round is not None:
            steps[r.round].append(r)
    largest: dict[str, int] = defaultdict(int)
    for rnd in steps.values():
        task = rnd[0].session or rnd[0].program_id
        largest[task] = max(largest[task], len(rnd))
    out = []
    for rnd in steps.values():
        task = rnd[0].session or rnd[0].program_id
        if len(rnd) == largest[task]:
            out.append(max(r.finish_s for r in rnd) - min(r.arrival_s for r in rnd))
    return out


def summarize(
    records: list[StepRecord],
    duration_s: float,
    *,
    policy: str,
    concurrency: int,
    cpu_ratio: float,
    gpu_util: float,
    extra: dict | None = None,
    kv_tokens_per_agent: float = 0.0,
) -> RunResult:
    """Reduce the steps of one run to the metrics of MORI 6.2."""
    ended = [r for r in records if r.finish_s <= duration_s]
    done = [r for r in ended if r.ok]
    ttft = [r.ttft_s for r in done]
    inflight = [r.ttft_s for r in done if not r.first]
    starts = [r.start_wait_s for r in done if r.first]
    prompt = sum(r.input_tokens for r in done) or 1
    device = sum(r.cached_device for r in done)
    host = sum(r.cached_host for r in done)
    span = max(duration_s, 1e-9)
    apps = app_stats(records, duration_s)
    rounds = round_latencies(done)
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
        app_e2e_mean_s=fmean(apps.e2e_s) if apps.e2e_s else 0.0,
        app_e2e_p99_s=percentile(apps.e2e_s, 99),
        apps_done=len(apps.e2e_s),
        agents_done=apps.agents_done,
        abnormal_agents=apps.abnormal,
        agent_latency_s=apps.agent_latency_s,
        round_latency_mean_s=fmean(rounds) if rounds else 0.0,
        round_latency_p99_s=percentile(rounds, 99),
        rounds_done=len(rounds),
        kv_tokens_per_agent=kv_tokens_per_agent,
        failed_steps=sum(not r.ok for r in ended),
        retried_steps=sum(r.retries > 0 for r in ended),
        refused_starts=sum(r.refusals > 0 for r in ended),
        ttft_p99_inflight_s=percentile(inflight, 99),
        ttft_max_inflight_s=max(inflight, default=0.0),
        start_wait_mean_s=fmean(starts) if starts else 0.0,
        start_wait_p99_s=percentile(starts, 99),
        extra=dict(extra or {}),
    )
