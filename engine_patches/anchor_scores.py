"""CacheSage's survival scores inside the engine (docs/hint-protocol.md, `scores`/`agents`).

The router learns which agent role runs next (router/policy/cachesage.py) and pushes, next
to the per-program hints, a survival score per agent role and the role of the programs it
identified. A radix node shared by two or more programs (an anchor: the system prompt and
tools every session of a role repeats) takes the best score of its programs' roles; the
engine then evicts by (type rank, survival, LRU), so among nodes of one type a predicted
role's anchor outlives the rest. Private nodes score 0: their order stays MORI's typed LRU,
and with no scores pushed (weak structure) the order is exactly that.

Pure state, independent of the SGLang version: the shared glue (sglang_common.MoriEngine,
so every supported line) consults `survival` from its eviction key and feeds `apply` from the
hint batches that are not stale; `forget` drops the roles of programs the engine forgot, so
the mapping stays as large as what the engine holds (MAX_AGENTS caps it regardless).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_patches.hint_book import HintError

MAX_AGENTS = 65_536  # program -> agent entries kept (least recently named dropped first)


def parse(body: Mapping[str, Any]) -> tuple[dict[str, float] | None, dict[str, str]]:
    """(scores or None when absent, agents) of a hint batch; HintError if malformed."""
    scores, agents = body.get("scores"), body.get("agents") or {}
    if scores is not None:
        ok = isinstance(scores, dict) and all(
            isinstance(a, str)
            and isinstance(s, int | float)
            and not isinstance(s, bool)
            and 0 <= s <= 1
            for a, s in scores.items()
        )
        if not ok:
            raise HintError("'scores' must map agent names to numbers in [0, 1]")
    ok = isinstance(agents, dict) and all(
        isinstance(p, str) and p and isinstance(a, str) and a for p, a in agents.items()
    )
    if not ok:
        raise HintError("'agents' must map program ids to agent names")
    return (None if scores is None else {a: float(s) for a, s in scores.items()}), agents


@dataclass
class AnchorScores:
    """The latest scores per agent role, and the role of each named program."""

    scores: dict[str, float] = field(default_factory=dict)
    agents: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def apply(self, scores: dict[str, float] | None, agents: Mapping[str, str]) -> None:
        """Take a parsed batch's `scores` (they replace the previous ones; None keeps them)
        and `agents`."""
        if scores is not None:
            self.scores = scores
        for program, agent in agents.items():
            self.agents[program] = agent
            self.agents.move_to_end(program)
        while len(self.agents) > MAX_AGENTS:
            self.agents.popitem(last=False)

    def forget(self, programs: Iterable[str]) -> None:
        """Drop the roles of programs the engine no longer tracks (ended, holding nothing)."""
        for program in programs:
            self.agents.pop(program, None)

    def survival(self, programs: Iterable[str]) -> float:
        """A node's score: the best of its programs' roles if two or more programs share
        it, else 0."""
        programs = list(programs)
        if len(programs) < 2 or not self.scores:
            return 0.0
        agents = {self.agents.get(p) for p in programs}
        return max((self.scores.get(a, 0.0) for a in agents if a is not None), default=0.0)
