"""`mori serve`: the program-aware router in front of SGLang replicas.

Settings come from defaults < `--config FILE` < MORI_<FIELD> env vars < flags, so
`mori serve --replicas http://127.0.0.1:30001,http://127.0.0.1:30002` needs no file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from router.config import ConfigError, load_config, parse_settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML settings (see configs/router.yaml)")
    parser.add_argument("--replicas", metavar="URL[,URL...]", help="engine replica base URLs")
    parser.add_argument("--host", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument("--policy", help="placement policy (default mori; see docs/policy.md)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any setting of the config file, e.g. --set aging_s=60 (repeatable; wins over all)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        help="divide the router's timers (tick, hint sync, lease, gate timeout) by this: "
        "match `mori replay --time-scale` and the engines' speed-up (default 1)",
    )


def run(args: argparse.Namespace) -> int:
    overrides = {
        "replicas": args.replicas,
        "host": args.host,
        "port": args.port,
        "policy": args.policy,
        "log_level": args.log_level,
        "time_scale": args.time_scale,
    }
    try:
        overrides.update(parse_settings(args.settings))
        config = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"mori serve: {e}", file=sys.stderr)
        return 2
    from router.owner.process import serve
    from router.policy import policy_names

    if config.policy not in policy_names():
        print(
            f"mori serve: unknown policy {config.policy!r}; known: {', '.join(policy_names())}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: one line per hint push and health check would
    # drown the router's own log; the router logs the failures that matter itself.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
    return 0
