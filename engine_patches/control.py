"""Control messages (hints, residency) applied the same way on every tensor-parallel rank.

SGLang broadcasts a control message to every TP rank, and each applies it at the same point
of its loop: their radix trees stay identical because they make the same decisions. A hint
batch changes the tree (offload, load back) and runs collectives (the cache's write check),
so one rank failing half-way would leave the trees different and a later collective would
hang. Hence:

- everything that can reject a batch (validation) runs before any change, on the same bytes
  on every rank, so all ranks reject it alike;
- after applying, the ranks agree on the outcome (an all-reduce of "ok"): when any rank
  failed, every rank reports the failure, and the engine refuses further hint batches with
  503 (its trees may differ now: restart the replica); residency stays readable.

Pure: the all-reduce is injected, so this is tested without SGLang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_patches.hint_book import HintError

log = logging.getLogger("mori.engine")

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]


def _single_rank(ok: bool) -> bool:
    return ok


@dataclass
class ControlPath:
    """Runs a handler for each control message and keeps the ranks in agreement."""

    agree: Callable[[bool], bool] = _single_rank  # every rank's ok, reduced with AND
    diverged: str | None = None  # why hint batches are refused (a rank failed one)

    def run(self, op: str, body: dict[str, Any], handler: Handler) -> dict[str, Any]:
        """The answer to one control message; the same decision on every rank."""
        if op == "hints" and self.diverged is not None:
            return {"error": self.diverged, "status": 503}
        try:
            answer, ok = handler(op, body), True
        except HintError as exc:  # validation: no change was made, on any rank
            answer, ok = {"error": str(exc), "status": 400}, True
        except Exception as exc:  # answered as JSON, never a dead scheduler
            log.exception("MORI control message %r failed on this rank", op)
            answer, ok = {"error": f"{type(exc).__name__}: {exc}", "status": 500}, False
        if self.agree(ok) or op != "hints":
            return answer
        self.diverged = (
            "a hint batch failed on a tensor-parallel rank; the ranks' caches may differ, "
            "so this replica takes no more hints: restart it"
        )
        log.error("MORI: %s", self.diverged)
        return {"error": self.diverged if ok else answer["error"], "status": 500}
