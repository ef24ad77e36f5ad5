"""A seeded generator of supervisor-style multi-agent apps, calibrated to CacheSage §3.1.

Shape (AutoGen SelectorGroupChat, LangGraph supervisors): a *task* is worked on by N
specialist roles that take turns on one shared thread (the task, then every message so far),
and a *selector* (the supervisor) picks the next speaker before each turn. The speaker
sequence is a first-order Markov chain (`start`, `transitions`), optionally blended with a
uniform choice among the other roles (`mix`) to lower its predictability; the relative
conditional entropy reduction R = 1 - H(next | current) / H(next) is what `mori trace
stats` reports (CacheSage measures 0.40-0.48).

Every role keeps its own context, append-only (AutoGen broadcasts every message to every
participant): its prompt is its *anchor* (system prompt + tools + few-shots, the same
tokens in every task: `anchor_tokens`) followed by the thread so far. A turn is one LLM call,
or a tool loop: calls that each end in a tool call (tool time, result appended), then the
final answer. The selector's prompt is its own anchor plus the thread; its answer (a role
name) is not appended.

Trace layout (DESIGN.md format): one main program per task, the selector (`agent` =
selector name), whose step t dispatches turn t (`tool` = the speaker's role, `tool_s` = the
turn's nominal length) and whose last step reads the final answer; and one subagent program
per (task, role) that spoke (`parent_id` = the task, `start_s` = its first turn's start),
whose gap between two turns is a `handoff` lasting the other roles' turns. Hand-overs are
dependencies (`after`): a turn's first call waits for the selector's call that dispatched it,
and the selector's next call waits for the turn's last call, so a replay under load keeps
the speaking order; `start_s` and the gaps before such calls are nominal (`Nominal`: ttft +
output / decode rate per call), as in the single-agent generator.

Other kinds of multi-agent app (a DAG of dependent agents, Tokencake's workloads) add a
preset model and a generator next to this one and register them by `kind` in
`router.replay.generators`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import Field, model_validator

from router.replay.generate import Dist, StrictModel, Tool, check_loop_tools
from router.replay.trace import TraceProgram, TraceStep
from router.replay.trace_stats import Nominal

HANDOFF_TOOL = "handoff"  # a role's gap between its turns: the other roles speak


class Role(StrictModel):
    """One specialist: its anchor, how long it answers, and its tool loop."""

    anchor_tokens: int = Field(ge=0)  # system prompt + tool definitions + few-shots
    output_tokens: Dist  # a final answer
    tool_p: float = Field(default=0.0, ge=0, le=1)  # share of turns that run a tool loop
    tool_calls: Dist = Dist(median=1.0)  # tool calls in a tool loop (at least one)
    call_tokens: Dist = Dist(median=60.0, sigma=0.4)  # output of a call that ends in a tool
    tools: dict[str, Tool] = {}

    @model_validator(mode="after")
    def _tools_for_loops(self) -> Role:
        check_loop_tools(self.tool_p > 0, self.tools, "a role with tool_p > 0")
        return self


class Selector(StrictModel):
    """The supervisor that picks each turn's speaker (its answer is a role name)."""

    name: str = "selector"
    anchor_tokens: int = Field(ge=0)
    output_tokens: Dist = Dist(median=6.0, sigma=0.3, min=1)


class SupervisorPreset(StrictModel):
    kind: Literal["supervisor"] = "supervisor"
    name: str
    description: str = ""
    nominal_ttft_s: float = Field(default=Nominal.ttft_s, ge=0)
    nominal_decode_tok_s: float = Field(default=Nominal.decode_tok_s, gt=0)
    task_tokens: Dist  # the task statement that opens the thread
    turns: Dist  # speaker turns per task
    selector: Selector
    roles: dict[str, Role]
    start: dict[str, float]  # first speaker: role -> weight
    transitions: dict[str, dict[str, float]]  # next speaker given the current one
    mix: float = Field(default=0.0, ge=0, le=1)  # blend each row with uniform over the others

    @model_validator(mode="after")
    def _chain_is_closed(self) -> SupervisorPreset:
        roles = set(self.roles)
        if len(roles) < 2:
            raise ValueError("a supervisor app needs at least two roles")
        if self.selector.name in roles:
            raise ValueError(f"the selector's name {self.selector.name!r} is also a role")
        rows = {"start": self.start, **{f"transitions.{r}": w for r, w in self.transitions.items()}}
        for where, weights in rows.items():
            unknown = sorted(set(weights) - roles)
            if unknown:
                raise ValueError(f"{where}: unknown role {unknown[0]!r}")
            if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
                raise ValueError(f"{where}: weights must be >= 0 with a positive sum")
        missing = sorted(roles - set(self.transitions))
        if missing:
            raise ValueError(f"transitions: no row for role {missing[0]!r}")
        return self

    @property
    def nominal(self) -> Nominal:
        return Nominal(self.nominal_ttft_s, self.nominal_decode_tok_s)

    def next_weights(self, current: str) -> dict[str, float]:
        """The row of `current`, normalised and blended with uniform over the other roles."""
        row = self.transitions[current]
        total = sum(row.values())
        others = [r for r in self.roles if r != current]
        out = {r: (1 - self.mix) * row.get(r, 0.0) / total for r in self.roles}
        for r in others:
            out[r] += self.mix / len(others)
        return {r: w for r, w in out.items() if w > 0}


