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
    for st in program.steps:
        prompt = max(1, round(st.input_tokens * scale))
        limit = steps[-1].input_tokens + steps[-1].output_tokens if steps else 0
        reused = min(round(st.reused_tokens * scale), limit, prompt)
        out = round(st.output_tokens * scale)
        steps.append(TraceStep(prompt, out, reused, st.tool_s, st.tool))
    first = steps[0].input_tokens
    anchor = min(round(program.anchor_tokens * scale), first)
    inherit = min(round(program.inherit_tokens * scale), first)
    return replace(program, steps=tuple(steps), anchor_tokens=anchor, inherit_tokens=inherit)
