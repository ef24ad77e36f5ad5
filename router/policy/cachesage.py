"""CacheSage (§3) on the agent runtime layer, and its engine stage (`mori+cachesage`).

Multi-agent apps re-send each agent role's *anchor* (system prompt + tools + few-shots) at
the start of every session of the role; which role runs next is predictable from the one
running now. CacheSage turns that into cache decisions, in the four calls of
`router.policy.runtime`:

- observe: every request, tagged with its agent identity (explicit `agent` / X-Agent-Role,
  else the hash of its anchor: `router.protocol.agent_identity`) and its session (the root program),
  feeds the transition learner (`router.policy.transitions`);
- score: an anchor's survival score is the probability that its role speaks within the next
  `horizon` turns of any live session, 1 - prod_s (1 - H[a_s, role]) with H the learnt
  K-step reach; the engine evicts by (MORI type, survival, LRU);
- predict: the most likely next role of every live session;
- act: push the scores to every replica when they move, and when a turn starts, warm the
  predicted next role's anchor on the replica where the session runs (the engine loads it
  back from host or prefills it, never at a waiting request's expense).

Graceful fallback: while the window holds fewer than `min_transitions` transitions, or the
learnt R (1 - H(next | current) / H(next)) is below `r_min`, CacheSage pushes empty scores
and warms nothing, and the engine's order is MORI's typed LRU unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.policy.program import Program
from router.policy.runtime import (
    Action,
    AgentEvent,
    AgentRuntime,
    EventKind,
    Item,
    ItemKind,
    PushScores,
    RuntimeComponent,
    TypedHints,
    Warm,
)
from router.policy.stages import Ledger
from router.policy.transitions import TransitionLearner
from router.policy.types import Move, Placement, Status, Tier

HORIZON_TURNS = 2  # survival: P(the role speaks within this many turns of a session)
ODDS_MAX = 0.5  # hand-over room: only programs less likely than this to speak soon move
R_MIN = 0.15  # below this learnt R the structure is too weak: plain LRU
MIN_TRANSITIONS = 32  # ... and until the window holds this many transitions
WARM_MIN_P = 0.3  # warm the predicted next role only if P(next | current) reaches this
SCORE_STEP = 0.02  # push scores again once one moved by more than this


class CacheSage(RuntimeComponent):
    """Transition learner + survival scorer + warm-up prefetch, per router."""

    name = "cachesage"

    def __init__(
        self,
        locate: Callable[[str], str | None],
        replicas: Callable[[], list[str]],
        horizon: int = HORIZON_TURNS,
        learner: TransitionLearner | None = None,
    ) -> None:
        self.locate, self.replicas, self.horizon = locate, replicas, horizon
        self.learner = learner or TransitionLearner()
        self.anchors: dict[str, int] = {}  # agent -> anchor tokens (last seen)
        self.session_of: dict[str, str] = {}  # live program -> its session
        self.agent_of: dict[str, str] = {}  # live program -> its agent
        self._members: dict[str, dict[str, str]] = {}  # session -> {agent: its program}
        # programs whose agent no engine was told yet, in arrival order (a set would order
        # the pushes by string hash)
        self._unpushed: dict[str, None] = {}
        self._warms: list[Warm] = []
        self._scores: dict[str, float] = {}  # last computed
        self._pushed: dict[str, float] | None = None
        self._scored_epoch = -1  # the learner's epoch `_scores` were computed at
        self._acted_epoch = -1  # ... and the one `act` last looked at (scoring an item
        # in between, for a placement or a hint, must not hide new scores from the push)

    @property
    def active(self) -> bool:
        """Enough learnt structure to act on (else: plain LRU, no warm-ups)."""
        learner = self.learner
        return learner.transitions >= MIN_TRANSITIONS and learner.r() >= R_MIN

    # observe ----------------------------------------------------------------------------
    def observe(self, event: AgentEvent) -> None:
        pid = event.program_id
        if event.kind is EventKind.END:
            self._forget(pid)
            return
        if event.kind is not EventKind.REQUEST:
            return
        parent = event.parent
        session = event.session or (self.session_of.get(parent, parent) if parent else pid)
        self.session_of[pid] = session
        if event.agent is not None:
            if self.agent_of.get(pid) != event.agent:
                self._unpushed[pid] = None
                self._members.setdefault(session, {})[event.agent] = pid
            self.agent_of[pid] = event.agent
            if event.anchor_tokens > 0:
                self.anchors[event.agent] = event.anchor_tokens
        if self.learner.observe(session, pid, event.agent) and event.agent is not None:
            self._plan_warm(session, pid, event.agent)

    def _forget(self, pid: str) -> None:
        session = self.session_of.pop(pid, None)
        agent = self.agent_of.pop(pid, None)
        self._unpushed.pop(pid, None)
        members = self._members.get(session, {}) if session is not None else {}
        if members.get(agent) == pid:  # type: ignore[arg-type]
            del members[agent]  # type: ignore[arg-type]
        if session == pid:  # the root ended: the task is over
            self.learner.end_session(session)
            self._members.pop(session, None)

    def _plan_warm(self, session: str, pid: str, agent: str) -> None:
        """A turn of `agent` started: warm the most likely next role's anchor."""
        if not self.active:
            return
        row = {b: p for b, p in self.learner.row(agent).items() if b != agent}
        if not row:
            return
        nxt, p = max(row.items(), key=lambda kv: kv[1])
        tokens = self.anchors.get(nxt, 0)
        if p < WARM_MIN_P or tokens <= 0:
            return
        sibling = self._members.get(session, {}).get(nxt)
        replica = (self.locate(sibling) if sibling else None) or self.locate(pid)
        if replica is not None:
            self._warms.append(Warm(replica, nxt, tokens))

    # score / predict ----------------------------------------------------------------------
    def survival(self) -> dict[str, float]:
        """Agent -> P(it speaks within `horizon` turns of some live session); {} when the
        learnt structure is too weak to act on."""
        if self._scored_epoch == self.learner.epoch:
            return self._scores
        self._scored_epoch = self.learner.epoch
        if not self.active:
            self._scores = {}
            return self._scores
        index, reach = self.learner.reach(self.horizon)
        miss = [1.0] * len(index)
        for current, n in self.learner.current_agents().items():
            i = index.get(current)
            if i is None:
                continue
            for j in range(len(index)):
                miss[j] *= (1.0 - reach[i, j]) ** n
        self._scores = {a: 1.0 - miss[j] for a, j in index.items()}
        return self._scores

    def turn_odds(self, pid: str) -> float | None:
        """P(the program's agent speaks within `horizon` turns of its session); 1 for the
        session's root (it speaks between turns) and for the agent whose turn it is; None
        when unknown or while the learnt structure is too weak."""
        session, agent = self.session_of.get(pid), self.agent_of.get(pid)
        if session is None or not self.active:
            return None
        state = self.learner.sessions.get(session)
        if pid == session or (state is not None and state.turn_agent == agent):
            return 1.0
        if state is None:
            return None
        return self.odds_after(state.turn_agent, agent)

    def odds_after(self, current: str | None, agent: str | None) -> float | None:
        """P(`agent` speaks within `horizon` turns after a turn of `current`)."""
        if current is None or agent is None or not self.active:
            return None
        index, reach = self.learner.reach(self.horizon)
        i, j = index.get(current), index.get(agent)
        return None if i is None or j is None else float(reach[i, j])

    def score(self, item: Item) -> float | None:
        if item.kind is ItemKind.ANCHOR:
            return self.survival().get(item.key, 0.0)
        return self.turn_odds(item.key)

    def predict(self, now: float) -> Mapping[str, tuple[str, float]]:
        """Session -> (most likely next agent, its probability), for sessions mid-turn."""
        out = {}
        for session, state in self.learner.sessions.items():
            row = self.learner.row(state.turn_agent) if state.turn_agent else {}
            if row:
                out[session] = max(row.items(), key=lambda kv: kv[1])
        return out

    # act ---------------------------------------------------------------------------------
    def act(self, now: float) -> list[Action]:
        if not (self._warms or self._unpushed) and self._acted_epoch == self.learner.epoch:
            return []  # nothing new since the last call (the common case, on every event)
        self._acted_epoch = self.learner.epoch
        actions: list[Action] = []
        scores = self.survival()
        moved = self._pushed is None or _moved(self._pushed, scores)
        agents = self._located_agents()
        if moved or agents:
            for replica in self.replicas():
                mine = agents.get(replica, {})
                if moved or mine:
                    actions.append(PushScores(replica, dict(scores), mine))
            self._pushed = dict(scores)
        warms, self._warms = self._warms, []
        return [*actions, *warms]

    def _located_agents(self) -> dict[str, dict[str, str]]:
        """Replica -> {program: agent} for identified programs now placed somewhere."""
        out: dict[str, dict[str, str]] = {}
        for pid in list(self._unpushed):
            replica = self.locate(pid)
            if replica is not None:
                out.setdefault(replica, {})[pid] = self.agent_of[pid]
                self._unpushed.pop(pid, None)
        return out


