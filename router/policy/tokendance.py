"""Gangs: collective scheduling of All-Gather rounds (TokenDance §4.2, exact mode), the
engine stage of `mori+tokendance`.

`mori` places programs one by one. An All-Gather round is a unit: it ends when its last
agent answers, its agents share the start of their prompts (the app's system prompt, the
task's scenario: `Program.shared`, counted once per replica by the tiers), and the next
round's requests all arrive when it ends. So, for programs in a round (`Rounds`: an
explicit round id, or inferred from the prompt's new contents) with two or more members:

* **Gang release**: a round's requests are held until every expected member has arrived
  (the agents of its previous round), or `round_gang_s` after the last arrival, then
  released together in one pass: the engine batches them, and no member waits for room
  others of its round hold.
* **Co-placement, priced as a unit**: the round needs the sum of its members' contexts
  with the segments they share counted once (and those already on the replica not at
  all). Members with KV on a replica (its GPU or CPU tier) stay there (moving them costs a
  recompute that sharing a prompt's start never pays back; placed one by one, a CPU-tier
  member leaves its replica only once that shrank below it);
  members without (new ones, WAITING) go to the replica holding most of the round when it
  fits there, else to the one where the round's need fits tightest.
* **Round-level FIFO with yielding**: ready rounds are served oldest first. A round that
  does not fit may take room held by ACTING programs that are in no running round
  (farthest expected return first); once it has waited `round_yield_x` x the rounds'
  mean service time, also the room of younger rounds waiting at the gate on the GPU
  (they yield whole: round-robin at round boundaries) and of agents waiting at a running
  round's barrier. Victims go to their replica's CPU tier (else WAITING). A round larger
  than any replica is split: its members go through `mori` one by one.
* **Keep the shared segments resident**: each round's group (its agents, round after
  round) is pushed to its replica as a survival score of 1.0 (`PushScores`), so within a
  hint type the engine evicts the group's shared prefix last, while any member needs it.

Everything else (programs in no round, rounds of one) is `mori`: without rounds both
policies make the same moves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from router.policy.placement import spread_order
from router.policy.program import Program
from router.policy.rounds import Round
from router.policy.runtime import PushScores
from router.policy.stages import Ledger, promotion_reason
from router.policy.types import WAITING, Move, Placement, Status, Tier

SERVICE_ALPHA = 0.2  # weight of the newest round's service time
DEFAULT_SERVICE_S = 2.0  # a round's service time assumed before any was measured


@dataclass
class _Held:
    """A round waiting at the gate."""

    opened_s: float  # its first request's arrival
    last_s: float  # its latest request's arrival
    pids: dict[str, None] = field(default_factory=dict)


class Gangs:
    """Rounds released, placed and kept together (module docstring)."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        self.rounds = engine.rounds
        self._held_rounds: dict[str, _Held] = {}  # round id -> its held requests
        self.gang: dict[str, str] = {}  # program held by a round -> the round
        self._running: dict[str, tuple[float, set[str]]] = {}  # round -> (released, left)
        # EWMA: a round's release to its last answer
        self.service_s = DEFAULT_SERVICE_S / engine.config.time_scale
        self._ended: dict[str, float] = {}  # round -> its last answer (until the next opens)
        self.gap_s = 0.0  # EWMA: a round's last answer to its agents' next round
        self._group: dict[str, str] = {}  # program -> its group (keeps shared segments)
        self._group_on: dict[str, str] = {}  # program -> the replica its group was pushed to
        self._scores_due: set[str] = set()  # replicas whose group scores changed
        self._agents_due: dict[str, dict[str, str]] = {}  # replica -> program -> group
        self.collective: Counter[str] = Counter()  # what the collective pass did, for reports

    # events ------------------------------------------------------------------------------
    def admit(self, p: Program, now: float) -> list[Move]:
        """Every arrival runs both passes, the engine's and the collective one: time has
        passed, so a held request may leave its replica (ski rental) or a round's wait may
        be up."""
        engine = self.engine
        rnd = self.rounds.round_of(p.program_id)
        if rnd is None or not self._collective(rnd):
            return engine.admit_one(p, now) + self.schedule(now)
        if rnd.round_id not in self._held_rounds:
            self._note_gap(p.program_id, now)
        held = self._held_rounds.setdefault(rnd.round_id, _Held(now, now))
        held.last_s = now
        held.pids[p.program_id] = None
        self.gang[p.program_id] = rnd.round_id
        return engine.promote(now) + self.schedule(now)

    def _note_gap(self, program_id: str, now: float) -> None:
        """A round opens: the time since its agents' previous round ended is one more sample
        of the application's gap between rounds (the gather itself, its world step)."""
        prev = self.rounds.previous.get(program_id)
        ended = self._ended.pop(prev, None) if prev is not None else None
        if ended is not None:
            self.gap_s = SERVICE_ALPHA * (now - ended) + (1 - SERVICE_ALPHA) * self.gap_s

    def _collective(self, rnd: Round) -> bool:
        """Rounds the application names, and inferred ones with two or more agents."""
        return rnd.explicit or len(self.rounds.expected(rnd)) > 1

    def answered(self, program_id: str, now: float) -> None:
        """A member answered: the round's service time is measured at its last answer."""
        rnd = self.rounds.current.get(program_id)
        running = self._running.get(rnd) if rnd is not None else None
        if running is not None:
            running[1].discard(program_id)
            if not running[1]:
                del self._running[rnd]  # type: ignore[arg-type]
                a = SERVICE_ALPHA
                self.service_s = a * (now - running[0]) + (1 - a) * self.service_s
                self._ended[rnd] = now  # type: ignore[index]

    def forget(self, program_id: str) -> None:
        """`program_id` ends (before the engine forgets it)."""
        self.gang.pop(program_id, None)
        self._group.pop(program_id, None)
        self._group_on.pop(program_id, None)
        for _, left in self._running.values():
            left.discard(program_id)

    def after_end(self, now: float) -> list[Move]:
        """Rounds nobody is in any more are dropped; ready rounds are scheduled."""
        for book in (self._running, self._ended):
            for round_id in [r for r in book if r not in self.rounds.rounds]:
                del book[round_id]
        return self.schedule(now)

    def demote_held(self, replica: str, now: float) -> list[Move]:
        """While GPU(replica) is still over budget after the engine's demotion, round
        members held on it: the engine passes over them (neither acting nor reasoning), and
        held, they run no step, so they move now and wait for their round on the CPU tier."""
        engine, tiers = self.engine, self.engine.tiers
        gpu = Placement(Tier.GPU, replica)
        excess = tiers.used(gpu) - engine.pending_lazy_tokens(replica) - tiers.budget(gpu)
        held = [q for q in tiers.members(gpu) if q.pending and q.program_id in self.gang]
        return engine.shed(held, excess, now, lambda q: engine.demote(q, replica, now))[0]

    def deadlines(self, now: float) -> list[float]:
        """When a held round's wait for its missing members is up."""
        gang = self.engine.config.round_gang_s
        times = []
        for round_id, held in self._held_rounds.items():
            rnd = self.rounds.rounds.get(round_id)
            if rnd is not None and not self._complete(rnd) and held.last_s + gang > now:
                times.append(held.last_s + gang)
        return times

    # the collective pass -----------------------------------------------------------------
    def _complete(self, rnd: Round) -> bool:
        """Every expected member has arrived; a round none of whose members ran before
        (its size unknown) is complete only when its wait is up."""
        known = any(pid in self.rounds.previous for pid in rnd.members)
        return known and self.rounds.expected(rnd) <= set(rnd.members)

    def _ready(self, now: float) -> list[tuple[str, _Held, list[Program]]]:
        """Held rounds whose members are all here (or whose wait is up), oldest first;
        requests that left (cancelled, ended) drop out."""
        programs = self.engine.programs
        out = []
        for round_id, held in list(self._held_rounds.items()):
            members = [programs[pid] for pid in held.pids if self._is_held(pid, round_id)]
            held.pids = {p.program_id: None for p in members}
            if not members:
                del self._held_rounds[round_id]
                continue
            rnd = self.rounds.rounds.get(round_id)
            waited = now >= held.last_s + self.engine.config.round_gang_s
            if rnd is None or self._complete(rnd) or waited:
                out.append((round_id, held, members))
        out.sort(key=lambda e: e[1].opened_s)
        return out

    def _is_held(self, pid: str, round_id: str) -> bool:
        p = self.engine.programs.get(pid)
        return p is not None and p.pending and self.gang.get(pid) == round_id

    def schedule(self, now: float) -> list[Move]:
        """Serve ready rounds oldest first: members resident on a GPU go at once (they hold
        their room either way); the others go together onto the round's replica when they
        fit there, after priced displacement if needed, else as many as fit, and the
        replica's room is the round's until it is whole: younger rounds' members that need
        room there wait, and once it has waited `round_yield_x` x the rounds' mean service
        time, younger rounds' requests held on that GPU yield their room to it (moved to
        the CPU tier) instead of going (round-robin at round boundaries, no starvation)."""
        moves: list[Move] = []
        blocked: set[str] = set()  # replicas whose room an older round is waiting for
        starving: set[str] = set()  # ... and where it waited long enough to take it back
        ready = self._ready(now)
        for i, (round_id, held, members) in enumerate(ready):
            if self._too_large(members):
                moves += self._split(round_id, members, now)
                continue
            for p in [p for p in members if p.placement.tier is Tier.GPU]:
                if p.placement.replica not in starving:
                    self.engine.release(p, now)
            movable = [p for p in members if p.pending and p.placement.tier is not Tier.GPU]
            yielding = now - held.opened_s >= self.engine.config.round_yield_x * self.service_s
            younger = [q for _, _, ms in ready[i + 1 :] for q in ms] if yielding else []
            groups = self._groups(movable, members, blocked)
            for replica, group in groups.items():
                short = _need(group, replica, self.engine) - self._free(replica)
                if short > 0:
                    fresh = any(p.placement != Placement(Tier.CPU, replica) for p in group)
                    moves += self._make_room(replica, short, now, younger, yielding, fresh)
                moves += self._place(group, replica, now)
                if any(p.pending for p in group):
                    blocked.add(replica)
                    if yielding:
                        starving.add(replica)
            left = [p for p in members if p.pending]
            if left:
                held.pids = {p.program_id: None for p in left}
            else:
                self._finish_release(round_id, now)
        return moves

    def _free(self, replica: str) -> int:
        tiers = self.engine.tiers
        return tiers.free(Placement(Tier.GPU, replica)) - self.engine.promotion_reserve(replica)

    def _too_large(self, members: list[Program]) -> bool:
        """A round no replica could hold even empty goes through the engine member by
        member."""
        tiers = self.engine.tiers
        budgets = [tiers.budget(Placement(Tier.GPU, r)) for r in tiers.replicas()]
        return bool(budgets) and _need(members, None, self.engine) > max(budgets)

    def _split(self, round_id: str, members: list[Program], now: float) -> list[Move]:
        self.collective["split_rounds"] += 1
        self._held_rounds.pop(round_id, None)
        for p in members:
            self.gang.pop(p.program_id, None)
        moves: list[Move] = []
        for p in members:
            if p.pending:
                moves += self.engine.admit_one(p, now)
        return moves

    def _groups(
        self, movable: list[Program], members: list[Program], blocked: set[str]
    ) -> dict[str, list[Program]]:
        """Where the round's members that need room go. Together when the round shares
        enough of its prompts to pay (`_shares_enough`): onto the replica holding most of
        the round, else the tightest fit for all of them, else the roomiest. Otherwise each
        as MORI places it: its host KV's replica (`_away`: another if it shrank below it),
        else its last replica if it fits, else the roomiest (co-placing a round that shares
        little only piles its load onto one replica)."""
        tiers, programs = self.engine.tiers, self.engine.programs
        replicas = [r for r in tiers.replicas() if r not in blocked]
        if not movable or not replicas:
            return {}
        rnd = self.rounds.round_of(movable[0].program_id)
        whole = [programs[q] for q in (rnd.members if rnd else ()) if q in programs]
        if self._shares_enough(whole or members):
            return {self._plan(whole or movable, movable, replicas): movable}
        out: dict[str, list[Program]] = {}
        free = {r: self._free(r) for r in replicas}
        agents = {r: tiers.count(Placement(Tier.GPU, r)) for r in replicas}
        for p in sorted(movable, key=lambda p: -p.context_tokens):  # decreasing, as BFD
            if p.placement.tier is Tier.CPU:
                away = self._away(p, free)
                r = self._spread(p, away, agents) if away else p.placement.replica
            elif p.last_replica in free and p.context_tokens <= free[p.last_replica]:
                r = p.last_replica
            else:
                r = self._spread(p, free, agents)
            if r in free:
                free[r] -= p.context_tokens  # type: ignore[index]
                agents[r] += 1  # type: ignore[index]
                out.setdefault(r, []).append(p)  # type: ignore[arg-type]
        return out

    def _away(self, p: Program, free: dict[str, int]) -> dict[str, int]:
        """The replicas a CPU-tier member may go to instead of its own: none while its own
        GPU tier could hold it (it waits for room there, its KV at hand), the others once
        that replica shrank below it (pinned to it, it waited for good).

        Leaving a replica that is only full, once the wait pays for a recompute elsewhere
        (`mori`'s rule for its own requests), cost 22-25 % output tok/s at 6 tasks of the
        agentsociety preset, approximate mode (simulated, seeds 0 and 1)."""
        home: str = p.placement.replica  # type: ignore[assignment]
        budget = self.engine.tiers.budget(Placement(Tier.GPU, home))
        if home not in free or p.context_tokens <= budget:
            return {}
        return {r: room for r, room in free.items() if r != home}

    @staticmethod
    def _spread(p: Program, free: dict[str, int], agents: dict[str, int]) -> str:
        """A new agent of a round goes where each agent would have the most free room,
        among the replicas it fits (else the roomiest): a round's agents grow alike, so
        counting them balances the replicas' future load where free room alone only shows
        the present (a task that is ending holds room for a moment and would send a whole
        new round elsewhere)."""
        fits = (r for r in spread_order(free, agents) if p.context_tokens <= free[r])
        return next(fits, max(free, key=free.__getitem__))

    def _shares_enough(self, members: list[Program]) -> bool:
        """The round's members hold, on average, `round_share_min` of their contexts in
        segments another member holds too (what one replica stores once for them)."""
        held = Counter(s.chain for p in members for s in p.shared)
        total = sum(p.context_tokens for p in members) or 1
        common = sum(s.tokens for p in members for s in p.shared if held[s.chain] > 1)
        return common / total >= self.engine.config.round_share_min

    def _plan(self, whole: list[Program], members: list[Program], replicas: list[str]) -> str:
        """The replica for `members` of a round placed together: the one holding most of
        the round (`whole`: its KV, its members already placed) if they fit there, else the
        tightest fit, else the roomiest."""
        home: Counter[str] = Counter()
        for p in whole:
            where = p.placement.replica or p.last_replica
            if where is not None and where in replicas:
                home[where] += 1
        needs = {r: _need(members, r, self.engine) for r in replicas}
        if home:
            top = home.most_common(1)[0][0]
            if needs[top] <= self._free(top):
                return top
        fits = [r for r in replicas if needs[r] <= self._free(r)]
        if fits:
            return min(fits, key=lambda r: self._free(r) - needs[r])
        return home.most_common(1)[0][0] if home else max(replicas, key=self._free)

    def _make_room(
        self,
        replica: str,
        short: int,
        now: float,
        younger: list[Program],
        yielding: bool,
        fresh: bool,
    ) -> list[Move]:
        """Moves freeing `short` tokens on GPU(replica), or none (a partial move would be
        churn for nothing): ACTING programs whose move pays (MORI's priced rule: expected
        idle time >= `displace_margin` x the reload or recompute), farthest return first;
        an agent at a round's barrier is expected back when its round ends. A round that
        waited long enough (`yielding`) may move any ACTING program, then the `younger`
        rounds' requests held on this GPU. `fresh`: some of the round's KV is written to
        host anew (`victim_keeps_copy`)."""
        engine = self.engine
        forecast = engine.forecast
        gpu = Placement(Tier.GPU, replica)
        margin = engine.config.displace_margin
        priced: list[tuple[float, Program]] = []
        for q in engine.tiers.members(gpu):
            if q.status is not Status.ACTING or q.pending or q.demote_after_step is not None:
                continue
            idle = self._expected_back_s(q, now)
            kept = forecast.victim_keeps_copy(q, fresh)  # type: ignore[union-attr]
            cost = forecast.move_cost_s(q, kept_on_host=kept)  # type: ignore[union-attr]
            if yielding or idle >= margin * cost:
                priced.append((idle, q))
        order = [q for _, q in sorted(priced, key=lambda e: -e[0])]
        order += [q for q in younger if q.placement == gpu and q.status is Status.GATED]
        chosen = engine.tiers.enough(order, short)
        self.collective["displaced"] += sum(not q.pending for q in chosen)
        self.collective["yielded"] += sum(q.pending for q in chosen)
        return [engine.demote(q, replica, now) for q in chosen]

    def _expected_back_s(self, q: Program, now: float) -> float:
        """Seconds until an ACTING program's next request: the end of its round (its agents
        all come back when the last one answers; a round with requests still held has a
        whole service time to go) plus the app's gap between rounds, else MORI's forecast."""
        round_id = self.rounds.current.get(q.program_id)
        if round_id in self._held_rounds:  # back only after its held peers have run
            return self.service_s
        running = self._running.get(round_id) if round_id is not None else None
        if running is not None:
            return max(0.0, running[0] + self.service_s - now)
        ended = self._ended.get(round_id) if round_id is not None else None
        if ended is not None:  # its round is over: back after the app's gap between rounds
            return max(0.0, ended + self.gap_s - now)
        return self.engine.forecast.expected_idle_s(q, now)  # type: ignore[union-attr]

    def _place(self, movable: list[Program], replica: str, now: float) -> list[Move]:
        """Members with host KV back onto their replica when it has room, the rest onto
        `replica`, largest first while they fit."""
        engine = self.engine
        moves: list[Move] = []
        for p in sorted(movable, key=lambda p: -p.context_tokens):
            target = self._home(p, replica)
            gpu = Placement(Tier.GPU, target)
            if engine.tiers.need(p, gpu) > self._free(target):
                continue
            moves.append(engine.move(p, gpu, promotion_reason(p), now))
        return moves

    def _finish_release(self, round_id: str, now: float) -> None:
        """The whole round is through the gate: its agents are expected back when it
        ends, and its shared segments are kept resident."""
        rnd = self.rounds.rounds.get(round_id)
        programs = self.engine.programs
        members = [programs[pid] for pid in (rnd.members if rnd else ()) if pid in programs]
        for p in members:
            self.gang.pop(p.program_id, None)
        held = self._held_rounds.pop(round_id, None)
        opened = held.opened_s if held is not None else now
        busy = {p.program_id for p in members if p.status is Status.REASONING}
        self._running[round_id] = (opened, busy)
        self._keep_shared(members, now)
        self.collective["rounds_released"] += 1

    def _home(self, p: Program, replica: str) -> str:
        """A member with host KV goes back to its replica if it has room, else to the
        round's."""
        if p.placement.tier is Tier.CPU:
            r: str = p.placement.replica  # type: ignore[assignment]
            if self.engine.tiers.need(p, Placement(Tier.GPU, r)) <= self._free(r):
                return r
        return replica

    # keeping shared segments resident -----------------------------------------------------
    def _keep_shared(self, members: list[Program], now: float) -> None:
        """The round's group (the one most of its members had, else a new one) is scored
        on the members' replicas; a program's group is pushed when it or its replica
        changes."""
        known = Counter(self._group[p.program_id] for p in members if p.program_id in self._group)
        group = known.most_common(1)[0][0] if known else f"round:{members[0].program_id}"
        for p in members:
            replica = p.placement.replica
            if replica is None:
                continue
            if (
                self._group.get(p.program_id) != group
                or self._group_on.get(p.program_id) != replica
            ):
                self._agents_due.setdefault(replica, {})[p.program_id] = group
                self._scores_due.add(replica)
            self._group[p.program_id] = group
            self._group_on[p.program_id] = replica

    def runtime_actions(self, now: float) -> list[PushScores]:
        """Survival 1.0 for the groups with members on each replica whose set changed."""
        actions = []
        for replica in sorted(self._scores_due):
            groups = {
                self._group[p.program_id]
                for p in self.engine.tiers.members(Placement(Tier.GPU, replica))
                if p.program_id in self._group
            }
            agents = self._agents_due.pop(replica, {})
            actions.append(PushScores(replica, dict.fromkeys(sorted(groups), 1.0), agents))
        self._scores_due.clear()
        return actions

    # introspection -----------------------------------------------------------------------
    def describe(self, p: Program, view: dict[str, Any], now: float) -> None:
        view["round_held"] = p.program_id in self.gang
        view["round_group"] = self._group.get(p.program_id)


def _need(members: Iterable[Program], replica: str | None, engine: Ledger) -> int:
    """GPU tokens the round's members not on GPU(replica) add there, each shared segment
    once (and not at all if the replica's GPU tier holds it already)."""
    place = Placement(Tier.GPU, replica) if replica is not None else WAITING
    seen: set[str] = set()
    need = 0
    for p in members:
        if replica is not None and p.placement == place:
            continue
        if replica is not None and p.placement.tier is Tier.GPU:
            continue  # resident on another replica: released there
        tokens = p.context_tokens
        for s in p.shared:
            if s.chain in seen or (replica is not None and engine.tiers.holders(place, s.chain)):
                tokens -= s.tokens
            seen.add(s.chain)
        need += tokens
    return need
