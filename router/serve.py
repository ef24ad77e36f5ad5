"""`mori serve`: the program-aware router in front of SGLang replicas.

Settings come from defaults < `--config FILE` < MORI_<FIELD> env vars < flags, so
`mori serve --replicas http://127.0.0.1:30001,http://127.0.0.1:30002` needs no file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from router.config import ConfigError, RouterConfig, load_config, parse_settings


def configure(parser: argparse.ArgumentParser) -> None:
    # The flags' own defaults are None (a flag left out leaves the file and the environment
    # alone); the help shows the setting's default.
    default = RouterConfig.model_fields
    parser.epilog = "Settings: defaults < --config FILE < MORI_<FIELD> env vars < flags."
    parser.add_argument(
        "--config", metavar="FILE", help="YAML settings, e.g. configs/router.yaml (default: none)"
    )
    parser.add_argument(
        "--replicas",
        metavar="URL[,URL...]",
        help="engine replica base URLs (default: none; give them here, in the file or in "
        "MORI_REPLICAS)",
    )
    parser.add_argument(
        "--host",
        help="listen address; 0.0.0.0: every interface, so set api_keys and admin_key first "
        "(with neither set, every endpoint, /v1/programs included, answers without a key) "
        f"(default: {default['host'].default})",
    )
    parser.add_argument(
        "--port", type=int, help=f"listen port (default: {default['port'].default})"
    )
    parser.add_argument(
        "--policy",
        help=f"placement policy, see docs/policy.md (default: {default['policy'].default})",
    )
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help=f"(default: {default['log_level'].default})",
    )
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
        f"match `mori replay --time-scale` and the engines' speed-up "
        f"(default: {default['time_scale'].default:g})",
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
