"""SGLang plugin entry point (`sglang.srt.plugins` group, name "mori").

SGLang 0.5.17's `load_plugins()` calls `register()` with no arguments in every process it starts
(HTTP/tokenizer, each scheduler, detokenizer), then applies the hooks registered meanwhile.
It logs and swallows a plugin's exception, so the loud checks live in the launcher
(`mori-sglang`); here a version mismatch only logs an error and installs nothing.
"""

from __future__ import annotations

import importlib.metadata
import logging

log = logging.getLogger("mori.engine")

SUPPORTED = "0.5.17"


def register() -> None:
    version = importlib.metadata.version("sglang")
    if version != SUPPORTED:
        log.error(
            "MORI engine patch supports sglang==%s, found %s: not installed", SUPPORTED, version
        )
        return
    from engine_patches import sglang_0_5_17

    sglang_0_5_17.register()
    log.info("MORI engine patch installed (sglang %s)", version)
