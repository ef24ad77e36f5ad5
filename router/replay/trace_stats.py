"""Workload statistics of a trace corpus, in the terms of MORI section 3.

A *tool call* is the gap after every step but the last (`tool_s`); it is *short* below the
threshold (2 s) and *long* at or above it. A *busy phase* is a maximal run of one or more
consecutive short calls; its wall-clock length is the sum of those calls and of the
inference steps around them (a run of k calls spans k + 1 steps). Traces do not record
inference time, so each step is given a nominal one, `ttft_s + output_tokens / decode_tok_s`:
by default 1 s + output at 80 tok/s, about 3 s for a typical step (a small model on one
modern GPU; Claude's API steps take ~5 s). The generator uses the same nominal time for
subagent lifetimes, so its corpora and these statistics agree with each other.

Multi-agent statistics (CacheSage §3.1): a main program whose step tools name its subagents'
roles is a *task* dispatching speaker turns (`router.replay.multiagent`); over the speaker
sequences of all tasks, R = 1 - H(A_t+1 | A_t) / H(A_t+1) (plug-in entropies of the observed
transitions: 0 = the next speaker is unpredictable from the current one, 1 = determined).
The *anchor share* is a program's anchor (its role's shared prefix) over its first prompt,
averaged over the programs that have one.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from router.policy.stats import entropy_reduction
from router.replay.trace import TraceProgram, TraceStep

# MORI section 3.3 at the 2 s threshold, for side-by-side tables.
MORI_TARGETS = {
    "short_call_share": 0.87,
    "long_time_share": 0.58,
    "busy_p50_s": 20.0,
    "busy_p90_s": 81.0,
    "long_p99_s": 20.0,
}
# CacheSage section 3.1 / 4 (five workloads, 50 tasks each), as shown beside the table.
CACHESAGE_TARGETS = {
    "transition_r": "0.40-0.48",
    "anchor_share": "0.34-0.52",
    "turns": "950-1,400 / 50 tasks",
}


@dataclass(frozen=True)  # no slots: the class attributes double as CLI and preset defaults
class Nominal:
    """The stand-in inference time of a step (traces carry tokens, not model time)."""

    ttft_s: float = 1.0
    decode_tok_s: float = 80.0

    def inference_s(self, step: TraceStep) -> float:
        return self.ttft_s + step.output_tokens / self.decode_tok_s

    def lifetime_s(self, program: TraceProgram) -> float:
        """Wall-clock length of a program run alone: its inference steps and tool gaps."""
        return sum(self.inference_s(s) + s.tool_s for s in program.steps)


@dataclass(frozen=True, slots=True)
class TraceStats:
    programs: int
    subagents: int
    steps: int
    steps_p50: float
    steps_p90: float
    calls: int
    short_call_share: float
    long_time_share: float
    busy_phases: int
    busy_p50_s: float
    busy_p90_s: float
    long_p50_s: float
    long_p99_s: float
    long_max_s: float
    first_prompt_p50: float
    peak_context_p50: float
    peak_context_p90: float
    peak_context_max: int
    reused_share: float
    top_tools: str
    tasks: int = 0  # main programs that dispatch turns to their subagents' roles
    turns: int = 0
    agents: int = 0  # distinct roles that took turns
    transition_r: float = float("nan")
    anchor_share: float = float("nan")

    def rows(self) -> list[tuple[str, str, str]]:
        """(key, label, formatted value) in display order."""
        pct, sec, tok = "{:.1%}".format, "{:.1f} s".format, "{:,.0f}".format
        p90_steps = f"{self.steps_p90:.0f}"
        return [
            ("programs", "programs (subagents)", f"{self.programs} ({self.subagents})"),
            ("steps", "steps", f"{self.steps:,}"),
            ("steps_p50", "steps per program p50 / p90", f"{self.steps_p50:.0f} / {p90_steps}"),
            ("calls", "tool calls", f"{self.calls:,}"),
            ("short_call_share", "calls < threshold", pct(self.short_call_share)),
            ("long_time_share", "tool time in long calls", pct(self.long_time_share)),
            ("busy_phases", "busy phases", f"{self.busy_phases:,}"),
            ("busy_p50_s", "busy phase p50", sec(self.busy_p50_s)),
            ("busy_p90_s", "busy phase p90", sec(self.busy_p90_s)),
            ("long_p50_s", "long call p50", sec(self.long_p50_s)),
            ("long_p99_s", "long call p99", sec(self.long_p99_s)),
            ("long_max_s", "long call max", sec(self.long_max_s)),
            ("first_prompt_p50", "first prompt p50 (tokens)", tok(self.first_prompt_p50)),
            ("peak_context_p50", "peak context p50 (tokens)", tok(self.peak_context_p50)),
            ("peak_context_p90", "peak context p90 (tokens)", tok(self.peak_context_p90)),
            ("peak_context_max", "peak context max (tokens)", tok(self.peak_context_max)),
            ("reused_share", "prompt tokens reused", pct(self.reused_share)),
            ("top_tools", "top tools", self.top_tools or "-"),
            ("tasks", "multi-agent tasks", f"{self.tasks:,}" if self.tasks else "-"),
            (
                "turns",
                "speaker turns (roles)",
                f"{self.turns:,} ({self.agents})" if self.tasks else "-",
            ),
            ("transition_r", "next-speaker R", _maybe(self.transition_r, "{:.2f}")),
            ("anchor_share", "anchor share of first prompts", _maybe(self.anchor_share, "{:.2f}")),
        ]

    def _turns(self) -> str:
        return f"{self.turns:,} ({self.agents})" if self.tasks else "-"


def _maybe(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else fmt.format(value)


def speaker_sequences(programs: list[TraceProgram]) -> list[list[str]]:
    """Per task (a main program dispatching to its subagents' roles), the roles in turn
    order: its step tools that name one of its subagents' `agent`s."""
    roles: dict[str, set[str]] = {}
    for p in programs:
        if p.parent_id is not None and p.agent:
            roles.setdefault(p.parent_id, set()).add(p.agent)
    out = []
    for p in programs:
        mine = roles.get(p.program_id)
        seq = [s.tool for s in p.steps if mine and s.tool in mine]
        if seq:
            out.append(seq)  # type: ignore[arg-type]
    return out


def transition_r(sequences: list[list[str]]) -> float:
    """R over the consecutive pairs of every sequence (see `entropy_reduction`)."""
    rows: dict[str, Counter[str]] = {}
    for seq in sequences:
        for a, b in zip(seq, seq[1:], strict=False):
            rows.setdefault(a, Counter())[b] += 1
    return entropy_reduction(rows)


def busy_phases_s(program: TraceProgram, threshold_s: float, nominal: Nominal) -> list[float]:
    """Wall-clock length of each maximal run of short calls (see the module docstring)."""
    phases: list[float] = []
    run_s: float | None = None  # length of the open run, from its first step's start
    steps = program.steps
    for i, step in enumerate(steps[:-1]):
        if step.tool_s < threshold_s:
            run_s = (run_s or 0.0) + nominal.inference_s(step) + step.tool_s
        elif run_s is not None:
            phases.append(run_s + nominal.inference_s(step))
            run_s = None
        if run_s is not None and i == len(steps) - 2:  # the run reaches the final step
            phases.append(run_s + nominal.inference_s(steps[-1]))
    return phases


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def trace_stats(
    programs: list[TraceProgram], threshold_s: float = 2.0, nominal: Nominal | None = None
) -> TraceStats:
    """The section 3 statistics of a corpus (see the module docstring for definitions)."""
    nominal = nominal or Nominal()
    calls = [s.tool_s for p in programs for s in p.steps[:-1]]
    long_calls = [c for c in calls if c >= threshold_s]
    busy = [b for p in programs for b in busy_phases_s(p, threshold_s, nominal)]
    lengths = [len(p.steps) for p in programs]
    peaks = [max(s.input_tokens + s.output_tokens for s in p.steps) for p in programs]
    tools = Counter(s.tool for p in programs for s in p.steps[:-1] if s.tool)
    total_input = sum(s.input_tokens for p in programs for s in p.steps)
    sequences = speaker_sequences(programs)
    shares = [p.anchor_tokens / p.steps[0].input_tokens for p in programs if p.anchor_tokens]
    return TraceStats(
        programs=len(programs),
        subagents=sum(p.parent_id is not None for p in programs),
        steps=sum(lengths),
        steps_p50=_pct(lengths, 50),
        steps_p90=_pct(lengths, 90),
        calls=len(calls),
        short_call_share=(len(calls) - len(long_calls)) / len(calls) if calls else float("nan"),
        long_time_share=sum(long_calls) / sum(calls) if sum(calls) else float("nan"),
        busy_phases=len(busy),
        busy_p50_s=_pct(busy, 50),
        busy_p90_s=_pct(busy, 90),
        long_p50_s=_pct(long_calls, 50),
        long_p99_s=_pct(long_calls, 99),
        long_max_s=max(long_calls, default=float("nan")),
        first_prompt_p50=_pct([p.steps[0].input_tokens for p in programs], 50),
        peak_context_p50=_pct(peaks, 50),
        peak_context_p90=_pct(peaks, 90),
        peak_context_max=max(peaks, default=0),
        reused_share=sum(s.reused_tokens for p in programs for s in p.steps) / total_input,
        top_tools=", ".join(f"{t} {n / sum(tools.values()):.0%}" for t, n in tools.most_common(3)),
        tasks=len(sequences),
        turns=sum(len(seq) for seq in sequences),
        agents=len({a for seq in sequences for a in seq}),
        transition_r=transition_r(sequences),
        anchor_share=sum(shares) / len(shares) if shares else float("nan"),
    )
