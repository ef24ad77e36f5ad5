"""MORI's actions in the per-request `kv_hints` envelope (docs/hint-protocol.md).

SGLang 0.5.23 carries a typed, versioned envelope on a request (`protocol_version`,
`message_id`, `actions` of `action_type` / `action_version` / `payload`); a consumer implements
the action types it knows and ignores the rest. The plugin implements `mori.program_type`
version 1: the program's type from this request on, unless a hint batch with a higher epoch
already said otherwise. Pure: reads the envelope's attributes, validates each payload, and
skips what it does not understand (an envelope is advisory, never an error).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from router.policy.types import Hint

PROGRAM_TYPE = "mori.program_type"
VERSION = "1"


@dataclass(frozen=True, slots=True)
class ProgramType:
    """One `mori.program_type` action."""

    program: str
    hint: Hint
    epoch: int


def program_types(envelope: Any) -> Iterator[ProgramType]:
    """The valid `mori.program_type` v1 actions of an envelope (None: none)."""
    for action in getattr(envelope, "actions", None) or ():
        if (action.action_type, action.action_version) != (PROGRAM_TYPE, VERSION):
            continue
        payload = action.payload if isinstance(action.payload, dict) else {}
        program, kind, epoch = payload.get("program"), payload.get("type"), payload.get("epoch")
        if not (isinstance(program, str) and program and isinstance(epoch, int)):
            continue
        if kind in {h.value for h in Hint} and not isinstance(epoch, bool):
            yield ProgramType(program, Hint(kind), epoch)
