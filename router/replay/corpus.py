"""The program source of a closed-loop replay (DESIGN.md "Trace format"), shared by the
simulator and the live replay so both walk the corpus identically for a given seed: main
programs in a seeded order, cycled when exhausted; each one's subagents start beside it."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from router.replay.trace import TraceProgram, TraceStep


class ClosedLoopCorpus:
    """Main programs in a seeded shuffle, cycled; subagents by parent; instance numbers."""

    def __init__(self, corpus: list[TraceProgram], token_scale: float, seed: int) -> None:
        if not corpus:
            raise ValueError("empty corpus")
        programs = [scale_program(p, token_scale) for p in corpus]
        self._children: dict[str, list[TraceProgram]] = {}
        for p in programs:
            if p.parent_id is not None:
                self._children.setdefault(p.parent_id, []).append(p)
        self.mains = [p for p in programs if p.parent_id is None]
        if not self.mains:
            raise ValueError("corpus has no main program (every program has a parent_id)")
        self.rng = random.Random(seed)
        self.rng.shuffle(self.mains)
        self._cursor = itertools.count()
        self._instances = itertools.count()

    def next_main(self) -> TraceProgram:
        """The next main program for a client that finished its last one."""
        return self.mains[next(self._cursor) % len(self.mains)]

    def next_instance(self) -> int:
        """A fresh number, so replaying a program twice gives two distinct program ids."""
        return next(self._instances)

    def subagents(self, program: TraceProgram) -> list[TraceProgram]:
        """Subagents of `program`; each starts `start_s` after it as its own client."""
        return self._children.get(program.program_id, [])


def scale_program(program: TraceProgram, scale: float) -> TraceProgram:
    """Multiply every token count (prompt, output, reuse) by `scale`, keeping them valid:
    a reused prefix never exceeds the new prompt nor the previous step's context."""
    if scale == 1.0:
        return program
    steps: list[TraceStep] = []
    blocks = 0  # named blocks of the previous (scaled) step
    for st in program.steps:
        prompt = max(1, round(st.input_tokens * scale))
        limit = steps[-1].input_tokens + steps[-1].output_tokens if steps else 0
        reused = min(round(st.reused_tokens * scale), limit, prompt)
        out = round(st.output_tokens * scale)
        kept = min(st.segments_kept, blocks)
        kept_tokens = _kept_tokens(steps, kept)
        segments = _scale_segments(st.segments, scale, prompt - kept_tokens)
        blocks = kept + len(segments)
        steps.append(
            replace(
                st,
                input_tokens=prompt,
                output_tokens=out,
                reused_tokens=reused,
                segments=segments,
                segments_kept=kept,
            )
        )
    first = steps[0].input_tokens
    anchor = min(round(program.anchor_tokens * scale), first)
    inherit = min(round(program.inherit_tokens * scale), first)
    return replace(program, steps=tuple(steps), anchor_tokens=anchor, inherit_tokens=inherit)


def _kept_tokens(steps: list[TraceStep], kept: int) -> int:
    """Tokens of the first `kept` named blocks of the last step's prompt."""
    if not steps or not kept:
        return 0
    last = steps[-1]
    inherited = min(kept, last.segments_kept)
    own = [tokens for _, tokens in last.segments[: kept - inherited]]
    return _kept_tokens(steps[:-1], inherited) + sum(own)


def _scale_segments(
    segments: tuple[tuple[str, int], ...], scale: float, prompt: int
) -> tuple[tuple[str, int], ...]:
    """Scaled blocks (at least one token each) that still fit in the scaled prompt."""
    out, total = [], 0
    for sid, tokens in segments:
        tokens = max(1, round(tokens * scale))
        if total + tokens > prompt:
            break
        out.append((sid, tokens))
        total += tokens
    return tuple(out)


class HandOffs:
    """Hand-overs between the programs of one task (`TraceStep.after`): which steps have
    finished per task instance, and who waits for which. Pure bookkeeping, the replayers
    (simulator, live replay) decide what waiting means."""

    def __init__(self) -> None:
        self._done: dict[str, set[tuple[str, int]]] = {}
        self._waiting: dict[tuple[str, str, int], list] = {}

    def missing(self, session: str, refs: tuple[tuple[str, int], ...]) -> tuple[str, int] | None:
        """The first of `refs` not finished yet in task instance `session` (None: all are)."""
        done = self._done.get(session, set())
        return next((ref for ref in refs if ref not in done), None)

    def park(self, session: str, ref: tuple[str, int], waiter: object) -> None:
        self._waiting.setdefault((session, *ref), []).append(waiter)

    def finish(self, session: str, program_id: str, step: int) -> list:
        """Step `step` of `program_id` finished: returns the waiters parked on it."""
        self._done.setdefault(session, set()).add((program_id, step))
        return self._waiting.pop((session, program_id, step), [])

    def end(self, session: str) -> None:
        """The task instance is over: forget it."""
        self._done.pop(session, None)
        for key in [k for k in self._waiting if k[0] == session]:
            del self._waiting[key]
