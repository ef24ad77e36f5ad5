"""Golden traces of every registered policy: what it answers, event by event, on fixed loads.

A closed-loop, seeded driver (no engine, no clock but a virtual one) runs a policy the way
the shells do (`router.policy.base`: `on_prompt` + `on_request`, `route` for every held
request after each call, `on_response`, `on_tool_start`, `on_tool_end`, `cancel` at a gate
timeout, `end`, `tick` and `next_wakeup` wake-ups, `observe_step`, replica faults and
budget changes, and the agent-runtime calls `observe` / `register_app` /
`runtime_actions` of the policies that have them) and records, per call, the moves, the
held requests it let through (`route`), the hints, the runtime actions and the next
wake-up; now and then a snapshot of what the admin API reads (`describe`, all hints, the
learnt prices). The load mixes single agents of a few roles
(a shared anchor per role), pipeline apps (planner -> coder -> tester, each stage a
program handed the work by the one before) and All-Gather tasks in explicit rounds, with
heavy-tailed tool calls, abandoned programs (lease expiry) and gate timeouts, under GPU and
host budgets tight enough that every policy moves programs.

`tests/test_policy_golden.py` replays it against the committed records in
`tests/golden/policy/` (one gzipped JSON line per call, per policy and replica count), so a
change that is meant to keep behaviour (a refactor, a speed-up) proves it move for move.
A change that is meant to change behaviour regenerates them, in one command:

    python -m tests.policy_golden --write          # every policy, 1 and 3 replicas
    python -m tests.policy_golden --write mori     # one policy
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import heapq
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from router.config import RouterConfig
from router.policy import REGISTRY, PolicyConfig, make_policy
from router.policy.base import Policy
from router.policy.runtime import AgentEvent, EventKind
from router.policy.types import Move, ReplicaCapacity, Segment

GOLDEN = Path(__file__).resolve().parent / "golden" / "policy"
REPLICAS = (1, 3)
CALLS = 2500  # policy calls recorded per trace
SEED = 38
GPU_TOKENS = 40_000  # per replica: a handful of the load's contexts
CPU_TOKENS = 50_000
CONFIG = {"lease_s": 240.0, "aging_s": 30.0}
GATE_TIMEOUT_S = 60.0  # a held request is cancelled after this long, and sent again
ROLES = ("planner", "coder", "tester", "reviewer")
PIPELINE = (("planner", "coder"), ("coder", "tester"))
TOOLS = (("Read", 0.3), ("Edit", 0.6), ("Bash:pytest", 12.0), ("Bash:ls", 0.2), ("WebFetch", 4.0))
SNAPSHOT_EVERY = 97  # calls between two recorded snapshots (`_snapshot`)


def trace_name(policy: str, replicas: int) -> str:
    return f"{policy}-{replicas}r"


def golden_path(policy: str, replicas: int) -> Path:
    return GOLDEN / f"{trace_name(policy, replicas)}.jsonl.gz"


def _chain(previous: str, content: str) -> str:
    return hashlib.blake2b(f"{previous}\0{content}".encode(), digest_size=6).hexdigest()


def _segments(blocks: list[tuple[str, int]]) -> tuple[Segment, ...]:
    """A prompt's named blocks (content id, tokens) as chained segments."""
    out, chain = [], ""
    for content, tokens in blocks:
        chain = _chain(chain, content)
        out.append(Segment(chain, content, tokens))
    return tuple(out)


@dataclass
class _Program:
    """One program of the load: its steps to go, its context, its prompt's blocks."""

    pid: str
    role: str
    session: str
    steps_left: int
    tokens: int
    app: str | None = None
    parent: str | None = None
    gather: _Gather | None = None
    abandons: bool = False  # stops without an end: its lease expires
    round_id: str | None = None  # an All-Gather agent's round (explicit)
    blocks: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Gather:
    """An All-Gather task: its agents run in rounds, each after every answer of the last."""

    task: str
    agents: list[_Program] = field(default_factory=list)
    round: int = 0
    answered: set[str] = field(default_factory=set)


