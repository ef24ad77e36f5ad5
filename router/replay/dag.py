"""A seeded generator of multi-agent applications whose agents form a DAG (Tokencake §2.1,
§7.1: Code-Writer, Deep-Research).

Shape: an application is a graph of agent roles; an edge a -> b says b starts from a's
result. Each task instantiates every role once or several times (`copies`: parallel
programmers, searchers), so a role fans out into instances and the next role fans them
back in. A role's instance waits for every instance of the roles it `needs` (a barrier:
the integrator after all testers) and for instance i of the roles it `pairs` with (a
pipeline: reviewer i after programmer i). Every instance is one program: its first prompt
is its role's *anchor* (system prompt + tool schemas, the same tokens in every task:
`anchor_tokens`), the task statement, the final answers of the instances it waited for and
its own brief; then a tool loop (calls that end in a tool call with the tool's duration,
its result appended) and a final answer. Contexts grow append-only, each call reusing the
previous one.

Trace layout: the app has exactly one sink role with one instance, the role that answers
the user (integrator, citation checker); it is the task's main program (`app`, and the
app's `graph` of role edges a graph-aware router registers), and every other instance is a
subagent of it (`parent_id`), so the task ends when its answer is complete. Dependencies are
hand-overs (`after`): an instance's first call waits for the last calls of the instances it
needs, so a replay under load keeps the order; `start_s` (the nominal start, 0 for
sources) only matters for roles that need nobody. Tool durations follow MCP's measured
ranges (Tokencake Table 1): file system and git ~100 ms, web search 1-5 s, test runs and
analyses seconds to tens of seconds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field, model_validator

from router.policy.app_graph import check_edges, roles_of, shapes
from router.replay.generate import Dist, StrictModel, Tool, check_loop_tools
from router.replay.trace import TraceProgram, TraceStep
from router.replay.trace_stats import Nominal


class Agent(StrictModel):
    """One agent role of the app: its place in the graph, prompt and tool loop."""

    anchor_tokens: int = Field(ge=0)  # system prompt + tool schemas + few-shots
    copies: Dist | str = Dist(median=1.0)  # instances per task; a role name: as many as it
    needs: list[str] = []  # every instance of these roles ends before any instance starts
    pairs: list[str] = []  # instance i of these roles ends before instance i starts
    reads_task: bool = True  # the task statement is in its first prompt
    brief_tokens: Dist = Dist(median=80.0, sigma=0.3)  # its own instructions
    output_tokens: Dist  # its final answer (what the roles after it read)
    tool_calls: Dist | None = None  # calls in its tool loop (None: no tools)
    call_tokens: Dist = Dist(median=80.0, sigma=0.4)  # output of a call that ends in a tool
    tools: dict[str, Tool] = {}

    @model_validator(mode="after")
    def _tools_for_loops(self) -> Agent:
        check_loop_tools(self.tool_calls is not None, self.tools, "an agent with tool_calls")
        return self


class DagPreset(StrictModel):
    kind: Literal["dag"] = "dag"
    name: str
    app: str  # the application's id (what requests carry as app_id)
    description: str = ""
    nominal_ttft_s: float = Field(default=Nominal.ttft_s, ge=0)
    nominal_decode_tok_s: float = Field(default=Nominal.decode_tok_s, gt=0)
    task_tokens: Dist  # the user's request
    agents: dict[str, Agent]

    @model_validator(mode="after")
    def _graph_is_an_app(self) -> DagPreset:
        names = set(self.agents)
        for name, agent in self.agents.items():
            unknown = sorted(set(agent.needs + agent.pairs) - names)
            if unknown:
                raise ValueError(f"agents.{name}: unknown role {unknown[0]!r}")
            if isinstance(agent.copies, str):
                ref = self.agents.get(agent.copies)
                if ref is None or isinstance(ref.copies, str):
                    raise ValueError(
                        f"agents.{name}.copies: {agent.copies!r} must be a role whose copies "
                        "is a distribution"
                    )
            for other in agent.pairs:
                if self._copies_key(other) != self._copies_key(name):
                    raise ValueError(f"agents.{name}: pairs with {other!r}, which has other copies")
        check_edges(list(self.edges), "agents")  # acyclic
        sinks = [n for n in self.agents if n not in {a for a, _ in self.edges}]
        if len(sinks) != 1:
            raise ValueError(f"an app needs exactly one final role (no role after it), got {sinks}")
        if self._copies_key(sinks[0]) is not None:
            raise ValueError(f"the final role {sinks[0]!r} must have one instance per task")
        lone = sorted(names - set(roles_of(self.edges)))
        if lone and len(self.agents) > 1:
            raise ValueError(f"agents.{lone[0]}: not connected to the rest of the app")
        return self

    def _copies_key(self, name: str) -> str | None:
        """Which role's count `name` follows (None: a fixed single instance)."""
        copies = self.agents[name].copies
        if isinstance(copies, str):
            return copies
        return None if copies.median == 1 and copies.sigma == 0 else name

    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        """Role edges a -> b (b needs or pairs with a), in declaration order."""
        return tuple(
            (dep, name)
            for name, agent in self.agents.items()
            for dep in dict.fromkeys(agent.needs + agent.pairs)
        )

    @property
    def sink(self) -> str:
        return next(n for n in self.agents if n not in {a for a, _ in self.edges})

    @property
    def nominal(self) -> Nominal:
        return Nominal(self.nominal_ttft_s, self.nominal_decode_tok_s)


