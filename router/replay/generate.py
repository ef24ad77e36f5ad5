"""A seeded generator of Claude-Code-like programs, calibrated to MORI section 3.

Shape: a two-state phase process per program. A *busy* phase emits a run of short tool
calls (each under the threshold, 2 s: Read, Edit, Grep, ...); an *idle* phase emits one or
a few long calls (test runs, builds, web fetches, subagents). Phase lengths are drawn per
phase (lognormal counts), which gives the heavy-tailed busy-phase lengths of the paper
rather than the thin geometric tail of a memoryless chain. Tool durations are per-tool
lognormals conditioned on the phase's side of the threshold, so the share of short calls
and the long calls' share of tool time follow from the preset.

Contexts grow append-only: the first prompt is the agent role's shared prefix
(`anchor_tokens`: system prompt + tool definitions) plus a task; every later prompt is the
previous prompt + its output + the tool result, and reuses all of it. Past
`max_context_tokens` the program compacts: the prompt becomes prefix + summary.

A spawn tool (`Task`) starts one or more subagent programs (`parent_id`, `start_s` = the
parent's nominal elapsed time, `agent` = role); the parent's gap is the longest child's
nominal lifetime plus an overhead, so the parent sits idle while its children run.
Everything is drawn from one `random.Random(seed)`: the same preset and seed give the same
corpus.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.replay.trace import TraceProgram, TraceStep
from router.replay.trace_stats import Nominal

PRESET_DIR = Path(__file__).resolve().parents[2] / "traces" / "presets"


class StrictModel(BaseModel):
    """A preset section: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Dist(StrictModel):
    """A lognormal given by its median and log-space sigma, optionally clipped."""

    median: float = Field(gt=0)
    sigma: float = Field(default=0.0, ge=0)
    min: float | None = None
    max: float | None = None

    def sample(self, rng: random.Random, lo: float = -math.inf, hi: float = math.inf) -> float:
        """Draw, conditioned on [lo, hi) by rejection (clipped after 100 misses)."""
        lo = lo if self.min is None else max(lo, self.min)
        hi = hi if self.max is None else min(hi, self.max)
        value = lo
        for _ in range(100):
            value = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
            if lo <= value < hi:
                return value
        return min(max(value, lo), math.nextafter(hi, lo))

    def count(self, rng: random.Random, lo: int = 1) -> int:
        return max(lo, round(self.sample(rng)))


class Tool(StrictModel):
    weight: float = Field(gt=0)
    duration_s: Dist | None = None  # before conditioning on the phase; unused for spawns
    result_tokens: Dist  # tool output appended to the next prompt
    output_tokens: Dist | None = None  # the step that calls it (Write/Edit emit more)


def check_loop_tools(loops: bool, tools: dict[str, Tool], who: str) -> None:
    """A role (agent) whose turns run tool loops needs tools, each with a duration."""
    if loops and not tools:
        raise ValueError(f"{who} needs tools")
    missing = [n for n, t in tools.items() if t.duration_s is None]
    if missing:
        raise ValueError(f"tools {missing} need duration_s")


class Role(StrictModel):
    anchor_tokens: int = Field(ge=0)  # shared system prompt + tool definitions
    steps: Dist
    weight: float = Field(default=1.0, gt=0)  # how often a spawn picks this role
    tools: list[str] | None = None  # allowed tools; None = all but the spawn tool for subagents


class Preset(StrictModel):
    kind: Literal["agent"] = "agent"
    name: str
    description: str = ""
    threshold_s: float = Field(default=2.0, gt=0)
    nominal_ttft_s: float = Field(default=Nominal.ttft_s, ge=0)
    nominal_decode_tok_s: float = Field(default=Nominal.decode_tok_s, gt=0)
    start_busy: float = Field(default=0.85, ge=0, le=1)
    busy_calls: Dist  # short calls per busy phase
    idle_calls: Dist  # long calls per idle phase
    busy_tools: dict[str, Tool]
    idle_tools: dict[str, Tool]
    output_tokens: Dist
    task_tokens: Dist
    summary_tokens: Dist
    max_context_tokens: int = Field(gt=0)  # prompts past it compact to prefix + summary
    max_result_tokens: int = Field(default=8000, gt=0)  # agents truncate long tool output
    main: Role
    subagents: dict[str, Role] = {}
    spawn_tool: str = "Task"
    fanout: Dist = Dist(median=1.0)  # parallel children per spawn
    spawn_overhead_s: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _spawn_is_long(self) -> Preset:
        if self.spawn_tool in self.busy_tools:
            raise ValueError(f"spawn tool {self.spawn_tool!r} must be an idle (long) tool")
        if self.spawn_tool in self.idle_tools and not self.subagents:
            raise ValueError(f"spawn tool {self.spawn_tool!r} needs at least one subagent role")
        if self.max_result_tokens * 2 > self.max_context_tokens:
            raise ValueError("max_result_tokens must be at most half of max_context_tokens")
        timeless = [n for n, t in self.tools.items() if t.duration_s is None]
        if set(timeless) - {self.spawn_tool}:
            raise ValueError(f"tools {timeless} need duration_s (only the spawn tool may omit it)")
        return self

    @property
    def tools(self) -> dict[str, Tool]:
        return {**self.busy_tools, **self.idle_tools}

    @property
    def nominal(self) -> Nominal:
        return Nominal(self.nominal_ttft_s, self.nominal_decode_tok_s)


