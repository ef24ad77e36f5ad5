"""`mori-sglang` / `python -m engine_patches.launch`: start SGLang with the MORI engine patch.

Checks the SGLang version and that every hook target exists (exit 2 with a clear message if
not), turns on what MORI needs (HiCache with write_through, the "mori" eviction policy, cache
reports, the plugin), and passes every other flag through to `sglang.launch_server` unchanged:

    mori-sglang --model-path Qwen/Qwen3-8B --hicache-ratio 2 --port 30000

A configuration the patch cannot hint (a model or flags that take another cache) stops the
server at start with one line naming the reason (engine_patches/sglang_common.STRICT_ENV).
"""

from __future__ import annotations

import importlib.metadata
import os
import runpy
import sys
from collections.abc import Sequence

from engine_patches.plugin import STRICT_ENV, SUPPORTED, module_for, sglang_version, unresolved

# flag -> value MORI needs (None: a switch). A conflicting user value is an error.
REQUIRED = {
    "--enable-hierarchical-cache": None,
    "--enable-cache-report": None,  # cached_tokens in usage: the router counts hits from it
    "--hicache-write-policy": "write_through",
    "--radix-eviction-policy": "mori",
}
FORBIDDEN = ("--enable-session-radix-cache",)
HELP = ("-h", "--help")


def usage() -> str:
    """What mori-sglang adds to SGLang's server; printed with or without SGLang installed."""
    added = "".join(
        f"\n  {flag}" if value is None else f"\n  {flag} {value}"
        for flag, value in REQUIRED.items()
    )
    return (
        "usage: mori-sglang [SGLANG SERVER FLAGS...]\n\n"
        "Start SGLang's server (sglang.launch_server) with the MORI engine patch: typed\n"
        "eviction and offload hints from the MORI router (docs/engine-patch.md). Every flag is\n"
        f"SGLang's own and passed through unchanged; mori-sglang adds:{added}\n"
        f"and refuses {', '.join(FORBIDDEN)}. Supported SGLang: {' and '.join(SUPPORTED)}\n"
        "(pip install -e '.[sglang]').\n\n"
        "  mori-sglang --model-path Qwen/Qwen3-8B --hicache-ratio 2 --port 30000"
    )


def print_help() -> int:
    """Our usage, then SGLang's own flags where a supported SGLang is installed."""
    print(usage())
    try:
        check_sglang()
    except LaunchError as exc:
        print(f"\nSGLang's own flags are listed here once it is installed ({exc})")
        return 0
    print("\nSGLang's server flags:\n", flush=True)
    sys.argv = ["sglang.launch_server", "--help"]
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # argparse's --help exits 0 after printing
        return int(done.code or 0)
    return 0


class LaunchError(RuntimeError):
    """Why the patched server cannot start; printed without a traceback."""


def check_sglang() -> None:
    try:
        version = sglang_version()
    except importlib.metadata.PackageNotFoundError:
        raise LaunchError(
            f"sglang is not installed here: pip install sglang=={SUPPORTED[-1]}; on a CPU "
            "machine, from this checkout: scripts/install_sglang_cpu.sh && "
            "SGLANG_USE_CPU_ENGINE=1 $(scripts/install_sglang_cpu.sh --print-venv)/bin/python "
            "-m engine_patches.launch --device cpu ARGS"
        ) from None
    module = module_for(version)
    if module is None:
        raise LaunchError(
            f"MORI's engine patch supports sglang {' and '.join(SUPPORTED)}, found {version}"
        )
    missing = unresolved(module.HOOK_TARGETS)
    if missing:
        raise LaunchError("sglang lacks hook targets the patch needs: " + ", ".join(missing))
    names = [e.name for e in importlib.metadata.entry_points(group="sglang.srt.plugins")]
    if "mori" not in names:
        raise LaunchError(
            "the 'mori' sglang plugin entry point is not installed (pip install -e .)"
        )


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def build_argv(user: Sequence[str]) -> list[str]:
    """User flags plus MORI's required ones; a user flag that contradicts MORI is an error."""
    argv = list(user)
    for flag in FORBIDDEN:
        if flag in argv:
            raise LaunchError(f"{flag} conflicts with MORI's typed eviction (leave it off)")
    for flag, value in REQUIRED.items():
        present = flag in argv or any(a.startswith(flag + "=") for a in argv)
        if not present:
            argv += [flag] if value is None else [flag, value]
        elif value is not None and _flag_value(argv, flag) != value:
            raise LaunchError(f"MORI needs {flag} {value}, got {_flag_value(argv, flag)!r}")
    return argv


def plugin_env(env: dict[str, str]) -> dict[str, str]:
    """Make sure SGLANG_PLUGINS, when set as a whitelist, includes MORI."""
    allowed = [p for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and "mori" not in allowed:
        return {"SGLANG_PLUGINS": ",".join([*allowed, "mori"])}
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    user = list(sys.argv[1:] if argv is None else argv)
    if any(flag in HELP for flag in user):
        return print_help()
    try:
        check_sglang()
        full = build_argv(user)
    except LaunchError as exc:
        print(f"mori-sglang: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(plugin_env(dict(os.environ)))
    os.environ.update(module_for(sglang_version()).LAUNCH_ENV)
    os.environ[STRICT_ENV] = "1"  # inherited by the scheduler processes
    sys.argv = ["sglang.launch_server", *full]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