@dataclass
class _Speaker:
    """One role's program in a task, built turn by turn."""

    start_s: float
    steps: list[TraceStep] = field(default_factory=list)
    context: int = 0  # last prompt + output: the prefix of its next prompt
    free_at: float = 0.0  # nominal end of its last call


class _TaskBuilder:
    """Draws one task: the speaker sequence, then every call on the nominal timeline."""

    def __init__(self, preset: SupervisorPreset, rng: random.Random) -> None:
        self.preset, self.rng = preset, rng
        self.nominal = preset.nominal

    def _pick(self, weights: dict[str, float]) -> str:
        names = list(weights)
        return self.rng.choices(names, weights=[weights[n] for n in names])[0]

    def speakers(self) -> list[str]:
        p = self.preset
        seq = [self._pick(p.start)]
        for _ in range(p.turns.count(self.rng) - 1):
            seq.append(self._pick(p.next_weights(seq[-1])))
        return seq

    def build(self, task_id: str) -> list[TraceProgram]:
        p, rng = self.preset, self.rng
        thread = round(p.task_tokens.sample(rng, lo=1))
        sel = p.selector
        selector: list[TraceStep] = []
        speakers: dict[str, _Speaker] = {}
        now = 0.0
        seen = 0  # thread tokens the selector saw in its previous call
        turn_end: tuple[str, int] | None = None  # the last turn's final call
        for role_name in self.speakers():
            call = self._selector_call(thread, seen, bool(selector), turn_end)
            seen = thread
            now += self.nominal.inference_s(call)
            turn_start = now
            dispatch = (task_id, len(selector))
            now, thread = self._turn(speakers, role_name, thread, now, dispatch)
            turn_end = (f"{task_id}.{role_name}", len(speakers[role_name].steps) - 1)
            selector.append(_gap(call, now - turn_start, role_name))
        selector.append(self._selector_call(thread, seen, bool(selector), turn_end))
        main = TraceProgram(task_id, tuple(selector), None, 0.0, sel.name, sel.anchor_tokens)
        children = [
            TraceProgram(
                f"{task_id}.{name}",
                tuple(s.steps),
                task_id,
                round(s.start_s, 3),
                name,
                p.roles[name].anchor_tokens,
            )
            for name, s in speakers.items()
        ]
        return [main, *children]

    def _selector_call(
        self, thread: int, seen: int, again: bool, turn_end: tuple[str, int] | None
    ) -> TraceStep:
        """The selector reads the thread once the last turn ended (its hand-over)."""
        sel = self.preset.selector
        out = round(sel.output_tokens.sample(self.rng, lo=1))
        reused = sel.anchor_tokens + seen if again else 0
        after = (turn_end,) if turn_end else ()
        return TraceStep(sel.anchor_tokens + thread, out, reused, after=after)

    def _turn(
        self,
        speakers: dict[str, _Speaker],
        name: str,
        thread: int,
        now: float,
        dispatch: tuple[str, int],
    ) -> tuple[float, int]:
        """One turn of `name` from `now`, once the selector's `dispatch` call ended: its
        calls on the thread; returns (end, thread)."""
        role, rng = self.preset.roles[name], self.rng
        sp = speakers.get(name)
        if sp is None:
            sp = speakers[name] = _Speaker(now)
        elif sp.steps:  # the gap since its last call: the other roles' turns
            sp.steps[-1] = _gap(sp.steps[-1], now - sp.free_at, HANDOFF_TOOL)
        calls = role.tool_calls.count(rng) if rng.random() < role.tool_p else 0
        for k in range(calls + 1):
            dist = role.call_tokens if k < calls else role.output_tokens
            prompt = role.anchor_tokens + thread
            out = round(dist.sample(rng, lo=1))
            step = TraceStep(prompt, out, sp.context, after=() if k else (dispatch,))
            now += self.nominal.inference_s(step)
            thread += step.output_tokens  # the call (or the answer) joins the thread
            sp.context = prompt + step.output_tokens
            if k < calls:
                tool_name = self._pick({n: t.weight for n, t in role.tools.items()})
                tool = role.tools[tool_name]
                gap = round(tool.duration_s.sample(rng), 3)  # type: ignore[union-attr]
                step = _gap(step, gap, tool_name)
                now += step.tool_s
                thread += round(tool.result_tokens.sample(rng, lo=1))
            sp.steps.append(step)
        sp.free_at = now
        return now, thread


def _gap(step: TraceStep, seconds: float, tool: str) -> TraceStep:
    """The step with the gap that follows it (a tool call, a handoff, a dispatched turn)."""
    return replace(step, tool_s=round(seconds, 3), tool=tool)


def generate(preset: SupervisorPreset, tasks: int, seed: int) -> Iterator[TraceProgram]:
    """`tasks` tasks (a selector program, then its roles' programs), deterministic in `seed`."""
    builder = _TaskBuilder(preset, random.Random(seed))
    for i in range(tasks):
        yield from builder.build(f"s{seed}-t{i:04d}")
