"""CacheSage's transition learner (§3.2): which agent speaks after which, learnt online.

Per session (a task: the root program and its subagents) the learner follows the sequence of
*turns*: a turn starts when a subagent's request follows the root's (the supervisor handed
over) or another subagent's; consecutive requests of one program in a tool loop are one
turn. Each new turn after a previous one is a transition (previous agent -> this agent),
counted over a sliding window of the last `window` transitions, so the estimate
P(b | a) = n(a, b) / n(a) follows a workload whose routing drifts. The K-step reach is
refreshed every `refresh` transitions (it moves slowly; the rows are exact).

How much structure there is to act on is measured out of sample (prequentially): each
transition a -> b is first *predicted*, by the Laplace-smoothed P(b | a) and by the marginal
P(b), and the learner keeps R = 1 - sum(-log P(b | a)) / sum(-log P(b)) over the window. In
sample (the plug-in R that `mori trace stats` reports), a few transitions spread over many
rows look predictable even when they are noise; out of sample they do not.

State is bounded: at most `max_agents` agents (later ones are not learnt), `window` pairs,
`max_sessions` sessions (least recently active forgotten first); |A|^2 counts.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from router.policy.stats import entropy_reduction


@dataclass(slots=True)
class _Session:
    turn_agent: str | None = None  # agent of the turn in progress
    turn_program: str | None = None
    handed_over: bool = False  # the root spoke since the last turn started


class TransitionLearner:
    """Windowed first-order Markov counts over agent turns, with R and K-step reach."""

    def __init__(
        self,
        window: int = 1024,
        max_agents: int = 64,
        max_sessions: int = 4096,
        refresh: int = 16,
    ) -> None:
        self.window, self.max_agents, self.max_sessions = window, max_agents, max_sessions
        self.refresh = refresh
        self.rows: dict[str, Counter[str]] = {}
        self.out: Counter[str] = Counter()  # row sums: n(a)
        self.nexts: Counter[str] = Counter()
        self.agents: set[str] = set()  # every agent learnt so far (at most max_agents)
        self.pairs: deque[tuple[str, str]] = deque()
        self.losses: deque[tuple[float, float]] = deque()  # per pair: -log2 P(b|a), P(b)
        self._loss = [0.0, 0.0]
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.version = 0  # bumped whenever the counts change
        self.epoch = 0  # bumped whenever a turn starts or a session ends
        self._reach: tuple[int, int, dict[str, int], np.ndarray] | None = None

    # observing --------------------------------------------------------------------------
    def observe(self, session: str, program: str, agent: str | None) -> bool:
        """A request of `program` (agent `agent`) in `session`; True when it starts a turn.
        The root program of a session (program == session) only marks a hand-over."""
        s = self.sessions.get(session)
        if s is None:
            s = self.sessions[session] = _Session()
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(session)
        if program == session:
            s.handed_over = True
            return False
        if agent is None or (not s.handed_over and program == s.turn_program):
            return False
        if s.turn_agent is not None:
            self._count(s.turn_agent, agent)
        s.turn_agent, s.turn_program, s.handed_over = agent, program, False
        self.epoch += 1
        return True

    def end_session(self, session: str) -> None:
        if self.sessions.pop(session, None) is not None:
            self.epoch += 1

    def _count(self, a: str, b: str) -> None:
        new = (a not in self.agents) + (b not in self.agents and b != a)
        if new and len(self.agents) + new > self.max_agents:
            return
        self.agents.update((a, b))
        self._predict(a, b, len(self.agents) + 1)
        self.rows.setdefault(a, Counter())[b] += 1
        self.out[a] += 1
        self.nexts[b] += 1
        self.pairs.append((a, b))
        if len(self.pairs) > self.window:
            old = self.losses.popleft()
            self._loss[0] -= old[0]
            self._loss[1] -= old[1]
            old_a, old_b = self.pairs.popleft()
            row = self.rows[old_a]
            row[old_b] -= 1
            self.out[old_a] -= 1
            self.nexts[old_b] -= 1
            if not row[old_b]:
                del row[old_b]
            if not row:
                del self.rows[old_a], self.out[old_a]
            if not self.nexts[old_b]:
                del self.nexts[old_b]
        self.version += 1

    def _predict(self, a: str, b: str, k: int) -> None:
        """Score the forecast of `a -> b` made before counting it (add-one over k agents)."""
        row: dict[str, int] = self.rows.get(a, {})
        cond = (row.get(b, 0) + 1) / (self.out[a] + k)
        marg = (self.nexts.get(b, 0) + 1) / (len(self.pairs) + k)
        loss = (-math.log2(cond), -math.log2(marg))
        self.losses.append(loss)
        self._loss[0] += loss[0]
        self._loss[1] += loss[1]

    # estimates ------------------------------------------------------------------------------
    @property
    def transitions(self) -> int:
        return len(self.pairs)

    def row(self, a: str) -> dict[str, float]:
        """P(next | a) over the window ({} for an agent never seen handing over)."""
        counts = self.rows.get(a)
        if not counts:
            return {}
        total = self.out[a]
        return {b: n / total for b, n in counts.items()}

    def r(self) -> float:
        """Out-of-sample R over the window (module docstring): 1 - the conditional forecasts'
        log loss / the marginal's; 0 with no data, negative when the current agent misleads."""
        return 1.0 - self._loss[0] / self._loss[1] if self._loss[1] > 0 else 0.0

    def r_in_sample(self) -> float:
        """The plug-in R of the window's counts (as `mori trace stats` computes it)."""
        r = entropy_reduction(self.rows)
        return 0.0 if math.isnan(r) else r

    def reach(self, horizon: int) -> tuple[dict[str, int], np.ndarray]:
        """(index, H) with H[index[a], index[b]] = P(b speaks within `horizon` turns after a),
        exact under the learnt chain (a row with no data never reaches anyone), refreshed as
        `r` is. H_1 = P; H_k+1 = P + P H_k - P diag(H_k)."""
        if (
            self._reach is not None
            and self._reach[1] == horizon
            and not self._stale(self._reach[0])
        ):
            return self._reach[2], self._reach[3]
        agents = sorted(self.rows.keys() | self.nexts.keys())
        index = {a: i for i, a in enumerate(agents)}
        p = np.zeros((len(agents), len(agents)))
        for a, counts in self.rows.items():
            total = sum(counts.values())
            for b, n in counts.items():
                p[index[a], index[b]] = n / total
        h = p.copy()
        for _ in range(horizon - 1):
            h = p + p @ h - p * np.diag(h)[None, :]
        self._reach = (self.version, horizon, index, h)
        return index, h

    def _stale(self, at: int) -> bool:
        """A derived value computed at version `at` is due again: never computed, or the
        counts moved since (on every change while few are known, else every `refresh`)."""
        if at < 0:
            return True
        if self.version == at:
            return False
        return self.version < 2 * self.refresh or self.version - at >= self.refresh

    def current_agents(self) -> Counter[str]:
        """How many live sessions are in a turn of each agent."""
        return Counter(s.turn_agent for s in self.sessions.values() if s.turn_agent)

    def state_bytes(self) -> int:
        """Approximate memory of the learnt state (the paper bounds it at ~20 KB/workload)."""
        size = sys.getsizeof
        rows = sum(size(r) for r in self.rows.values()) + size(self.rows) + size(self.nexts)
        pairs = 2 * (size(self.pairs) + 16 * len(self.pairs))  # the pairs and their losses
        return rows + pairs + 120 * len(self.sessions)
