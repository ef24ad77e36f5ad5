"""A seeded generator of All-Gather multi-agent apps, shaped like TokenDance's workloads (§2.1).

A *task* (one simulation session) runs N agents in synchronized rounds. In round t every
agent answers once; the scheduler gathers the N answers and sends them back to every agent,
which answers again in round t + 1 only once all N have answered (the barrier: each step
waits for every agent's previous step, `TraceStep.after`). Agent i's prompt (Eq. 2, the
`history_first` layout the paper measures) is its own context so far (the app's system
prompt, the task's scenario, its private persona and memory, and every earlier round), then
the other agents' answers of the last round in an agent-specific order, then the round's
task; what an engine can share exactly across agents is only the common start (system
prompt and scenario): the gathered answers sit at a different offset in every prompt.

The `shared_first` layout is the exact control the paper lacks: the same tokens, but every
round's gathered answers go right after the scenario, in one order for everybody, then the
round's task, then the agent's private persona and memory. Agents then share everything but
their private tail, and a prefix cache stores it once; the private tail is recomputed every
round (it now follows content that changed).

Every prompt names its blocks (`TraceStep.segments`): "@<app>/system", "scenario",
"persona/<agent>", "task/<round>", "answer/<agent>/<round>" (an agent's own answer and the
same text gathered into the others' prompts have one id), and each step its round id.
Agent 0 is the task's main program, the others its subagents; the gap after a step is the
barrier (`tool` "gather").
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from router.replay.generate import Dist, StrictModel
from router.replay.trace import TraceProgram, TraceStep

GATHER_TOOL = "gather"  # an agent's gap between rounds: the others finish the round


class AllgatherPreset(StrictModel):
    kind: Literal["allgather"] = "allgather"
    name: str
    description: str = ""
    agents: int = Field(ge=2)  # agents per round
    rounds: Dist  # rounds per task
    system_tokens: int = Field(ge=0)  # the app's system prompt: every agent of every task
    scenario_tokens: Dist | None = None  # the task's scenario: every agent of the task
    private_tokens: Dist  # an agent's persona and private memory (its history's start)
    output_tokens: Dist  # an agent's answer in a round
    task_tokens: Dist  # the round's instruction (the same text for all its agents)
    layout: Literal["history_first", "shared_first"] = "history_first"


class _Draws:
    """Every token count of one task, drawn before any layout (so both layouts of a seed
    are the same workload)."""

    def __init__(self, preset: AllgatherPreset, rng: random.Random) -> None:
        n = preset.agents
        self.rounds = preset.rounds.count(rng)
        self.scenario = (
            round(preset.scenario_tokens.sample(rng, lo=1)) if preset.scenario_tokens else 0
        )
        self.private = [round(preset.private_tokens.sample(rng, lo=1)) for _ in range(n)]
        self.tasks = [round(preset.task_tokens.sample(rng, lo=1)) for _ in range(self.rounds)]
        self.answers = [
            [round(preset.output_tokens.sample(rng, lo=1)) for _ in range(n)]
            for _ in range(self.rounds)
        ]


def _answer(agent: int, rnd: int) -> str:
    return f"answer/{agent}/{rnd}"


def _gathered(agent: int, rnd: int, draws: _Draws, n: int) -> list[tuple[str, int]]:
    """The others' answers of round `rnd` as agent `agent` receives them: rotated so that
    every agent reads them in its own order (TokenDance Fig. 1)."""
    order = [(agent + k) % n for k in range(1, n)]
    return [(_answer(j, rnd), draws.answers[rnd][j]) for j in order]


def _history_first(
    preset: AllgatherPreset, draws: _Draws, agent: int
) -> list[tuple[list[tuple[str, int]], int]]:
    """Per round: (the blocks after those kept from the previous prompt, blocks kept)."""
    head = [(f"@{preset.name}/system", preset.system_tokens)] if preset.system_tokens else []
    if draws.scenario:
        head.append(("scenario", draws.scenario))
    head.append((f"persona/{agent}", draws.private[agent]))
    out = [([*head, ("task/0", draws.tasks[0])], 0)]
    kept = len(out[0][0])
    for t in range(1, draws.rounds):
        own = (_answer(agent, t - 1), draws.answers[t - 1][agent])
        new = [own, *_gathered(agent, t - 1, draws, preset.agents), (f"task/{t}", draws.tasks[t])]
        out.append((new, kept))
        kept += len(new)
    return out


def _shared_first(
    preset: AllgatherPreset, draws: _Draws, agent: int
) -> list[tuple[list[tuple[str, int]], int]]:
    """Per round: the scenario, every earlier round's answers in one order, the round's task,
    then the agent's private part (persona and its own answers, already in the gathered
    blocks, so only the persona is private)."""
    head = [(f"@{preset.name}/system", preset.system_tokens)] if preset.system_tokens else []
    if draws.scenario:
        head.append(("scenario", draws.scenario))
    private = (f"persona/{agent}", draws.private[agent])
    out = [([*head, ("task/0", draws.tasks[0]), private], 0)]
    kept = len(head)
    for t in range(1, draws.rounds):
        answers = [(_answer(j, t - 1), draws.answers[t - 1][j]) for j in range(preset.agents)]
        out.append(([*answers, (f"task/{t}", draws.tasks[t]), private], kept))
        kept += len(answers)
    return out


def _steps(
    preset: AllgatherPreset, draws: _Draws, agent: int, ids: list[str]
) -> tuple[TraceStep, ...]:
    layout = _history_first if preset.layout == "history_first" else _shared_first
    steps: list[TraceStep] = []
    tokens: list[int] = []  # the named blocks of the previous prompt
    for t, (new, kept) in enumerate(layout(preset, draws, agent)):
        tokens = tokens[:kept] + [n for _, n in new]
        prompt = sum(tokens)
        reused = sum(tokens[:kept])  # the blocks kept from the last prompt start this one
        if steps and preset.layout == "history_first":  # and the last answer follows them
            reused = steps[-1].input_tokens + steps[-1].output_tokens
        after = tuple((pid, t - 1) for pid in ids) if t else ()
        out = draws.answers[t][agent]
        gap = GATHER_TOOL if t + 1 < draws.rounds else None
        steps.append(TraceStep(prompt, out, reused, 0.0, gap, after, tuple(new), kept, f"r{t}"))
    return tuple(steps)


def generate(preset: AllgatherPreset, tasks: int, seed: int) -> Iterator[TraceProgram]:
    """`tasks` tasks of `preset.agents` agents each, deterministic in `seed` (the layout
    does not change the draws)."""
    rng = random.Random(seed)
    agent_name = f"{preset.name}-agent"
    for i in range(tasks):
        draws = _Draws(preset, rng)
        task = f"s{seed}-t{i:04d}"
        ids = [task if a == 0 else f"{task}.a{a}" for a in range(preset.agents)]
        for a, pid in enumerate(ids):
            yield TraceProgram(
                pid,
                _steps(preset, draws, a, ids),
                None if a == 0 else task,
                0.0,
                agent_name,
                app=preset.name,
            )
