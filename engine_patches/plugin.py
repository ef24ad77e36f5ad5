"""SGLang plugin entry point (`sglang.srt.plugins` group, name "mori").

SGLang's `load_plugins()` calls `register()` with no arguments in every process it starts
(HTTP/tokenizer, each scheduler, detokenizer), then applies the hooks registered meanwhile.
One module per supported SGLang line holds that line's tree names and hooks; the installed
version picks it here. SGLang logs and swallows a plugin's exception, so the loud checks live
in the launcher (`mori-sglang`); here an unsupported version only logs an error and installs
nothing (the hint routes then do not exist: a router sees "hints unsupported").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import pkgutil
from collections.abc import Iterable
from types import ModuleType

from engine_patches import forward_log

log = logging.getLogger("mori.engine")

# SGLang version -> the module that patches it (newest last).
MODULES = {
    "0.5.17": "engine_patches.sglang_0_5_17",
    "0.5.23": "engine_patches.sglang_0_5_23",
}
SUPPORTED = tuple(MODULES)
STRICT_ENV = "MORI_SGLANG_STRICT"  # set by mori-sglang: refuse to serve unpatched


def sglang_version() -> str:
    return importlib.metadata.version("sglang")


def module_for(version: str) -> ModuleType | None:
    """The patch module of a supported SGLang version, None for any other."""
    name = MODULES.get(version)
    return importlib.import_module(name) if name else None


def unresolved(targets: Iterable[str]) -> list[str]:
    """The dotted names (a version module's hook targets) this SGLang lacks."""
    missing = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    return missing


def register() -> None:
    version = sglang_version()
    module = module_for(version)
    if module is None:
        log.error(
            "MORI engine patch supports sglang %s, found %s: not installed",
            " and ".join(SUPPORTED),
            version,
        )
        return
    module.register()
    forward_log.register()
    log.info("MORI engine patch installed (sglang %s)", version)
