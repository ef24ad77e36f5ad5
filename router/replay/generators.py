"""The trace generators behind `mori trace generate --preset`, picked by the preset's `kind`.

`agent` (the default): single-agent programs with subagents, Claude-Code-like
(`router.replay.generate`). `supervisor`: multi-agent apps where a selector hands turns to
specialist roles (`router.replay.multiagent`). `dag`: apps whose agent roles form a DAG
with fan-out and fan-in, Tokencake's Code-Writer and Deep-Research (`router.replay.dag`).
`allgather`: agents in synchronized rounds that each receive all the others' answers,
TokenDance's GenerativeAgents and AgentSociety (`router.replay.allgather`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel

from router.replay import allgather, dag, multiagent
from router.replay import generate as single
from router.replay.trace import TraceProgram

KINDS: dict[str, tuple[type[BaseModel], Callable[..., Iterator[TraceProgram]]]] = {
    "agent": (single.Preset, single.generate),
    "supervisor": (multiagent.SupervisorPreset, multiagent.generate),
    "dag": (dag.DagPreset, dag.generate),
    "allgather": (allgather.AllgatherPreset, allgather.generate),
}

AnyPreset = single.Preset | multiagent.SupervisorPreset | dag.DagPreset | allgather.AllgatherPreset


def load_preset(name_or_path: str | Path) -> AnyPreset:
    """A preset by name (traces/presets/NAME.yaml) or path, validated by its kind's model."""
    raw = single.preset_dict(name_or_path)
    kind = raw.get("kind", "agent")
    if kind not in KINDS:
        known = ", ".join(KINDS)
        raise ValueError(f"preset {name_or_path}: unknown kind {kind!r} (one of {known})")
    return KINDS[kind][0].model_validate(raw)  # type: ignore[return-value]


def generate(preset: AnyPreset, programs: int, seed: int) -> Iterator[TraceProgram]:
    """`programs` top-level programs (tasks, for a multi-agent preset) and their subagents."""
    return KINDS[preset.kind][1](preset, programs, seed)
