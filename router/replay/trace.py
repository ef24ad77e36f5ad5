"""The trace format of DESIGN.md: one program per JSON line, steps in order."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceStep:
    input_tokens: int  # the whole prompt
    output_tokens: int
    reused_tokens: int = 0  # prefix shared with the program's previous call
    tool_s: float = 0.0  # gap after this step's response (0 after the last)
    tool: str | None = None


@dataclass(frozen=True, slots=True)
class TraceProgram:
    program_id: str
    steps: tuple[TraceStep, ...]
    parent_id: str | None = None
    start_s: float = 0.0  # for subagents: seconds after the parent's start
    agent: str | None = None
    anchor_tokens: int = 0
    extra: dict = field(default_factory=dict)


def load_trace(path: str | Path) -> list[TraceProgram]:
    """Read a trace file (minimal reader; validation lives in router.replay.validate)."""
    programs = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        steps = tuple(TraceStep(**s) for s in raw.pop("steps"))
        programs.append(TraceProgram(steps=steps, **raw))
    return programs