class Driver:
    """Runs one policy on the seeded load and records every call's answer."""

    def __init__(
        self,
        policy_name: str | Callable[[PolicyConfig], Policy],
        replicas: int,
        config: PolicyConfig | None = None,
        clock_scale: float | None = None,
        **settings: Any,
    ) -> None:
        """`policy_name`: a registered policy, or what builds one from its config (a row of
        the ladder). `config` replaces CONFIG and `settings`; the policy's clock runs `clock_scale`
        (default: the config's `time_scale`) times faster than the load (`clock`), as a
        live router's runs at --time-scale k."""
        self.name, self.replicas = policy_name, replicas
        self.rng = random.Random(f"{SEED}-{replicas}")  # the same load for every policy
        config = config or PolicyConfig(**CONFIG | settings)
        self.k = config.time_scale if clock_scale is None else clock_scale
        named = isinstance(policy_name, str)
        self.policy: Policy = make_policy(policy_name, config) if named else policy_name(config)
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = count()
        self.now = 0.0
        self.lines: list[list[Any]] = []
        self.gated: dict[str, float] = {}  # held request -> arrival
        self.live: dict[str, _Program] = {}
        self.wake_at: float | None = None
        self.ids = count()
        # optional abilities of some policies (agent runtime layer, app graphs, wake-ups)
        can = self.policy.capabilities
        self._observe = self.policy.observe if can.observes else None
        self._actions = self.policy.runtime_actions if can.acts else None
        self._wakeup = self.policy.next_wakeup if can.wakeups else None
        if can.apps:
            self.policy.register_app("pipe", [list(edge) for edge in PIPELINE])

    # the load -------------------------------------------------------------------------
    def run(self) -> list[list[Any]]:
        mode = self.policy.engine_mode
        for i in range(self.replicas):
            cpu = CPU_TOKENS if mode.host_tier else 0
            self.policy.add_replica(f"r{i}", ReplicaCapacity(GPU_TOKENS, cpu))
        for _ in range(6 * self.replicas + 2):
            self._push(self.rng.uniform(0, 20), "task", None)
        self._push(0.0, "tick", None)
        span = 600.0 / self.replicas  # about the trace's length, in virtual seconds
        self._push(0.3 * span, "capacity", ("r0", 0.75))
        self._push(0.7 * span, "capacity", ("r0", 1.0))
        if self.replicas > 1:
            self._push(0.4 * span, "health", ("r2", False))
            self._push(0.55 * span, "health", ("r2", True))
        while self.heap and len(self.lines) < CALLS:
            self.now, _, kind, payload = heapq.heappop(self.heap)
            getattr(self, f"_on_{kind}")(payload)
        return self.lines

    @property
    def clock(self) -> float:
        """The policy's clock: the load's time over `time_scale` (exact for a power of 2)."""
        return self.now / self.k

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def _pid(self) -> str:
        return f"p{next(self.ids)}"

    def _on_task(self, _: Any) -> None:
        """A new task: a single agent, a pipeline app, or an All-Gather task."""
        kind = self.rng.random()
        if kind < 0.6:
            p = self._program(self.rng.choice(ROLES), None)
            p.abandons = self.rng.random() < 0.1
            self._send(p)
        elif kind < 0.8:
            p = self._program("planner", None, app="pipe")
            p.steps_left = self.rng.randint(2, 4)
            self._send(p)
        else:
            task = f"g{next(self.ids)}"
            gather = _Gather(task)
            for _ in range(3):
                agent = self._program("gatherer", None)
                agent.session, agent.gather, agent.steps_left = task, gather, 4
                agent.blocks = [("@sys-gather", 1200), (f"{task}/scenario", 800)]
                gather.agents.append(agent)
            self._open_round(gather)

    def _program(self, role: str, parent: _Program | None, app: str | None = None) -> _Program:
        pid = self._pid()
        p = _Program(pid, role, parent.session if parent else pid, self.rng.randint(3, 12), 0)
        p.tokens = int(1500 * 8 ** self.rng.random())  # 1.5k-12k tokens
        p.app, p.parent = app, parent.pid if parent else None
        p.blocks = [(f"anchor:{role}", 1000)]
        self.live[pid] = p
        return p

    def _open_round(self, gather: _Gather) -> None:
        gather.round += 1
        gather.answered = set()
        gathered = [(f"{gather.task}/r{gather.round - 1}/{a.pid}", 300) for a in gather.agents]
        for agent in gather.agents:
            if agent.pid not in self.live:
                continue
            if gather.round > 1:
                agent.blocks = agent.blocks[:2] + gathered
            agent.round_id = f"{gather.task}/round{gather.round}"
            self._send(agent)

    # one program's requests -------------------------------------------------------------
    def _send(self, p: _Program) -> None:
        pid = p.pid
        if self._observe is not None:
            event = AgentEvent(
                EventKind.REQUEST, self.clock, pid, p.role, p.session, 1000, parent=p.parent,
                app=p.app,
            )  # fmt: skip
            self._observe(event)
        blocks = [*p.blocks, (f"{pid}/own{p.steps_left}", 200)]
        self.policy.on_prompt(pid, _segments(blocks), p.round_id)
        self._record("request", pid, self.policy.on_request(pid, self.clock, p.tokens))
        if pid not in self.gated and self.policy.route(pid) is None:
            self.gated[pid] = self.now
            self._push(self.now + GATE_TIMEOUT_S, "timeout", (pid, self.now))

    def _forward(self, pid: str, replica: str) -> None:
        p = self.live[pid]
        step_s = 0.4 + p.tokens / 8000 + self.rng.expovariate(1.0)
        self._push(self.now + step_s, "done", (pid, replica, self.now))

    def _on_done(self, payload: tuple[str, str, float]) -> None:
        pid, replica, forwarded = payload
        p = self.live[pid]
        out = self.rng.randint(50, 800)
        ttft = (self.now - forwarded) * 0.3
        cached = int(p.tokens * self.rng.random())
        host = int((p.tokens - cached) * self.rng.random())
        step_s = (self.now - forwarded) / self.k
        self.policy.observe_step(replica, p.tokens, cached, host, ttft / self.k, out, step_s)
        p.tokens += out + self.rng.randint(0, 1500)
        p.steps_left -= 1
        self._record("response", pid, self.policy.on_response(pid, self.clock, p.tokens))
        if p.gather is not None:
            self._gathered(p)
        elif p.steps_left > 0:
            self._tool_call(p)
        elif p.app == "pipe" and p.role != "tester":
            child = self._program(dict(PIPELINE)[p.role], p, app="pipe")
            self._end(p)
            self._send(child)
        elif p.abandons:
            del self.live[pid]  # silent from now: the lease ends it
            self._push(self.now, "task", None)
        else:
            self._end(p)
            self._push(self.now + self.rng.uniform(0, 5), "task", None)

    def _tool_call(self, p: _Program) -> None:
        tool, mean = self.rng.choice(TOOLS)
        duration = self.rng.expovariate(1 / mean) * (30 if self.rng.random() < 0.05 else 1)
        hint = mean / self.k if self.rng.random() < 0.3 else None  # the client's clock
        self._record(
            "tool_start", p.pid, self.policy.on_tool_start(p.pid, self.clock, tool, p.role, hint)
        )
        if self.rng.random() < 0.3:
            self._push(self.now + duration, "tool_end", p.pid)
        self._push(self.now + duration + 0.01, "send", p.pid)

    def _gathered(self, p: _Program) -> None:
        gather = p.gather
        assert gather is not None
        gather.answered.add(p.pid)
        self._record(
            "tool_start", p.pid, self.policy.on_tool_start(p.pid, self.clock, "gather", p.role)
        )
        alive = [a for a in gather.agents if a.pid in self.live]
        if gather.answered >= {a.pid for a in alive}:
            if p.steps_left > 0:
                self._push(self.now + 1.0, "round", gather)
            else:
                for a in alive:
                    self._end(a)
                self._push(self.now + 2.0, "task", None)

    def _on_round(self, gather: _Gather) -> None:
        self._open_round(gather)

    def _on_send(self, pid: str) -> None:
        if pid in self.live:
            self._send(self.live[pid])

    def _on_tool_end(self, pid: str) -> None:
        if pid in self.live:
            self._record("tool_end", pid, self.policy.on_tool_end(pid, self.clock))

    def _on_timeout(self, payload: tuple[str, float]) -> None:
        """A request held since `arrival` gives up, and is sent again a little later."""
        pid, arrival = payload
        if self.gated.get(pid) != arrival:
            return
        del self.gated[pid]
        self._record("cancel", pid, self.policy.cancel(pid, self.clock))
        self._push(self.now + 2.0, "send", pid)

    def _end(self, p: _Program) -> None:
        self.live.pop(p.pid, None)
        self.gated.pop(p.pid, None)
        if self._observe is not None:
            self._observe(AgentEvent(EventKind.END, self.clock, p.pid))
        self._record("end", p.pid, self.policy.end(p.pid, self.clock))

    # the shell's timers and faults ------------------------------------------------------
    def _on_tick(self, _: Any) -> None:
        self._record("tick", None, self.policy.tick(self.clock))
        self._push(self.now + self.policy.config.tick_s * self.k, "tick", None)

    def _on_wake(self, at: float) -> None:
        if at == self.wake_at:
            self.wake_at = None
            self._record("wake", None, self.policy.tick(self.clock))

    def _on_capacity(self, payload: tuple[str, float]) -> None:
        replica, share = payload
        # the host tier shrinks more (its overflow goes to WAITING)
        capacity = ReplicaCapacity(int(GPU_TOKENS * share), int(CPU_TOKENS * share**3))
        self.policy.set_capacity(replica, capacity)
        self._record("capacity", replica, [])

    def _on_health(self, payload: tuple[str, bool]) -> None:
        replica, healthy = payload
        self._record("health", replica, self.policy.set_healthy(replica, healthy, self.clock))

    # recording ----------------------------------------------------------------------------
    def _record(self, kind: str, subject: str | None, moves: list[Move]) -> None:
        """One call's line: [now, call, subject, moves, let through, hints, actions, wake-up
        (, describe)]; then forward what the call let through, as the shells do."""
        released = {}
        for pid in list(self.gated):
            replica = self.policy.route(pid)
            if replica is not None:
                del self.gated[pid]
                released[pid] = replica
        if kind == "request" and subject not in self.gated and subject not in released:
            replica = self.policy.route(subject)  # type: ignore[arg-type]
            if replica is not None:
                released[subject] = replica  # type: ignore[index]
        hints = self.policy.hint_updates()
        actions = [_action(a) for a in self._actions(self.clock)] if self._actions else []
        wake = self._wakeup(self.clock) if self._wakeup is not None else None
        wake = None if wake is None else wake * self.k  # the load's time
        line: list[Any] = [self.now, kind, subject, [_move(m) for m in moves], released]
        line += [{r: dict(h) for r, h in sorted(hints.items())}, actions, wake]
        if len(self.lines) % SNAPSHOT_EVERY == 0 and self.live:
            line.append(self._snapshot())
        self.lines.append(line)
        for pid, replica in released.items():
            if pid in self.live:
                self._forward(pid, replica)
        if wake is not None and wake != self.wake_at:
            self.wake_at = wake
            self._push(wake, "wake", wake)

    def _snapshot(self) -> dict[str, Any]:
        """What the admin API and the periodic hint sync read: one program's `describe`,
        every hint, the lazy demotions in flight, the largest budget, the learnt prices."""
        policy, replicas = self.policy, sorted(self.policy.tiers.capacity)
        return {
            "describe": policy.describe(min(self.live, key=lambda q: int(q[1:])), self.clock),
            "hints": {r: dict(sorted(h.items())) for r, h in sorted(policy.hints().items())},
            "lazy": [policy.pending_lazy_tokens(r) for r in replicas],
            "largest": policy.largest_gpu_budget(),
            "prices": [policy.prices[r].view() for r in replicas],
        }


