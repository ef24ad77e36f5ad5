"""Named prompt blocks of a trace and their chain ids (TokenDance §4.1, exact mode).

A trace step may name its prompt's blocks (`TraceStep.segments`: id and tokens, in order).
A block's *chain* id hashes the ids of every block up to it, so two prompts with the same
chain id at some block start with the same text up to there: that prefix is what an engine
can share exactly (SGLang's radix tree shares identical prefixes, whatever program computed
them). A block's *content* id is its text alone: the same gathered output at another offset
has the same content id and another chain id, and only approximate reuse could share it.

The engine side, where a chain id's prefix ends in a replica's radix tree, is the tree's
own (`router.sim.kv_tree.SegmentIndex`).

`PromptBlocks` follows each replaying program's named blocks from step to step and says
what the engine (`chain`, for `SharedPrefix.chain`) and the policy (`advance`, for
`Policy.on_prompt`) are told. Ids are scoped to the task instance (a replayed task computes
its own outputs); an id starting with "@" is global.
"""

from __future__ import annotations

import hashlib

from router.policy.types import Segment
from router.replay.trace import TraceProgram, TraceStep

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
