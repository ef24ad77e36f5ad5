"""The trace format of DESIGN.md: one program per JSON line, steps in order.

`load_trace` is strict: a corpus that loads is one the simulator and the replay clients can
run without second-guessing it, and a bad one fails with a `TraceError` that names the
file, the line, the field and what is wrong with it. Unknown *program* fields are kept in
`TraceProgram.extra` (provenance such as `source` or `model` travels with a program);
unknown *step* fields are rejected, because a misspelt `tool_s` would otherwise silently
replay as a zero-length tool call.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from router.policy.app_graph import check_edges


@dataclass(frozen=True, slots=True)
class TraceStep:
    input_tokens: int  # the whole prompt
    output_tokens: int
    reused_tokens: int = 0  # prefix shared with the program's previous call
    tool_s: float = 0.0  # gap after this step's response (0 after the last)
    tool: str | None = None
    # Steps of programs of the same task that must finish before this step is sent (a hand-
    # over); the gap before it is then those steps' end, and `tool_s` before it is nominal.
    after: tuple[tuple[str, int], ...] = ()
    # The prompt's leading content, block by block: the first `segments_kept` blocks of the
    # previous step's prompt, then these (id, tokens) blocks, in order; the rest of the
    # prompt is unnamed. Equal ids are equal text: an engine shares a run of blocks that
    # starts the prompts of two programs (exact), and the same block at other offsets only
    # by approximate reuse. Ids are per task instance; an id starting with "@" names text
    # every task shares (an application's system prompt).
    segments: tuple[tuple[str, int], ...] = ()
    segments_kept: int = 0
    round: str | None = None  # the All-Gather round the step belongs to (within its task)


@dataclass(frozen=True, slots=True)
class TraceProgram:
    program_id: str
    steps: tuple[TraceStep, ...]
    parent_id: str | None = None
    start_s: float = 0.0  # for subagents: seconds after the parent's start
    agent: str | None = None
    anchor_tokens: int = 0  # first-prompt prefix shared by every program of this agent role
    inherit_tokens: int = 0  # first-prompt prefix repeated from the parent's context (a fork)
    app: str | None = None  # the application (agent graph) the program's task runs
    # a main program's app graph: agent-role edges (a -> b: b consumes a's output), what the
    # app registers with a graph-aware router (POST /v1/apps) before its tasks run
    graph: tuple[tuple[str, str], ...] = ()
    extra: dict = field(default_factory=dict)


class TraceError(ValueError):
    """A trace file that breaks the format; says where (file, line, field) and why."""

    def __init__(self, path: str | Path, line: int | None, field: str | None, reason: str):
        self.path, self.line, self.field, self.reason = str(path), line, field, reason
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where}: {self.field}: {self.reason}" if self.field else f"{where}: {self.reason}"


# field -> (JSON types accepted, required, minimum); `None` in the types means null is allowed.
_NUMBER = (int, float)
_PROGRAM_FIELDS: dict[str, tuple[tuple, bool, float | None]] = {
    "program_id": ((str,), True, None),
    "parent_id": ((str, type(None)), False, None),
    "start_s": (_NUMBER, False, 0),
    "agent": ((str, type(None)), False, None),
    "anchor_tokens": ((int,), False, 0),
    "inherit_tokens": ((int,), False, 0),
    "app": ((str, type(None)), False, None),
    "graph": ((list,), False, None),
    "steps": ((list,), True, None),
}
_STEP_FIELDS: dict[str, tuple[tuple, bool, float | None]] = {
    "input_tokens": ((int,), True, 1),
    "output_tokens": ((int,), True, 0),
    "reused_tokens": ((int,), False, 0),
    "tool_s": (_NUMBER, False, 0),
    "tool": ((str, type(None)), False, None),
    "after": ((list,), False, None),
    "segments": ((list,), False, None),
    "segments_kept": ((int,), False, 0),
    "round": ((str, type(None)), False, None),
}
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", list: "a list"}


def _check_fields(raw: object, spec: dict, where: str, fail) -> None:
    """Types, presence and lower bounds of one JSON object against `spec`."""
    if not isinstance(raw, dict):
        fail(where or None, f"must be a JSON object, got {type(raw).__name__}")
    prefix = f"{where}." if where else ""
    for name, (types, required, minimum) in spec.items():
        if name not in raw:
            if required:
                fail(f"{prefix}{name}", "required field is missing")
            continue
        value = raw[name]
        # bool is an int subclass in Python; `true` is never a token count.
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join(_TYPE_NAMES.get(t, "null") for t in types)
            fail(f"{prefix}{name}", f"must be {wanted}, got {json.dumps(value)[:40]}")
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{prefix}{name}", f"must be finite, got {value}")
        if minimum is not None and value is not None and value < minimum:
            fail(f"{prefix}{name}", f"must be >= {minimum}, got {value}")
        if name == "program_id" and not value.strip():
            fail(f"{prefix}{name}", "must not be empty")


def _parse_after(raw: list, where: str, fail) -> tuple[tuple[str, int], ...]:
    """`after`: a list of [program_id, step index] pairs."""
    out = []
    for ref in raw:
        ok = isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str)
        ok = ok and isinstance(ref[1], int) and not isinstance(ref[1], bool) and ref[1] >= 0
        if not ok:
            fail(f"{where}.after", f"must list [program_id, step index] pairs, got {ref!r:.40}")
        out.append((ref[0], ref[1]))
    return tuple(out)


def _parse_segments(raw: list, where: str, fail) -> tuple:
    """`segments`: a list of [id, tokens >= 1] pairs."""
    out = []
    for seg in raw:
        ok = isinstance(seg, list) and len(seg) == 2 and isinstance(seg[0], str) and seg[0]
        ok = ok and isinstance(seg[1], int) and not isinstance(seg[1], bool) and seg[1] >= 1
        if not ok:
            fail(f"{where}.segments", f"must list [id, tokens >= 1] pairs, got {seg!r:.40}")
        out.append((seg[0], seg[1]))
    return tuple(out)


def _check_blocks(step: TraceStep, blocks: list[int], where: str, fail) -> list[int]:
    """The token counts of the step's named blocks (the previous step's kept ones, then its
    own): they must not outgrow the prompt."""
    if step.segments_kept > len(blocks):
        reason = f"{step.segments_kept} > the previous step's {len(blocks)} blocks"
        fail(f"{where}.segments_kept", reason)
    blocks = blocks[: step.segments_kept] + [tokens for _, tokens in step.segments]
    if sum(blocks) > step.input_tokens:
        fail(f"{where}.segments", f"{sum(blocks)} tokens > input_tokens {step.input_tokens}")
    return blocks


def _parse_steps(raw_steps: list, fail) -> tuple[TraceStep, ...]:
    if not raw_steps:
        fail("steps", "a program needs at least one step")
    steps: list[TraceStep] = []
    blocks: list[int] = []
    for i, raw in enumerate(raw_steps):
        where = f"steps[{i}]"
        _check_fields(raw, _STEP_FIELDS, where, fail)
        unknown = sorted(set(raw) - set(_STEP_FIELDS))
        if unknown:
            fail(f"{where}.{unknown[0]}", f"unknown step field (known: {', '.join(_STEP_FIELDS)})")
        segments = _parse_segments(raw.get("segments", []), where, fail)
        after = _parse_after(raw.get("after", []), where, fail)
        step = TraceStep(**{**raw, "after": after, "segments": segments})
        blocks = _check_blocks(step, blocks, where, fail)
        reused = f"{where}.reused_tokens"
        # The reused prefix is part of this prompt and was in the previous call's KV.
        limit = 0 if not steps else steps[-1].input_tokens + steps[-1].output_tokens
        if step.reused_tokens > limit:
            why = (
                "the first step has no previous call to reuse"
                if not steps
                else f"previous step had input+output = {limit}"
            )
            fail(reused, f"{step.reused_tokens} exceeds what can be reused: {why}")
        if step.reused_tokens > step.input_tokens:
            fail(reused, f"{step.reused_tokens} > input_tokens {step.input_tokens}")
        steps.append(step)
    if steps[-1].tool_s != 0:
        fail(f"steps[{len(steps) - 1}].tool_s", "must be 0 on the last step (nothing follows it)")
    return tuple(steps)


def parse_program(raw: object, path: str | Path = "<trace>", line: int | None = None):
    """One decoded JSON line -> TraceProgram, or TraceError naming what is wrong."""

    def fail(field: str | None, reason: str):
        raise TraceError(path, line, field, reason)

    _check_fields(raw, _PROGRAM_FIELDS, "", fail)
    steps = _parse_steps(raw["steps"], fail)
    known = {k: raw[k] for k in _PROGRAM_FIELDS if k in raw and k != "steps"}
    if "graph" in known:
        try:
            known["graph"] = check_edges(known["graph"], "graph")
        except ValueError as e:
            fail(None, str(e))
    extra = {k: v for k, v in raw.items() if k not in _PROGRAM_FIELDS}
    program = TraceProgram(steps=steps, extra=extra, **known)
    if program.graph and program.parent_id is not None:
        fail("graph", "only a main program (no parent_id) carries its app's graph")
    for name in ("anchor_tokens", "inherit_tokens"):
        if getattr(program, name) > steps[0].input_tokens:
            fail(name, f"{getattr(program, name)} > first prompt {steps[0].input_tokens}")
    if program.inherit_tokens and program.parent_id is None:
        fail("inherit_tokens", "only a subagent (with a parent_id) inherits a prefix")
    if program.inherit_tokens and program.anchor_tokens:
        fail("inherit_tokens", "a forked prompt starts with its parent's context, not an anchor")
    if program.parent_id == program.program_id:
        fail("parent_id", "a program cannot be its own parent")
    return program


def _check_links(programs: list[TraceProgram], lines: list[int], path: str | Path) -> None:
    """Unique ids, and every parent_id names a program of the file without a cycle."""
    seen: dict[str, int] = {}
    for program, line in zip(programs, lines, strict=True):
        if program.program_id in seen:
            first = seen[program.program_id]
            raise TraceError(path, line, "program_id", f"duplicate of line {first}")
        seen[program.program_id] = line
    parents = {p.program_id: p.parent_id for p in programs}
    contexts = {p.program_id: _peak(p) for p in programs}
    for program, line in zip(programs, lines, strict=True):
        if program.parent_id is not None and program.parent_id not in parents:
            raise TraceError(path, line, "parent_id", f"no program {program.parent_id!r} in file")
        if program.inherit_tokens > contexts.get(program.parent_id, 0):  # type: ignore[arg-type]
            reason = f"{program.inherit_tokens} > the parent's largest context"
            raise TraceError(path, line, "inherit_tokens", reason)
        chain, node = {program.program_id}, program.parent_id
        while node is not None:
            if node in chain:
                raise TraceError(path, line, "parent_id", f"parent chain loops through {node!r}")
            chain.add(node)
            node = parents[node]
    _check_after(programs, lines, path, parents)


def _root(pid: str, parents: dict[str, str | None]) -> str:
    while parents[pid] is not None:
        pid = parents[pid]  # type: ignore[assignment]
    return pid


def _check_after(
    programs: list[TraceProgram], lines: list[int], path: str | Path, parents: dict
) -> None:
    """Every `after` names a step of a program of the same task (root), and the steps with
    their hand-overs form no cycle (a replay would wait forever)."""
    by_id = {p.program_id: p for p in programs}
    waits: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for program, line in zip(programs, lines, strict=True):
        for i, step in enumerate(program.steps):
            for ref in step.after:
                other = by_id.get(ref[0])
                field = f"steps[{i}].after"
                if other is None or _root(ref[0], parents) != _root(program.program_id, parents):
                    raise TraceError(path, line, field, f"{ref[0]!r} is not a program of this task")
                if ref[1] >= len(other.steps):
                    raise TraceError(path, line, field, f"{ref[0]!r} has no step {ref[1]}")
                waits.setdefault((program.program_id, i), []).append(ref)
    if waits:
        _acyclic(by_id, waits, path)


def _acyclic(by_id: dict, waits: dict, path: str | Path) -> None:
    """Kahn's algorithm over the steps of the programs involved: each step follows its
    program's previous step and the steps it waits for."""
    involved = {pid for pid, _ in waits} | {ref[0] for refs in waits.values() for ref in refs}
    preds: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for pid in involved:
        for i in range(len(by_id[pid].steps)):
            preds[pid, i] = ([(pid, i - 1)] if i else []) + waits.get((pid, i), [])
    pending = {node: len(p) for node, p in preds.items()}
    follows: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for node, p in preds.items():
        for before in p:
            follows.setdefault(before, []).append(node)
    ready = [node for node, n in pending.items() if n == 0]
    while ready:
        for node in follows.get(ready.pop(), []):
            pending[node] -= 1
            if pending[node] == 0:
                ready.append(node)
    stuck = sorted(node for node, n in pending.items() if n > 0)
    if stuck:
        pid, i = stuck[0]
        raise TraceError(path, None, f"{pid} steps[{i}].after", "hand-overs wait in a cycle")