def _move(m: Move) -> str:
    return f"{m.program_id} {m.src}>{m.dst} {m.reason}"


def _action(action: Any) -> list[Any]:
    """A runtime action as plain data: its type and fields."""
    fields = action.__dataclass_fields__
    values = [_plain(getattr(action, name)) for name in fields]
    return [type(action).__name__, *values]


def _plain(value: Any) -> Any:
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    return value


def record(policy: str, replicas: int, **settings: Any) -> list[str]:
    """The trace's lines as JSON text (what the golden file holds); `settings` change the
    policy's knobs (the test that the comparison can fail)."""
    lines = Driver(policy, replicas, **settings).run()
    return [json.dumps(line, separators=(",", ":")) for line in lines]


def record_scaled(policy: str, replicas: int, time_scale: float, **settings: Any) -> list[str]:
    """The trace as a live router at `time_scale` (`router.config`: its timers divided)
    answers it, its clock that much faster than the load."""
    config = RouterConfig(replicas=["http://replica:1"], time_scale=time_scale, **CONFIG | settings)
    return load_lines(Driver(policy, replicas, config.policy_config()))


def load_lines(driver: Driver) -> list[str]:
    """`driver`'s lines, every time in them in the load's seconds: the snapshots (describe,
    learnt prices) are left out, they speak the policy's clock."""
    return [json.dumps(line[:8], separators=(",", ":")) for line in driver.run()]