def load_preset(name_or_path: str | Path) -> Preset:
    """A single-agent preset by name (traces/presets/NAME.yaml) or by path to a YAML file."""
    return Preset.model_validate(preset_dict(name_or_path))


def preset_dict(name_or_path: str | Path, seen: tuple[str, ...] = ()) -> dict:
    """The preset's YAML with `base: OTHER` resolved: OTHER's settings, overridden by these."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
        raise FileNotFoundError(f"no preset {str(name_or_path)!r} (known: {known or 'none'})")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a preset must be a YAML mapping")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if base in seen:
        raise ValueError(f"{path}: preset bases loop through {base!r}")
    return _merge(preset_dict(base, (*seen, base)), raw)


def _merge(base: dict, override: dict) -> dict:
    """Nested mappings merge key by key; anything else in `override` replaces."""
    out = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


class _ProgramBuilder:
    """Draws one program (and its subagents) from the preset; all randomness from `rng`."""

    def __init__(self, preset: Preset, rng: random.Random):
        self.preset, self.rng = preset, rng

    def _pick(self, tools: dict[str, Tool], allowed: set[str]) -> tuple[str, Tool]:
        names = [n for n in tools if n in allowed]
        if not names:
            raise ValueError(f"preset {self.preset.name!r}: a role allows none of {list(tools)}")
        name = self.rng.choices(names, weights=[tools[n].weight for n in names])[0]
        return name, tools[name]

    def _phase_plan(self, calls: int) -> list[bool]:
        """True for a long call: alternating busy/idle phases of drawn lengths."""
        p, plan = self.preset, []
        busy = self.rng.random() < p.start_busy
        while len(plan) < calls:
            plan += [not busy] * (p.busy_calls if busy else p.idle_calls).count(self.rng)
            busy = not busy
        return plan[:calls]

    def build(
        self, pid: str, role_name: str, role: Role, parent: str | None, start_s: float
    ) -> list[TraceProgram]:
        p, rng, nominal = self.preset, self.rng, self.preset.nominal
        allowed = set(role.tools or [*p.busy_tools, *p.idle_tools])
        if parent is not None:
            allowed.discard(p.spawn_tool)  # no nested subagents, as in Claude Code
        n = role.steps.count(rng)
        plan = self._phase_plan(n - 1)
        steps: list[TraceStep] = []
        children: list[TraceProgram] = []
        elapsed = 0.0
        prompt, reused = role.anchor_tokens + round(p.task_tokens.sample(rng)), 0
        for i in range(n):
            tool_name, tool, long_call = None, None, i < n - 1 and plan[i]
            if i < n - 1:
                tool_name, tool = self._pick(p.idle_tools if long_call else p.busy_tools, allowed)
            out_dist = tool.output_tokens if tool and tool.output_tokens else p.output_tokens
            output = round(out_dist.sample(rng, lo=1))
            elapsed += nominal.inference_s(TraceStep(prompt, output))
            gap = 0.0
            if tool_name == p.spawn_tool:
                kids = self._spawn(pid, len(children), start_s=elapsed)
                children += kids
                gap = p.spawn_overhead_s + max(nominal.lifetime_s(k) for k in kids)
            elif tool is not None:
                lo, hi = (p.threshold_s, math.inf) if long_call else (0.0, p.threshold_s)
                gap = tool.duration_s.sample(rng, lo, hi)
            gap = self._round_gap(gap, long_call) if tool is not None else 0.0
            steps.append(TraceStep(prompt, output, reused, gap, tool_name))
            elapsed += gap
            if tool is not None:
                prompt, reused = self._next_prompt(role, prompt, output, tool)
        start_s = round(start_s, 3)
        program = TraceProgram(pid, tuple(steps), parent, start_s, role_name, role.anchor_tokens)
        return [program, *children]

    def _round_gap(self, gap: float, long_call: bool) -> float:
        """Millisecond precision, without rounding a call across the threshold."""
        t = self.preset.threshold_s
        return max(round(gap, 3), t) if long_call else min(round(gap, 3), t - 0.001)

    def _next_prompt(self, role: Role, prompt: int, output: int, tool: Tool) -> tuple[int, int]:
        """Append output + tool result; compact to prefix + summary past the context cap."""
        result = round(tool.result_tokens.sample(self.rng, lo=1))
        result = min(result, self.preset.max_result_tokens)  # truncated, as agents do
        if prompt + output + result <= self.preset.max_context_tokens:
            return prompt + output + result, prompt + output
        summary = round(self.preset.summary_tokens.sample(self.rng, lo=1))
        return role.anchor_tokens + summary + result, role.anchor_tokens

    def _spawn(self, pid: str, done: int, start_s: float) -> list[TraceProgram]:
        """The parallel children of one spawn (subagents spawn no further subagents)."""
        roles = self.preset.subagents
        names = list(roles)
        kids: list[TraceProgram] = []
        for k in range(self.preset.fanout.count(self.rng)):
            name = self.rng.choices(names, weights=[roles[n].weight for n in names])[0]
            child_id = f"{pid}.sa{done + k + 1}"
            kids += self.build(child_id, name, roles[name], parent=pid, start_s=start_s)
        return kids


def generate(preset: Preset, programs: int, seed: int) -> Iterator[TraceProgram]:
    """`programs` main programs, each followed by its subagents, deterministic in `seed`."""
    builder = _ProgramBuilder(preset, random.Random(seed))
    for i in range(programs):
        yield from builder.build(f"s{seed}-{i:04d}", "main", preset.main, None, 0.0)
