"""Which radix nodes a hint transition acts on (MORI 4.3.2 typed offloading), as pure planning.

The SGLang adapter turns the program's nodes into NodeView snapshots and executes the plan:
`offload_plan` for a program that became idle (free the device copy, keep the host copy) and
`load_back_plan` for one that became busy (queue host -> device so the next prefill hits device).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the plan needs to know about one radix node."""

    id: Hashable
    depth: int  # distance from the root
    programs: frozenset[str]
    on_device: bool
    backed_up: bool  # has a host copy
    locked: bool  # a running request holds it
    children: tuple[Hashable, ...] = ()
    children_on_device: tuple[Hashable, ...] = ()


def offload_plan(program: str, views: Iterable[NodeView]) -> list[Hashable]:
    """Nodes to demote, children before parents.

    A node qualifies when only `program` uses it, it is on device, backed up and unlocked, and
    every child still on device is demoted too (HiCache requires an evicted node's subtree to be
    evicted): a shared or locked descendant therefore pins its ancestors on device.
    """
    chosen: set[Hashable] = set()
    order: list[Hashable] = []
    for v in sorted(views, key=lambda v: -v.depth):
        own = v.programs == frozenset({program})
        movable = own and v.on_device and v.backed_up and not v.locked
        if movable and all(c in chosen for c in v.children_on_device):
            chosen.add(v.id)
            order.append(v.id)
    return order


def load_back_plan(program: str, views: Sequence[NodeView]) -> list[Hashable]:
    """Deepest host-only nodes of `program`: loading one back brings its evicted ancestors too."""
    host_only = {v.id for v in views if program in v.programs and not v.on_device and v.backed_up}
    return [
        v.id
        for v in sorted(views, key=lambda v: -v.depth)
        if v.id in host_only and not any(c in host_only for c in v.children)
    ]
