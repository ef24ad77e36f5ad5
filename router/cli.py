"""MORI routes LLM agent traffic to SGLang replicas and keeps each agent's KV cache where it
pays: on the GPU while the agent thinks, in host memory during its tool calls.

Start with `mori demo` (no GPU needed): two emulated replicas, the router and a replayed agent
workload, MORI against two baselines, in under three minutes.

Only the chosen subcommand's module is imported, so `mori sim` never loads the web stack and
`mori serve` never loads matplotlib.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from importlib import import_module

# name -> (module, one-line help). Each module defines configure(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("router.demo", "run the embedded demo: router + emulated replicas + a replayed trace"),
    "sim": ("router.sim.cli", "simulate policies on a trace (virtual clock, replica cost model)"),
    "serve": ("router.serve", "run the program-aware router in front of SGLang replicas"),
    "emulate": ("router.sim.emulator", "run an emulated SGLang replica (HTTP, simulated timing)"),
    "calibrate": ("router.calibrate.cli", "fit the replica cost model to a live replica's timings"),
    "replay": (
        "router.replay.cli",
        "replay a trace against an OpenAI or Anthropic endpoint (closed loop)",
    ),
    "trace": ("router.replay.trace_cli", "generate, validate or summarise agent traces"),
}
EPILOG = "`mori COMMAND --help` lists its flags. Documentation: README.md and docs/."


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless it has none worth showing (None,
    False, empty) or the help text already says it (a default that depends on other flags)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default == []
        if "default" in text or nothing or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action) or text


def _describe(text: str) -> str:
    """Paragraphs of a docstring, each filled to 79 columns."""
    return "\n\n".join(textwrap.fill(" ".join(p.split()), 79) for p in text.split("\n\n"))


def _with_formatter(parser: argparse.ArgumentParser) -> None:
    """Nested subcommands (`mori trace generate`) show their defaults too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.formatter_class = HelpFormatter
                _with_formatter(child)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mori",
        description=_describe("\n\n".join(__doc__.split("\n\n")[:2])),
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == command:
            import_module(module).configure(p)
            _with_formatter(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    return int(import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