@dataclass
class _Instance:
    """One agent instance of a task, built in graph order."""

    program_id: str
    steps: tuple[TraceStep, ...]
    start_s: float
    end_s: float
    answer: int  # tokens of its final answer


class _TaskBuilder:
    def __init__(self, preset: DagPreset, rng: random.Random) -> None:
        self.preset, self.rng = preset, rng
        self.nominal = preset.nominal
        depth = {name: shape.depth for name, shape in shapes(preset.edges).items()}
        self.order = sorted(preset.agents, key=lambda n: depth.get(n, 1))

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for name, agent in self.preset.agents.items():
            if not isinstance(agent.copies, str):
                counts[name] = agent.copies.count(self.rng)
        for name, agent in self.preset.agents.items():
            if isinstance(agent.copies, str):
                counts[name] = counts[agent.copies]
        return counts

    def build(self, task_id: str) -> list[TraceProgram]:
        p = self.preset
        task = round(p.task_tokens.sample(self.rng, lo=1))
        counts = self._counts()
        made: dict[str, list[_Instance]] = {}
        sink = p.sink
        for name in self.order:
            agent = p.agents[name]
            made[name] = []
            for i in range(counts[name]):
                waits = [q for dep in agent.needs for q in made[dep]]
                waits += [made[dep][i] for dep in agent.pairs]
                waits = list({q.program_id: q for q in waits}.values())
                pid = task_id if name == sink else _instance_id(task_id, name, i, counts[name])
                made[name].append(self._instance(pid, agent, task, waits))
        root = made[sink][0]
        main = TraceProgram(
            root.program_id,
            root.steps,
            None,
            0.0,
            sink,
            p.agents[sink].anchor_tokens,
            app=p.app,
            graph=p.edges,
        )
        children = [
            TraceProgram(
                q.program_id,
                q.steps,
                task_id,
                round(q.start_s, 3),
                name,
                p.agents[name].anchor_tokens,
                app=p.app,
            )
            for name in self.order
            if name != sink
            for q in made[name]
        ]
        return [main, *children]

    def _instance(self, pid: str, agent: Agent, task: int, waits: list[_Instance]) -> _Instance:
        """The instance's calls on the nominal timeline, from the end of what it waits for."""
        rng = self.rng
        start = max((q.end_s for q in waits), default=0.0)
        prompt = agent.anchor_tokens + (task if agent.reads_task else 0)
        prompt += sum(q.answer for q in waits) + round(agent.brief_tokens.sample(rng, lo=1))
        after = tuple((q.program_id, len(q.steps) - 1) for q in waits)
        calls = agent.tool_calls.count(rng, lo=0) if agent.tool_calls is not None else 0
        steps: list[TraceStep] = []
        now, context = start, 0
        for k in range(calls + 1):
            dist = agent.call_tokens if k < calls else agent.output_tokens
            out = round(dist.sample(rng, lo=1))
            step = TraceStep(prompt, out, context, after=() if k else after)
            now += self.nominal.inference_s(step)
            context = prompt + step.output_tokens
            if k < calls:
                name = rng.choices(list(agent.tools), [t.weight for t in agent.tools.values()])[0]
                tool = agent.tools[name]
                step = replace(step, tool_s=round(tool.duration_s.sample(rng), 3), tool=name)  # type: ignore[union-attr]
                now += step.tool_s
                prompt = context + round(tool.result_tokens.sample(rng, lo=1))
            steps.append(step)
        return _Instance(pid, tuple(steps), start, now, steps[-1].output_tokens)


def _instance_id(task_id: str, name: str, i: int, count: int) -> str:
    return f"{task_id}.{name}" if count == 1 else f"{task_id}.{name}.{i}"


def generate(preset: DagPreset, tasks: int, seed: int) -> Iterator[TraceProgram]:
    """`tasks` tasks (the final role's program, then every other instance), deterministic
    in `seed`."""
    builder = _TaskBuilder(preset, random.Random(seed))
    for i in range(tasks):
        yield from builder.build(f"d{seed}-t{i:04d}")
