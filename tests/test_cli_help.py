"""What `--help` tells a newcomer: every screen opens, says what the command is for, and
shows every option's default; `mori-sglang --help` works before SGLang is installed."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from router.cli import COMMANDS, build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _screens() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every `mori` help screen: each command's, and its actions' (`mori trace generate`)."""
    out = []
    for name in COMMANDS:
        parser = _subcommands(build_parser(name))[name]
        out.append((name, parser))
        out += [(f"{name} {sub}", p) for sub, p in _subcommands(parser).items()]
    return out


def test_mori_help_opens_with_what_mori_is_for(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.startswith("MORI routes LLM agent traffic to SGLang replicas")
    assert "mori demo" in text and "subcommand" not in text and "module" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("screen", [name for name, _ in _screens()])
def test_every_help_screen_opens(screen, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser(screen.split()[0]).parse_args([*screen.split(), "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: mori {screen}")


@pytest.mark.parametrize("screen", [name for name, _ in _screens()])
def test_every_option_shows_its_default(screen):
    """An option that takes a value says what it is when left out (`--set`-like repeatable
    options start empty and say nothing)."""
    parser = dict(_screens())[screen]
    formatter = parser._get_formatter()
    for action in parser._actions:
        takes_value = action.option_strings and action.nargs != 0
        if not takes_value or action.required or isinstance(action, argparse._AppendAction):
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert "default" in text, f"mori {screen} {action.option_strings[0]}: {text!r}"


def test_defaults_shown_are_the_real_ones(capsys):
    """Spot checks of what the issue found hidden: demo's run, emulate's address, serve's."""
    for command, shown in (
        ("demo", ["(default: 45.0)", "(default: 24)", "(default: mori,ta+o,smg)"]),
        ("emulate", ["(default: 127.0.0.1)", "(default: 30000)"]),
        ("serve", ["(default: 127.0.0.1)", "(default: 8000)", "(default: mori)"]),
    ):
        with pytest.raises(SystemExit):
            build_parser(command).parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
        assert all(s in text for s in shown), (command, text)


def test_mori_sglang_help_works_without_sglang():
    """The router's environment has no SGLang: help still shows the launcher's usage."""
    done = subprocess.run(
        [sys.executable, "-m", "engine_patches.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: mori-sglang")
    assert "--radix-eviction-policy mori" in done.stdout and "error" not in done.stderr
