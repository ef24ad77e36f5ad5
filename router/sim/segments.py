"""The content-addressed segment store beside the radix tree (TokenDance §4.1, exact mode).

A trace step may name its prompt's blocks (`TraceStep.segments`: id and tokens, in order).
A block's *chain* id hashes the ids of every block up to it, so two prompts with the same
chain id at some block start with the same text up to there: that prefix is what an engine
can share exactly (SGLang's radix tree shares identical prefixes, whatever program computed
them). A block's *content* id is its text alone: the same gathered output at another offset
has the same content id and another chain id, and only approximate reuse could share it.

`SegmentIndex` maps chain ids to where their prefix ends in a replica's `KVTree` (a node and
an absolute token offset), so a request whose prompt starts with a prefix another program
computed finds it even though its own cached path does not hold it (the shared-first
layout of an All-Gather round: the gathered outputs first, then the private history). It
is kept lazily: an entry whose node left the tree, or was cut short, is dead and dropped
when met.

`PromptBlocks` follows each replaying program's named blocks from step to step and says
what the engine (`chain`, for `SharedPrefix.chain`) and the policy (`advance`, for
`Policy.on_prompt`) are told. Ids are scoped to the task instance (a replayed task computes
its own outputs); an id starting with "@" is global.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from router.policy.types import Segment
from router.replay.trace import TraceProgram, TraceStep

if TYPE_CHECKING:
    from router.sim.kv_tree import Node

GLOBAL = "@"  # a segment id with this prefix is shared by every task


def scoped(segment_id: str, session: str) -> str:
    """A trace segment id in the namespace of task instance `session`."""
    return segment_id if segment_id.startswith(GLOBAL) else f"{session}/{segment_id}"


def chain_id(previous: str, content: str) -> str:
    """The chain id of a block: its content after the chain of the blocks before it."""
    return hashlib.blake2b(f"{previous}\0{content}".encode(), digest_size=8).hexdigest()


class PromptBlocks:
    """The named blocks of each replaying program's current prompt. A step lists only the
    blocks it adds after the previous step's first `segments_kept` ones, so the replayer
    keeps the whole list per program instance (and its chain ids, computed once)."""

    def __init__(self) -> None:
        self._of: dict[str, list[Segment]] = {}

    def advance(
        self, pid: str, program: TraceProgram, step: TraceStep, session: str
    ) -> tuple[Segment, ...]:
        """The program's next prompt: its named blocks (for the policy's `on_prompt`), else
        its agent role's anchor (stored once per replica for every program of the role)."""
        blocks = self._of.get(pid, [])[: step.segments_kept]
        chain = blocks[-1].chain if blocks else ""
        for sid, tokens in step.segments:
            content = scoped(sid, session)
            chain = chain_id(chain, content)
            blocks.append(Segment(chain, content, tokens))
        self._of[pid] = blocks
        if blocks:
            return tuple(blocks)
        anchor = program.anchor_tokens
        if anchor and step.input_tokens >= anchor and not program.inherit_tokens:
            key = f"anchor:{program.agent or ''}"
            return (Segment(f"{key}:{anchor}", key, anchor),)
        return ()

    def current(self, pid: str) -> tuple[Segment, ...]:
        """The named blocks of the program's current prompt."""
        return tuple(self._of.get(pid, ()))

    def chain(self, pid: str) -> tuple[tuple[str, int], ...]:
        """(chain id, end offset) of every named block of the program's prompt (engine)."""
        out, end = [], 0
        for block in self._of.get(pid, ()):
            end += block.tokens
            out.append((block.chain, end))
        return tuple(out)

    def forget(self, pid: str) -> None:
        self._of.pop(pid, None)


class SegmentIndex:
    """Chain id -> (node, end): where a prefix of that chain ends in one replica's tree."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[Node, int]] = {}
        self._of_node: dict[Node, list[str]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def longest(self, chain: tuple[tuple[str, int], ...], limit: int) -> tuple[list, int] | None:
        """The path to the longest prefix of `chain` (ending at most at `limit`) held in the
        tree, with its end: (nodes from the root, end offset), or None."""
        for chain_id, end in reversed(chain):
            if end > limit:
                continue
            entry = self._at.get(chain_id)
            if entry is None:
                continue
            path = _path_to(entry[0], end)
            if path is not None:
                return path, end
            self._drop_entry(chain_id)
        return None

    def register(self, chain: tuple[tuple[str, int], ...], path: list) -> None:
        """Note where each prefix of `chain` ends along `path` (the nodes of a context
        that starts with it); entries still alive are kept."""
        starts, pos = [], 0
        for node in path:
            starts.append(pos)
            pos += node.length
        i = 0
        for chain_id, end in chain:
            if end > pos:
                return
            entry = self._at.get(chain_id)
            if entry is not None and _path_to(entry[0], end) is not None:
                continue
            while starts[i] + path[i].length < end:
                i += 1
            node = path[i]
            self._at[chain_id] = (node, end)
            self._of_node.setdefault(node, []).append(chain_id)

    def drop(self, node: Node) -> None:
        """`node` left the tree: prefixes that ended in it are gone."""
        for chain_id in self._of_node.pop(node, ()):
            entry = self._at.get(chain_id)
            if entry is not None and entry[0] is node:
                del self._at[chain_id]

    def _drop_entry(self, chain_id: str) -> None:
        node, _ = self._at.pop(chain_id)
        ids = self._of_node.get(node)
        if ids is not None and chain_id in ids:
            ids.remove(chain_id)


def _path_to(node: Node, end: int) -> list | None:
    """The nodes from the root to the one holding offset `end` (the prefix ends inside or
    at the end of it), walking up from `node` (a split moves a prefix's end into an
    ancestor); None if the tree no longer holds that many tokens there."""
    chain = [node]
    while chain[-1].parent is not None:
        chain.append(chain[-1].parent)
    chain.reverse()
    pos = 0
    for i, n in enumerate(chain):
        if pos < end <= pos + n.length:
            return chain[: i + 1]
        pos += n.length
    return None
