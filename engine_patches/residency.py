"""Per-program residency counters (device tokens, host tokens), kept up to date incrementally.

Every radix node records the programs that touched it and its last observed lengths on each tier.
When a node changes (insert, split, evict, backup, load back) the cache hook calls `observe`, which
applies the delta to each of the node's programs, so reading residency never walks the tree.
A program's residency is the number of its context tokens resident on each tier; a shared prefix
counts for every program that uses it (that is what each program's next request can reuse).

Bounded: a node remembers at most MAX_NODE_PROGRAMS programs, the most recent users. A system
prompt matched by thousands of programs would otherwise carry all of them, and every eviction
decision walks a node's programs. A program pushed out of a shared node stops counting that
node's tokens: its residency is then a lower bound (the KV is still there), which only makes
the router's view conservative; the node's eviction rank comes from its recent users, the ones
whose hints matter.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

NodeId = Hashable
MAX_NODE_PROGRAMS = 16


@dataclass(frozen=True, slots=True)
class Residency:
    device_tokens: int = 0
    host_tokens: int = 0

    def as_json(self) -> dict[str, int]:
        return {"device_tokens": self.device_tokens, "host_tokens": self.host_tokens}


@dataclass
class _Node:
    programs: dict[str, None] = field(default_factory=dict)  # ordered set, oldest user first
    device: int = 0
    host: int = 0


@dataclass
class ResidencyLedger:
    """Node -> (programs, lengths) and program -> running sums; O(programs on node) per update."""

    _nodes: dict[NodeId, _Node] = field(default_factory=dict)
    _device: dict[str, int] = field(default_factory=dict)
    _host: dict[str, int] = field(default_factory=dict)
    _members: dict[str, set[NodeId]] = field(default_factory=dict)
    device_used: int = 0
    host_used: int = 0

    def stamp(self, node: NodeId, program: str) -> bool:
        """Record that `program` uses `node` (now its most recent user); True when new."""
        rec = self._nodes.setdefault(node, _Node())
        if program in rec.programs:
            rec.programs[program] = rec.programs.pop(program)  # most recent last
            return False
        if len(rec.programs) >= MAX_NODE_PROGRAMS:
            self._unstamp(node, rec, next(iter(rec.programs)))
        rec.programs[program] = None
        self._members.setdefault(program, set()).add(node)
        self._device[program] = self._device.get(program, 0) + rec.device
        self._host[program] = self._host.get(program, 0) + rec.host
        return True

    def _unstamp(self, node: NodeId, rec: _Node, program: str) -> None:
        """`program` no longer counts `node` (it left the node's bounded user set)."""
        del rec.programs[program]
        self._device[program] -= rec.device
        self._host[program] -= rec.host
        self._drop_membership(program, node)

    def _drop_membership(self, program: str, node: NodeId) -> None:
        members = self._members[program]
        members.discard(node)
        if not members:
            del self._members[program], self._device[program], self._host[program]

    def observe(self, node: NodeId, device_tokens: int, host_tokens: int) -> None:
        """The node now holds these many tokens on each tier (0 when absent there)."""
        rec = self._nodes.setdefault(node, _Node())
        dd, dh = device_tokens - rec.device, host_tokens - rec.host
        if not (dd or dh):
            return
        rec.device, rec.host = device_tokens, host_tokens
        self.device_used += dd
        self.host_used += dh
        for program in rec.programs:
            self._device[program] += dd
            self._host[program] += dh

    def forget(self, node: NodeId) -> None:
        """The node left the tree: drop its tokens and memberships."""
        self.observe(node, 0, 0)
        rec = self._nodes.pop(node, None)
        for program in rec.programs if rec else ():
            self._drop_membership(program, node)

    def copy_programs(self, src: NodeId, dst: NodeId) -> None:
        """A split: the new parent `dst` is used by everyone who used `src` (same order)."""
        rec = self._nodes.get(src)
        for program in list(rec.programs) if rec else ():
            self.stamp(dst, program)

    def programs_of(self, node: NodeId) -> frozenset[str]:
        rec = self._nodes.get(node)
        return frozenset(rec.programs) if rec else frozenset()

    def nodes_of(self, program: str) -> frozenset[NodeId]:
        return frozenset(self._members.get(program, ()))

    def programs(self) -> Iterable[str]:
        return self._members.keys()

    def holds(self, program: str) -> bool:
        """Whether `program` still counts any node."""
        return program in self._members

    def size(self) -> dict[str, int]:
        """How much the ledger holds (bounded by the tree, not by the programs ever seen)."""
        widest = max((len(r.programs) for r in self._nodes.values()), default=0)
        return {"nodes": len(self._nodes), "programs": len(self._members), "widest_node": widest}

    def residency(self, program: str) -> Residency:
        return Residency(self._device.get(program, 0), self._host.get(program, 0))
