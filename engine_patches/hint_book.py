"""The engine's record of router hints (docs/hint-protocol.md): epochs, full syncs, idempotence.

Pure state: the scheduler applies a batch and gets back which programs changed type, so it acts
(offload, load back) only on real transitions and a re-sent batch is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from router.policy.types import Hint


class HintError(ValueError):
    """A malformed hint batch (answered 400)."""


@dataclass(frozen=True, slots=True)
class HintBatch:
    """One validated POST /mori/hints body."""

    epoch: int
    hints: Mapping[str, Hint]
    full: bool = False

    @classmethod
    def parse(cls, body: object) -> HintBatch:
        """Validate a decoded JSON body; raise HintError with a message a client can act on."""
        if not isinstance(body, dict):
            raise HintError("body must be a JSON object")
        epoch, hints, full = body.get("epoch"), body.get("hints"), body.get("full", False)
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise HintError("'epoch' must be a non-negative integer")
        if not isinstance(hints, dict):
            raise HintError("'hints' must be an object mapping program id to type")
        if not isinstance(full, bool):
            raise HintError("'full' must be a boolean")
        parsed: dict[str, Hint] = {}
        for program, kind in hints.items():
            if not program:
                raise HintError("program ids must be non-empty strings")
            try:
                parsed[program] = Hint(kind)
            except ValueError:
                allowed = ", ".join(h.value for h in Hint)
                raise HintError(
                    f"unknown type {kind!r} for {program!r} (one of {allowed})"
                ) from None
        return cls(epoch=epoch, hints=parsed, full=full)


@dataclass(frozen=True, slots=True)
class Applied:
    """Outcome of one batch: stale batches change nothing."""

    stale: bool
    changed: Mapping[str, Hint]  # program -> its new type, only real transitions


@dataclass
class HintBook:
    """Current type of every program the router told us about, and the last applied epoch."""

    epoch: int = -1
    types: dict[str, Hint] = field(default_factory=dict)

    def hint(self, program: str | None) -> Hint | None:
        """The program's current type, or None when the router never named it."""
        return None if program is None else self.types.get(program)

    def apply(self, batch: HintBatch, known: Iterable[str] = ()) -> Applied:
        """Apply a batch. `known`: programs the engine holds KV for (a full sync demotes the
        ones it omits to inactive). An older epoch is stale; the same epoch again is a no-op."""
        if batch.epoch < self.epoch:
            return Applied(stale=True, changed={})
        self.epoch = batch.epoch
        target = dict(batch.hints)
        if batch.full:
            for program in {*known, *self.types}:
                target.setdefault(program, Hint.INACTIVE)
        changed = {p: h for p, h in target.items() if self.types.get(p) is not h}
        self.types.update(changed)
        return Applied(stale=False, changed=changed)

    def request_type(self, program: str, hint: Hint, epoch: int) -> bool:
        """A type carried on a request (`kv_hints`): taken unless a batch with a higher epoch
        already came; True when it changed the program's type."""
        if epoch < self.epoch or self.types.get(program) is hint:
            return False
        self.types[program] = hint
        return True

    def forget_ended(self, holds: Callable[[str], bool]) -> list[str]:
        """Drop inactive programs that hold no KV any more (ended, evicted): the book then
        stays as large as what the engine holds, not as every program it was ever told of.
        A forgotten program that comes back counts as unhinted (busy) until the next hint.
        Returns the programs forgotten (their other per-program state goes with them)."""
        gone = [p for p, h in self.types.items() if h is Hint.INACTIVE and not holds(p)]
        for program in gone:
            del self.types[program]
        return gone
