"""Per-program residency counters (device tokens, host tokens), kept up to date incrementally.

Every radix node records the programs that touched it and its last observed lengths on each tier.
When a node changes (insert, split, evict, backup, load back) the cache hook calls `observe`, which
applies the delta to each of the node's programs, so reading residency never walks the tree.
A program's residency is the number of its context tokens resident on each tier; a shared prefix
counts for every program that uses it (that is what each program's next request can reuse).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

NodeId = Hashable


@dataclass(frozen=True, slots=True)
class Residency:
    device_tokens: int = 0
    host_tokens: int = 0

    def as_json(self) -> dict[str, int]:
        return {"device_tokens": self.device_tokens, "host_tokens": self.host_tokens}


@dataclass
class _Node:
    programs: set[str] = field(default_factory=set)
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
        """Record that `program` uses `node`; True when that is new."""
        rec = self._nodes.setdefault(node, _Node())
        if program in rec.programs:
            return False
        rec.programs.add(program)
        self._members.setdefault(program, set()).add(node)
        self._device[program] = self._device.get(program, 0) + rec.device
        self._host[program] = self._host.get(program, 0) + rec.host
        return True

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
            members = self._members[program]
            members.discard(node)
            if not members:
                del self._members[program], self._device[program], self._host[program]

    def copy_programs(self, src: NodeId, dst: NodeId) -> None:
        """A split: the new parent `dst` is used by everyone who used `src`."""
        for program in sorted(self.programs_of(src)):
            self.stamp(dst, program)

    def programs_of(self, node: NodeId) -> frozenset[str]:
        rec = self._nodes.get(node)
        return frozenset(rec.programs) if rec else frozenset()

    def nodes_of(self, program: str) -> frozenset[NodeId]:
        return frozenset(self._members.get(program, ()))

    def programs(self) -> Iterable[str]:
        return self._members.keys()

    def residency(self, program: str) -> Residency:
        return Residency(self._device.get(program, 0), self._host.get(program, 0))
