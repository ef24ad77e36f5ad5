"""Rounds of multi-agent applications (TokenDance §2.1, §4.1): who runs together, what they share.

In an All-Gather application N agents run in synchronized rounds: a scheduler gathers every
agent's answer and sends the gathered blocks back to each agent, after its own private
history. The router sees each request's prompt as a list of `Segment`s (one per message:
`chain` names the prompt up to it, `content` its text alone) and, where the application
has one, an explicit round id (`round_id` in the body, `X-Round-Id`). Without one the
round is inferred from what the prompt newly holds: the contents a program's prompt has
that its previous prompt did not (the gathered blocks, the round's task) are the same for
every agent of a round, so a request joins the round that earlier requests with those
contents joined, else opens one.

A round's *expected* members are the live programs that ran with its members in their
previous round (a round usually has the same agents as the one before); a collective
policy holds a round until they have all arrived. Rounds nobody points at any more (no
member's current or previous round) are forgotten, so the book stays as large as the live
programs' last two rounds.

Pure bookkeeping: no clock but the one passed in, no I/O.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.policy.types import Segment


@dataclass
class Round:
    """One round: its members in arrival order and when the first arrived."""

    round_id: str
    explicit: bool  # named by the application (else inferred from contents)
    opened_s: float
    members: dict[str, None] = field(default_factory=dict)
    contents: set[str] = field(default_factory=set)  # contents it was inferred from
    refs: int = 0  # programs whose current or previous round it is


class Rounds:
    """Round membership and shared segments of the live programs."""

    def __init__(self) -> None:
        self.rounds: dict[str, Round] = {}
        self.current: dict[str, str] = {}  # program -> its round now
        self.previous: dict[str, str] = {}  # program -> the round before
        self.segments: dict[str, tuple[Segment, ...]] = {}  # program -> its last prompt
        self._by_content: dict[str, str] = {}  # content id -> inferred round holding it
        self._version = 0  # bumped on every change: `shared` is computed once per version
        self._shared: dict[str, tuple[int, tuple[list[Segment], list[Segment]]]] = {}

    def join(
        self, program_id: str, segments: Sequence[Segment], round_id: str | None, now: float
    ) -> Round | None:
        """A request of `program_id` with these segments (and maybe an explicit round)
        arrived: the round it is in, or None (a first prompt of no known round, or a
        prompt with nothing new)."""
        self._version += 1
        last = self.segments.get(program_id, ())
        self.segments[program_id] = tuple(segments)
        if round_id is None:
            seen = {s.content for s in last}
            fresh = {s.content for s in segments if s.content not in seen}
            if not fresh or not last:  # nothing new, or a first prompt: no evidence yet
                self._move(program_id, None)
                return None
            rnd = self._inferred(fresh, now)
        else:
            named = self.rounds.get(round_id)
            if named is None:
                named = self.rounds[round_id] = Round(round_id, True, now)
            rnd = named
        if self.current.get(program_id) != rnd.round_id:
            self._move(program_id, rnd)
        rnd.members[program_id] = None
        return rnd

    def _inferred(self, fresh: set[str], now: float) -> Round:
        """The round earlier requests with these new contents joined, else a new one."""
        votes = Counter(self._by_content[c] for c in fresh if c in self._by_content)
        if votes:
            rnd = self.rounds[votes.most_common(1)[0][0]]
        else:
            digest = hashlib.blake2b("|".join(sorted(fresh)).encode(), digest_size=6).hexdigest()
            rnd = self.rounds[f"auto-{digest}"] = Round(f"auto-{digest}", False, now)
        for c in fresh:
            if c not in self._by_content:
                self._by_content[c] = rnd.round_id
                rnd.contents.add(c)
        return rnd

    def _move(self, program_id: str, rnd: Round | None) -> None:
        """`program_id`'s current round becomes its previous one."""
        old_prev = self.previous.pop(program_id, None)
        cur = self.current.pop(program_id, None)
        if cur is not None:
            self.previous[program_id] = cur  # keeps its reference
        self._unref(old_prev, program_id)
        if rnd is not None:
            self.current[program_id] = rnd.round_id
            rnd.refs += 1

    def _unref(self, round_id: str | None, program_id: str) -> None:
        rnd = self.rounds.get(round_id) if round_id is not None else None
        if rnd is None:
            return
        rnd.refs -= 1
        if rnd.refs <= 0:
            del self.rounds[rnd.round_id]
            self._shared.pop(rnd.round_id, None)
            for c in rnd.contents:
                if self._by_content.get(c) == rnd.round_id:
                    del self._by_content[c]

    def forget(self, program_id: str) -> None:
        """An ended program leaves the book (and its rounds, once nobody refers to them)."""
        self._version += 1
        self.segments.pop(program_id, None)
        for book in (self.current, self.previous):
            round_id = book.pop(program_id, None)
            rnd = self.rounds.get(round_id) if round_id is not None else None
            if rnd is not None:
                rnd.members.pop(program_id, None)
            self._unref(round_id, program_id)

    # reading -------------------------------------------------------------------------
    def live(self) -> dict[str, list[str]]:
        """Rounds that are two or more programs' current round, with those programs."""
        out: dict[str, list[str]] = {}
        for pid, round_id in self.current.items():
            out.setdefault(round_id, []).append(pid)
        return {r: pids for r, pids in out.items() if len(pids) > 1}

    def round_of(self, program_id: str) -> Round | None:
        round_id = self.current.get(program_id)
        return self.rounds.get(round_id) if round_id is not None else None

    def expected(self, rnd: Round) -> set[str]:
        """Programs expected in `rnd`: its members and the members of its members'
        previous rounds that have not moved past it (they are still live)."""
        out = set(rnd.members)
        for pid in rnd.members:
            prev = self.rounds.get(self.previous.get(pid, ""))
            if prev is None:
                continue
            for q in prev.members:
                if self.current.get(q) == prev.round_id or q in rnd.members:
                    out.add(q)
        return out

    def shared(self, rnd: Round) -> tuple[list[Segment], list[Segment]]:
        """The round's shared segments: (exact, gathered). Exact: the same prefix in two or
        more members' prompts (an engine stores it once). Gathered: the same content at
        different prefixes (what approximate reuse could share; exact mode stores it once
        per member). Computed once per change of the book (a listing asks per member)."""
        cached = self._shared.get(rnd.round_id)
        if cached is not None and cached[0] == self._version:
            return cached[1]
        chains: Counter[str] = Counter()
        contents: Counter[str] = Counter()
        first: dict[str, Segment] = {}
        for pid in rnd.members:
            for s in self.segments.get(pid, ()):
                chains[s.chain] += 1
                contents[s.content] += 1
                first.setdefault(s.chain, s)
        exact = [s for chain, s in first.items() if chains[chain] > 1]
        exact_contents = {s.content for s in exact}
        gathered: dict[str, Segment] = {}
        for s in first.values():
            if contents[s.content] > 1 and s.content not in exact_contents:
                gathered.setdefault(s.content, s)
        result = (exact, list(gathered.values()))
        self._shared[rnd.round_id] = (self._version, result)
        return result
