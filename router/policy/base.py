"""The one interface every placement policy implements (MORI, baselines, later ones).

A policy is pure: it is driven by events carrying `now` (an injected clock) and
answers with `Move`s; it never sleeps, awaits or does I/O. The live router, the
simulator and the tests all drive it the same way:

    policy.on_prompt(pid, segments, round_id, hints)      # what the request holds (optional)
    moves = policy.on_request(pid, now, prompt_tokens)   # request arrives
    replica = policy.route(pid)                           # None: the gate holds it
    ...                                                   # forward when routed
    moves = policy.on_response(pid, now, usage_tokens)   # engine answered
    moves = policy.tick(now)                              # periodic rebalance
    hints = policy.hint_updates()                         # push to engines

A request whose program is not routed waits at the gate until a later call's moves
promote it (`route` then answers its replica), or until the shell gives up and calls
`cancel`.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from router.policy.prices import ReplicaPrices
from router.policy.program import Program
from router.policy.rounds import Rounds
from router.policy.tiers import Tiers
from router.policy.types import (
    NO_HINTS,
    WAITING,
    AgentHints,
    EngineMode,
    Hint,
    Move,
    MoveReason,
    Placement,
    ReplicaCapacity,
    Segment,
    Status,
    Tier,
    ToolStart,
)


@dataclass(frozen=True)
class Capabilities:
    """What a policy does beyond the event interface, for the shells to call (declared,
    never probed): `wakeups`, it wants `tick` at `next_wakeup(now)` besides its period;
    `observes`, it reads agent events (`observe`: identity, session, app; the router then
    carries anchors to it); `acts`, it answers runtime actions (`runtime_actions`: scores,
    priorities, warm-ups); `apps`, it takes application graphs (`register_app`,
    `POST /v1/apps`)."""

    wakeups: bool = False
    observes: bool = False
    acts: bool = False
    apps: bool = False


@dataclass
class PolicyConfig:
    """Knobs shared by all policies; a policy ignores those it has no use for."""

    window: int = 4  # idleness window W in cycles (sweep in bench/window_sweep.py)
    tick_s: float = 5.0  # rebalance period (MORI 5)
    lease_s: float = 900.0  # an ACTING program silent this long is ended
    hysteresis: float = 0.2  # idleness margin a swap must clear (stickiness)
    new_program_tokens: int = 2048  # context estimate before the first usage report
    smg_offload: bool = False  # smg baseline: engine host tier on/off
    load_s_per_token: float = 5e-6  # one-way GPU<->host KV copy per token (replica preset)
    predict_lead_s: float = 0.5  # mori: promote this long + load time before tool end
    predict_grace_s: float = 5.0  # mori: room held past a predicted end before demotion
    ewma_alpha: float = 0.3  # mori: weight of the newest tool duration
    hint_alpha: float = 0.5  # mori: weight of a client's predict_time (Tokencake eq. 1)
    # a request held this long goes first and may displace; 0: off; None: the policy's
    # default (mori: on, see docs/policy.md "Aging"; mori-paper: off)
    aging_s: float | None = None
    prefill_s_per_token: float = 5e-5  # recompute price per token at no context, before
    # measurements (replica preset); it grows with context past `attention_tokens` (the
    # context at which attention costs as much as the weights: Llama-3.1-8B's by default)
    attention_tokens: float = 30_000.0
    displace_margin: float = 1.0  # mori: a move pays if expected idle >= margin x its cost
    # mori: ... and if the victim stays away that long with at least this probability
    # (heavy-tailed tool times: the mean residual alone counts on rare hour-long calls)
    displace_confidence: float = 0.3
    # mori: a returning program waits for its own replica until its wait reaches this
    # multiple of the recompute another replica would cost (ski rental; 0: no affinity)
    home_wait: float = 100.0
    # mori: on a replica running at most this many steps, promotions may use the growth
    # band where GPU programs in tool calls expected to stay away a step would absorb the
    # overflow (docs/policy.md "The growth band gives way"; 0: the band always holds)
    band_waiver_steps: int = 8
    # mori: the wait bound of a program in flight (served once): its held step goes ahead of
    # everything once it has waited half of this, taking room from programs in tool calls
    # or holding its replica's room for it; starts wait at the door meanwhile
    # (router.policy.door, docs/policy.md "Overload"; 0: off, and starts are not gated)
    max_step_wait_s: float = 120.0
    # mori: the door lets a start in while the programs in flight on its replica keep less
    # than this share of its GPU room busy (context x share of time reasoning, summed)
    door_load: float = 1.0
    # mori: the door opens up to this many times `door_load` on a replica whose steps in
    # flight stay unheld and whose host tier holds every program of it (1: fixed door)
    door_gain_max: float = 2.0
    # mori: ... and never narrower there than this many times `door_load` (at most
    # `door_gain_max`), strained or not: a parked program keeps its host copy, so a start
    # let in past the estimate costs reloads, not recomputes (1: the gain alone)
    door_gain_min: float = 1.2
    # mori: the longest a start is held at the door; one expected to wait longer is told at
    # once to come back when its turn is expected (429 + Retry-After), keeping its place
    start_hold_s: float = 30.0
    # the shell's gate timeout: a held request is answered 503 after this long; the door
    # refuses a start it does not expect to let in before then, at once
    gate_timeout_s: float = 300.0
    # mori+space (Tokencake §5): critical agent types and their reserved GPU room
    critical_ratio: float = 0.3  # share of the live agent types that are critical
    # static priority (depth x out-degree) weight; the dynamic term of a request waiting
    # tens of seconds is in the hundreds, and the graph must still order the types (a
    # sweep on the DAG presets: bench/results/2026-11-23-space-scheduler.md)
    w_static: float = 100.0
    gpu_usage_high: float = 0.9  # GPU tier use at which the reserved pool grows ...
    gpu_usage_low: float = 0.6  # ... and at which it shrinks
    reserve_step: float = 0.05  # pool change per update, as a share of the GPU budget
    reserve_max: float = 0.2  # the largest pool, as a share of the GPU budget
    # mori+tokendance (TokenDance's KV Collector, exact): a round's requests are released
    # together once every expected member has arrived, or this long after the last one did
    round_gang_s: float = 0.1
    # a round that waited this many x the rounds' mean service time may make rounds that
    # hold GPU room between their own rounds yield it (round-robin at round boundaries)
    round_yield_x: float = 1.0
    # a round's agents are placed on one replica when they share at least this share of
    # their contexts (segments another member holds too); else one by one, as MORI would
    round_share_min: float = 0.5
    # trace seconds per second of the policy's clock: the live router's clock is wall time
    # and its timers come divided already (router.config.SCALED_TIMERS); the durations
    # built into the stages (aging's default, the door's gain rates, first step and round
    # times) are divided by this, so a router running x5 keeps the simulator's pace
    time_scale: float = 1.0


HINT_OF_TIER = {Tier.GPU: Hint.BUSY, Tier.CPU: Hint.IDLE, Tier.WAITING: Hint.INACTIVE}


class Policy(ABC):
    """Common bookkeeping; subclasses decide admission (`_admit`) and rebalancing (`_rebalance`)."""

    name: ClassVar[str]
    capabilities: Capabilities = Capabilities()
    gated: ClassVar[bool] = True  # False: requests are forwarded at once (no gate)
    sends_hints: ClassVar[bool] = True  # False: engines run plain SGLang eviction

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.tiers = Tiers()
        self.programs: dict[str, Program] = {}
        self._pending_hints: dict[str, dict[str, Hint]] = defaultdict(dict)
        self._held: dict[str, Program] = {}  # requests at the gate, in arrival order
        self._marked: dict[str, dict[str, Program]] = {}  # replica -> lazily demoted programs
        self.last_tool: dict[str, tuple[str, str | None]] = {}  # program -> (tool, agent role)
        self.prices: dict[str, ReplicaPrices] = {}  # replica -> measured move costs
        self._leases: list[tuple[float, str]] = []  # (last activity, program): lease expiry
        self.rounds = Rounds()  # All-Gather rounds and the segments their prompts share
        # the next request's segments, round and agent hints (on_prompt)
        self._prompts: dict[str, tuple[tuple[Segment, ...], str | None, AgentHints]] = {}

    @property
    def engine_mode(self) -> EngineMode:
        """How the engines behind this policy evict (the simulator/emulator obey it)."""
        return EngineMode(eviction="typed", host_tier=True)

    # replicas -------------------------------------------------------------------
    def add_replica(self, replica: str, capacity: ReplicaCapacity) -> None:
        self.tiers.add_replica(replica, capacity)
        self.prices.setdefault(
            replica,
            ReplicaPrices.starting(
                self.config.prefill_s_per_token,
                self.config.load_s_per_token,
                self.config.attention_tokens,
            ),
        )

    def observe_step(self, replica: str, *measured: float) -> None:
        """What one answered request cost inside the engine (timed from forwarding): the
        replica's prices follow it. `measured`: prompt tokens, cached on device, cached on
        host, TTFT (s), and optionally output tokens and decode seconds, as
        `ReplicaPrices.observe` takes them (`router.policy.prices`)."""
        prices = self.prices.get(replica)
        if prices is not None:
            prices.observe(*measured)  # type: ignore[arg-type]

    def observe_round_trip(self, program_id: str, now: float, engine_s: float) -> None:
        """`program_id`'s step is answered at `now` and took `engine_s` at the engine (timed
        as near it as the shell can: the worker's send to its last byte). The rest of the
        time since the gate let it in is the round trip to its replica, which the router
        counts as reasoning while the engine holds nothing of the program (the door's
        load: `router.policy.overload`). Before `on_response`."""
        p = self.programs.get(program_id)
        if p is None or p.status is not Status.REASONING or p.placement.tier is not Tier.GPU:
            return
        prices = self.prices.get(p.placement.replica)  # type: ignore[arg-type]
        if prices is not None:
            prices.observe_round_trip(now - p.interval_start - engine_s)

    def largest_gpu_budget(self) -> int | None:
        """The largest healthy replica's GPU budget (None: no healthy replica). A request
        with a larger context is refused at once: it would wait at the gate forever."""
        budgets = [self.tiers.capacity[r].gpu_tokens for r in self.tiers.replicas()]
        return max(budgets) if budgets else None

    def set_capacity(self, replica: str, capacity: ReplicaCapacity) -> None:
        """New budgets (refreshed from the engine); the next tick fixes any overflow."""
        self.tiers.capacity[replica] = capacity

    def set_healthy(self, replica: str, healthy: bool, now: float) -> list[Move]:
        """A failed replica is drained: its programs go to WAITING and are re-placed."""
        self.tiers.healthy[replica] = healthy
        if healthy:
            return self._rebalance(now)
        moves = []
        for tier in (Tier.GPU, Tier.CPU):
            for p in self.tiers.members(Placement(tier, replica)):
                p.demote_after_step = None
                moves.append(self.move(p, WAITING, MoveReason.DRAIN, now))
        return moves

    # program events ---------------------------------------------------------------
    def on_prompt(
        self,
        program_id: str,
        segments: Sequence[Segment],
        round_id: str | None = None,
        hints: AgentHints = NO_HINTS,
    ) -> None:
        """What the next request of `program_id` holds (the shell calls it just before
        `on_request`): its prompt's segments, one per message, its round if the
        application names one, and its agent hints. `on_request` then counts the segments
        the engine shares once per replica (`Tiers.share`), files the program in its round
        (`Rounds`) and gives it the request's priority and expected output length."""
        self._prompts[program_id] = (tuple(segments), round_id, hints)

    def on_request(
        self, program_id: str, now: float, context_tokens: int | None = None
    ) -> list[Move]:
        """A request arrived; admit it at once if room exists (no tick needed)."""
        p = self.programs.get(program_id)
        if p is None:
            p = Program(program_id, created_s=now, window=self.config.window)
            p.context_tokens = self.config.new_program_tokens
            self.programs[program_id] = p
            heapq.heappush(self._leases, (now, program_id))
            self.tiers.place(p, WAITING)
        if p.status is not Status.ACTING:
            raise ValueError(f"program {program_id} already has a request in flight")
        p.arrive(now)
        if context_tokens is not None:
            self.tiers.resize(p, int(context_tokens))
        prompt = self._prompts.pop(program_id, None)
        hints = NO_HINTS
        if prompt is not None:
            self.tiers.share(p, prompt[0])
            self.rounds.join(program_id, prompt[0], prompt[1], now)
            hints = prompt[2]
        p.priority, p.osl = hints.priority, hints.osl  # a request's hints are its own
        self._held.pop(program_id, None)  # re-queue at the back: arrival order is FIFO order
        self._held[program_id] = p
        return self._admit(p, now)

    def first_asked_s(self, program_id: str) -> float | None:
        """When a program that has not run a step yet first asked to (a start's wait counts
        from there, across the attempts it was told to repeat); None once it has run one."""
        p = self.programs.get(program_id)
        return p.created_s if p is not None and p.steps == 0 else None

    def refusal(self, program_id: str) -> float | None:
        """Seconds after which a held request should come back, if the policy refuses it
        now (the shell cancels it and answers 429 with Retry-After); None: it waits."""
        return None

    def route(self, program_id: str) -> str | None:
        """The replica to forward to, or None while the gate must hold the request."""
        p = self.programs.get(program_id)
        if p is None or p.status is not Status.REASONING:
            return None
        return p.placement.replica

    def on_response(
        self, program_id: str, now: float, context_tokens: int | None = None
    ) -> list[Move]:
        """The engine finished a step (or failed it): the program is acting from now."""
        p = self.programs.get(program_id)
        if p is None or p.status is not Status.REASONING:
            return []
        p.finish_step(now)
        if context_tokens is not None:
            self.tiers.resize(p, int(context_tokens))
        moves = []
        if p.demote_after_step is not None:
            dst, p.demote_after_step = p.demote_after_step, None
            if p.placement.tier is Tier.GPU:
                dst = self.fit_or_waiting(dst, p)
                moves.append(self.move(p, dst, MoveReason.DEMOTE_LAZY, now))
        return moves + self._after_response(p, now)

    def cancel(self, program_id: str, now: float) -> list[Move]:
        """A gated request gave up (timeout or client gone): no state may leak."""
        p = self.programs.get(program_id)
        if p is not None:
            p.cancel_request(now)
        return []

    def end(self, program_id: str, now: float, reason: MoveReason = MoveReason.END) -> list[Move]:
        """Explicit end or lease expiry: the engines are told `inactive`, then it is forgotten."""
        p = self.programs.pop(program_id, None)
        if p is None:
            return []
        self._held.pop(program_id, None)
        p.pending = False  # a request it had at the gate is answered by the shell, not placed
        self.last_tool.pop(program_id, None)
        self._prompts.pop(program_id, None)
        self.rounds.forget(program_id)
        move = self.move(p, WAITING, reason, now) if p.placement.tier is not Tier.WAITING else None
        if move is None and p.last_replica is not None:
            self._pending_hints[p.last_replica][program_id] = Hint.INACTIVE
        self.tiers.remove(p)
        return [move] if move else []

    def on_tool_start(
        self,
        program_id: str,
        now: float,
        tool: str,
        agent: str | None = None,
        predict_s: float | None = None,
    ) -> list[Move]:
        """The agent is about to run `tool` (seen in the response, or told by the client).

        Every policy records it (`describe` shows it); those that act on it (Tokencake's
        time scheduler, Continuum's pins) do so in `_tool_started`.
        """
        if program_id in self.programs:
            self.last_tool[program_id] = (tool, agent)
        return self._tool_started(program_id, now, ToolStart(tool, agent, predict_s))

    def _tool_started(self, program_id: str, now: float, call: ToolStart) -> list[Move]:
        """What the policy does when a tool call starts (nothing by default)."""
        return []

    def on_tool_end(self, program_id: str, now: float) -> list[Move]:
        """The client says the tool call finished (its next request follows soon)."""
        return []

    def tick(self, now: float) -> list[Move]:
        """Periodic rebalance: expire leases, then the policy's own rules."""
        moves: list[Move] = []
        for pid in self._expired(now - self.config.lease_s):
            moves += self.end(pid, now, MoveReason.LEASE)
        return moves + self._rebalance(now)

    def _expired(self, deadline: float) -> list[str]:
        """ACTING programs silent since before `deadline`, from a heap of (last activity,
        program): one entry per program, refreshed when found out of date, so a tick costs
        the programs it looks at, not every program (10 000 programs: ~2 ms saved)."""
        heap, expired, busy = self._leases, [], []
        while heap and heap[0][0] < deadline:
            _, pid = heapq.heappop(heap)
            p = self.programs.get(pid)
            if p is None:
                continue
            if p.last_active_s >= deadline:
                heapq.heappush(heap, (p.last_active_s, pid))
            elif p.status is Status.ACTING:
                expired.append(pid)
            else:  # mid-step or held: looked at again next tick
                busy.append((p.last_active_s, pid))
        for entry in busy:
            heapq.heappush(heap, entry)
        return expired

    # the optional calls (`capabilities` says which a policy answers) ----------------
    def next_wakeup(self, now: float) -> float | None:
        """When the shell should call `tick` next, besides the period (None: no need)."""
        return None

    def observe(self, event: Any) -> None:
        """An agent event (`router.policy.runtime.AgentEvent`: identity, session, app)
        before the request it describes."""
        return None

    def runtime_actions(self, now: float) -> list[Any]:
        """What the shells should tell the engines besides the hints (`router.policy.
        runtime.Action`s)."""
        return []

    def register_app(self, app: str, edges: object) -> dict[str, Any]:
        """An application's graph; ValueError where the policy takes none."""
        raise ValueError(f"policy {self.name!r} does not schedule by application graph")

    # hints ------------------------------------------------------------------------
    def hints(self) -> dict[str, dict[str, Hint]]:
        """The hint of every live program on every replica (for the periodic full sync)."""
        out: dict[str, dict[str, Hint]] = {r: {} for r in self.tiers.capacity}
        for p in self.programs.values():
            if p.last_replica is not None:
                out[p.last_replica][p.program_id] = HINT_OF_TIER[p.placement.tier]
        return out

    def hint_updates(self) -> dict[str, dict[str, Hint]]:
        """Hints changed since the last call, batched per replica (pushed after moves)."""
        out = {r: h for r, h in self._pending_hints.items() if h}
        self._pending_hints = defaultdict(dict)
        return out

    def pending_lazy_tokens(self, replica: str) -> int:
        """Tokens on GPU(replica) marked to leave after their step (a demotion in flight)."""
        gpu = Placement(Tier.GPU, replica)
        return sum(
            p.context_tokens
            for p in self._marked.get(replica, {}).values()
            if p.demote_after_step is not None and p.placement == gpu
        )

    # introspection -----------------------------------------------------------------
    def describe(self, program_id: str, now: float) -> dict[str, Any] | None:
        """A JSON-able view of one program for the admin API."""
        p = self.programs.get(program_id)
        if p is None:
            return None
        tool, agent = self.last_tool.get(program_id, (None, None))
        return {
            "program_id": p.program_id,
            "tier": p.placement.tier.value,
            "replica": p.placement.replica,
            "last_replica": p.last_replica,
            "status": p.status.value,
            "idleness": round(p.idleness(now), 4),
            "context_tokens": p.context_tokens,
            "steps": p.steps,
            "recent_cycles": [{"reasoning_s": r, "acting_s": a} for r, a in p.cycles],
            "last_tool": tool,
            "agent": agent,
            "priority": p.priority,  # its current (or last) request's agent hints
            "osl": p.osl,
            **self._describe_round(program_id),
        }

    def _describe_round(self, program_id: str) -> dict[str, Any]:
        """The program's round: its id, members, and the segments they share (exact: one
        prefix, stored once per replica; gathered: the same blocks at other offsets)."""
        rnd = self.rounds.round_of(program_id)
        if rnd is None:
            return {"round": None}
        exact, gathered = self.rounds.shared(rnd)
        return {
            "round": {
                "round_id": rnd.round_id,
                "explicit": rnd.explicit,
                "members": list(rnd.members),
                "shared_tokens": sum(s.tokens for s in exact),
                "shared_segments": [s.chain for s in exact],
                "gathered_tokens": sum(s.tokens for s in gathered),
                "gathered_segments": [s.content for s in gathered],
            }
        }

    # for subclasses ---------------------------------------------------------------
    def move(self, p: Program, dst: Placement, reason: MoveReason, now: float) -> Move:
        """The only way a program changes tier: updates sums, queues the hints, and
        releases a gated request when its program lands on a GPU tier."""
        src = p.placement
        self.tiers.place(p, dst)
        if src.replica is not None and src.replica != dst.replica:
            self._pending_hints[src.replica][p.program_id] = Hint.INACTIVE
        if dst.replica is not None:
            self._pending_hints[dst.replica][p.program_id] = HINT_OF_TIER[dst.tier]
        if dst.tier is Tier.GPU and p.pending:
            self._start(p, now)
        return Move(p.program_id, src, dst, reason)

    def fit_or_waiting(self, dst: Placement, p: Program) -> Placement:
        return dst if self.tiers.fits(dst, p.context_tokens) else WAITING

    def every_held(self) -> list[Program]:
        """Programs whose request waits at the gate, oldest arrival first.

        The index is cleaned lazily (released, cancelled and ended entries drop out
        here), so no event path has to remember to unregister a program.
        """
        held = [p for p in self._held.values() if p.pending]
        if len(held) != len(self._held):
            self._held = {p.program_id: p for p in held}
        return held

    def _mark_lazy(self, p: Program, dst: Placement) -> None:
        """Demote REASONING `p` to `dst` once its step ends (`on_response` applies it)."""
        p.demote_after_step = dst
        self._marked.setdefault(p.placement.replica, {})[p.program_id] = p  # type: ignore[arg-type]

    def _clear_marks(self, replica: str) -> None:
        """Forget replica's lazy demotions, so a rebalance can re-mark just what it needs
        (an entry of a program that has moved to another replica since is stale: a mark
        it got there is not this replica's to clear)."""
        for p in self._marked.pop(replica, {}).values():
            if p.placement.replica == replica:
                p.demote_after_step = None

    def release(self, p: Program, now: float) -> None:
        """Let a gated request through to its program's GPU replica (no move needed)."""
        if p.pending and p.placement.tier is Tier.GPU:
            self._start(p, now)

    def _start(self, p: Program, now: float) -> None:
        """The gate lets `p`'s request through (a hook: policies may time the wait). It
        leaves the held set at once, so an event with nothing held skips the passes."""
        p.start_reasoning(now)
        self._held.pop(p.program_id, None)

    @abstractmethod
    def _admit(self, p: Program, now: float) -> list[Move]:
        """Called on every arrival (p is GATED): route now if the rules allow it, via
        `_release` (already on a GPU tier) or a `_move` to a GPU tier."""

    @abstractmethod
    def _rebalance(self, now: float) -> list[Move]:
        """The policy's tick: demote over-budget tiers, promote into free room."""

    def _after_response(self, p: Program, now: float) -> list[Move]:
        """Hook after a step: by default nothing (MORI may admit into freed room)."""
        return []