def _moved(old: dict[str, float], new: dict[str, float]) -> bool:
    if old.keys() != new.keys():
        return True
    return any(abs(new[a] - old[a]) > SCORE_STEP for a in new)


class HandOver:
    """CacheSage on the runtime layer beside MORI's tiers and typed hints, and one
    placement rule of its own (predict + act on MORI's tiers): a held request that the
    engine's rules left waiting may take GPU room from ACTING programs of its replica that
    will not speak soon, least likely first: those of a session with a request held at the
    gate (they wait for that turn to end) and, once the structure is learnt, those whose
    turn odds are below `ODDS_MAX`; they go to CPU (hint idle) or WAITING as any demotion
    does. In a multi-agent task every role waits for the others' turns: without it, a
    role's first turn can wait behind the GPU room of roles that are themselves waiting
    for that turn.
    """

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        self.cachesage = CacheSage(self._replica_of, engine.tiers.replicas)
        self.runtime = AgentRuntime([TypedHints(engine), self.cachesage])

    def _replica_of(self, program_id: str) -> str | None:
        p = self.engine.programs.get(program_id)
        return None if p is None else (p.placement.replica or p.last_replica)

    def runtime_actions(self, now: float) -> list[Action]:
        """Scores to push and anchors to warm (the engine takes a warm-up only when no
        request waits in it, and only room eviction would free before the anchor)."""
        return self.runtime.act(now)

    def ended(self, program_id: str, now: float) -> None:
        self.runtime.observe(AgentEvent(EventKind.END, now, program_id))

    # hand-over room ------------------------------------------------------------------------
    def make_room(self, now: float) -> list[Move]:
        """Room for the oldest held request that fits nowhere, from ACTING programs
        predicted not to speak soon (see the class docstring); then the engine promotes."""
        engine = self.engine
        held = engine.held_programs()
        if not held:
            return []
        cs = self.cachesage
        waiting = {cs.session_of.get(q.program_id): cs.agent_of.get(q.program_id) for q in held}
        waiting.pop(None, None)  # type: ignore[call-overload]
        for q in held:
            replica = self._target(q)
            if replica is None:
                continue
            gpu = Placement(Tier.GPU, replica)
            need = q.context_tokens - engine.tiers.free(gpu)
            victims = self._unlikely(gpu, need, waiting) if need > 0 else []
            if victims:
                moves = [engine.demote(p, replica, now) for p in victims]
                return moves + engine.promote(now)
        return []

    def _target(self, q: Program) -> str | None:
        """The replica a held program would run on: its CPU tier's, else its last one,
        else the one with the most free GPU room."""
        tiers = self.engine.tiers
        if q.placement.tier is Tier.CPU:
            return q.placement.replica
        replicas = tiers.replicas()
        if q.last_replica in replicas:
            return q.last_replica
        return max(replicas, key=lambda r: tiers.free(Placement(Tier.GPU, r)), default=None)

    def _unlikely(self, gpu: Placement, need: int, waiting: dict) -> list[Program]:
        """ACTING programs on `gpu` freeing `need` tokens, least likely to speak first
        (larger first among equals); [] if those that qualify cannot free enough. A
        program whose session has a request held at the gate (`waiting`: session -> its
        agent) waits for that turn: its odds are those after that turn (0 before anything
        is learnt); the session's root speaks right after it and stays."""
        cs = self.cachesage
        pool = []
        for p in self.engine.tiers.members(gpu):
            pid = p.program_id
            session = cs.session_of.get(pid)
            if p.status is not Status.ACTING or pid == session:
                continue
            if session in waiting:
                after = cs.odds_after(waiting[session], cs.agent_of.get(pid))
                o: float | None = 0.0 if after is None else after
            else:
                o = cs.turn_odds(pid)
            if o is not None and o < ODDS_MAX and p.demote_after_step is None:
                pool.append((o, -p.context_tokens, p))
        pool.sort(key=lambda t: t[:2])
        chosen: list[Program] = []
        for _, _, p in pool:
            if need <= 0:
                break
            chosen.append(p)
            need -= p.context_tokens
        return chosen if need <= 0 else []

    def describe(self, p: Program, view: dict[str, Any], now: float) -> None:
        """The agent CacheSage knows the program as, and its session's next-agent
        forecast."""
        cs = self.cachesage
        view["agent"] = cs.agent_of.get(p.program_id, view.get("agent"))
        session = cs.session_of.get(p.program_id)
        view["session"] = session
        view["predicted_next_agent"] = cs.predict(now).get(session) if session else None