def read_golden(policy: str, replicas: int) -> list[str]:
    with gzip.open(golden_path(policy, replicas), "rt") as fh:
        return fh.read().splitlines()


def write_golden(policy: str, replicas: int) -> Path:
    path = golden_path(policy, replicas)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(record(policy, replicas)) + "\n"
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        fh.write(text.encode())  # mtime 0: the same trace gives the same bytes
    return path


def first_difference(expected: list[str], got: list[str]) -> str | None:
    """Where two recordings part, with the calls just before, or None if equal."""
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            before = "\n".join(f"  {line}" for line in got[max(0, i - 3) : i])
            return f"call {i} differs\n{before}\n- golden: {want}\n+ now:    {have}"
    if len(expected) != len(got):
        return f"{len(expected)} calls in the golden file, {len(got)} now"
    return None


def traces() -> Iterator[tuple[str, int]]:
    for policy in REGISTRY:
        for replicas in REPLICAS:
            yield policy, replicas


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the golden files")
    parser.add_argument("policies", nargs="*", help="default: every registered policy")
    args = parser.parse_args(argv)
    unknown = set(args.policies) - set(REGISTRY)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(REGISTRY)}")
    failed = 0
    for policy, replicas in traces():
        if args.policies and policy not in args.policies:
            continue
        if args.write:
            out(f"wrote {write_golden(policy, replicas).relative_to(Path.cwd())}")
            continue
        diff = first_difference(read_golden(policy, replicas), record(policy, replicas))
        failed += diff is not None
        out(f"{trace_name(policy, replicas)}: {diff or 'same'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
