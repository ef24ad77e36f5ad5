"""Per-forward timings of a live engine (`MORI_FORWARD_LOG=PATH`): what the cost model is
judged against inside a closed loop.

`mori calibrate` times requests from outside, one probe at a time; a closed-loop run (agents
returning while others decode) parts from its fit, and only the engine knows whether its
forwards got slower, whether it spent the time between them (scheduling, streaming results)
or whether it ran more of them. With the variable set, every scheduler process appends one
JSON line per `Scheduler.run_batch` to `PATH.<pid>`:

    {"t0": start, "t1": end, "mode": "EXTEND" | "DECODE" | ..., "reqs": sequences,
     "new": tokens computed, "prefix": cached tokens they attend to, "seq": all tokens,
     "lens": an extend's [new, cached] per sequence}

(`time.monotonic` seconds; a gap between one line's `t1` and the next `t0` is the
scheduler's own time or idleness). `bench/forward_log.py` reads it beside a preset.
Off (the variable unset) nothing is hooked.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

ENV = "MORI_FORWARD_LOG"
TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"


def record(batch: Any, t0: float, t1: float) -> dict[str, Any]:
    """One forward's line: its mode, sequences, new and cached tokens, and when it ran."""
    mode = batch.forward_mode
    extend = bool(mode is not None and mode.is_extend())
    return {
        "t0": round(t0, 6),
        "t1": round(t1, 6),
        "mode": getattr(mode, "name", str(mode)),
        "reqs": len(batch.reqs),
        "new": int(batch.extend_num_tokens or 0) if extend else len(batch.reqs),
        "prefix": int(sum(batch.prefix_lens or ())) if extend else 0,
        "seq": int(batch.seq_lens_sum or 0),
        # an extend's sequences, [new, cached] each: the model prices them one by one
        "lens": [list(p) for p in zip(batch.extend_lens, batch.prefix_lens, strict=True)]
        if extend
        else [],
    }


class ForwardLog:
    """The open file of this process (opened at the first forward: only schedulers run one)."""

    def __init__(self, path: str) -> None:
        self.path = f"{path}.{os.getpid()}"
        self.out: IO[str] | None = None

    def write(self, line: dict[str, Any]) -> None:
        if self.out is None:
            self.out = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives with the process
        self.out.write(json.dumps(line) + "\n")

    def around(self, original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        result = original(scheduler, batch, *args, **kwargs)
        self.write(record(batch, t0, time.monotonic()))
        return result


def register() -> None:
    """Hook `run_batch` when `MORI_FORWARD_LOG` is set (every process; only schedulers call it)."""
    path = os.environ.get(ENV)
    if not path:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, ForwardLog(path).around, HookType.AROUND)