def _peak(program: TraceProgram) -> int:
    """The program's largest context (prompt + output of one step)."""
    return max(s.input_tokens + s.output_tokens for s in program.steps)


def parse_lines(lines: Iterable[str], path: str | Path = "<trace>") -> list[TraceProgram]:
    """Parse and validate JSONL text; blank lines are skipped, line numbers are 1-based."""
    programs, numbers = [], []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            reason = f"invalid JSON: {e.msg} (column {e.colno})"
            raise TraceError(path, number, None, reason) from None
        programs.append(parse_program(raw, path, number))
        numbers.append(number)
    if not programs:
        raise TraceError(path, None, None, "holds no programs")
    _check_links(programs, numbers, path)
    return programs


def load_trace(path: str | Path) -> list[TraceProgram]:
    """Read and validate a trace file; raises TraceError (a ValueError) on any defect."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(path, None, None, f"cannot read: {e}") from e
    return parse_lines(text.splitlines(), path)


def program_to_dict(program: TraceProgram) -> dict:
    """The JSON object of one line; optional fields left out when they hold their default."""
    out: dict = {"program_id": program.program_id, "parent_id": program.parent_id}
    out["start_s"] = program.start_s
    if program.agent is not None:
        out["agent"] = program.agent
    if program.anchor_tokens:
        out["anchor_tokens"] = program.anchor_tokens
    if program.inherit_tokens:
        out["inherit_tokens"] = program.inherit_tokens
    if program.app is not None:
        out["app"] = program.app
    if program.graph:
        out["graph"] = [list(edge) for edge in program.graph]
    out.update(program.extra)
    out["steps"] = [
        {k: v for k, v in asdict(s).items() if v is not None and v != ()} for s in program.steps
    ]
    return out


def dump_trace(programs: Iterable[TraceProgram], path: str | Path) -> None:
    """Write programs as JSONL, one compact line each (the inverse of load_trace)."""
    lines = (json.dumps(program_to_dict(p), separators=(",", ":")) for p in programs)
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
