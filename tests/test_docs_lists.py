"""The README's and docs' lists of policies, presets and commands name exactly what the code
registers (`router.policy.REGISTRY`, `router.presets.PRESETS`, `router.cli.COMMANDS` and
the console scripts): a name added to the code, or dropped from a page, fails here until the
page follows, so the lists cannot go stale again."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from router.cli import COMMANDS
from router.policy import REGISTRY
from router.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"`([\w.+-]+)`")  # a backticked word: a policy, a preset (paths, phrases: no)
CELLS = re.compile(r"(?<!\\)\|")  # a table row's cell borders (`lru\|typed` is one cell)


def _scripts() -> set[str]:
    """`mori COMMAND` for each subcommand, and the project's other console scripts."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    others = set(pyproject["project"]["scripts"]) - {"mori"}
    return {f"mori {name}" for name in COMMANDS} | others


EXPECTED = {"policies": set(REGISTRY), "presets": set(PRESETS), "commands": _scripts()}

# (page, what it lists, where): "line" lists are the backticked names after the text that
# starts the one line holding them (a table row's earlier cells, or a sentence's start);
# "table" lists are the first cells of the table under the header that starts with it.
LISTS = [
    ("README.md", "commands", "table", "| command | what it does | docs |"),
    ("README.md", "policies", "line", "| `router/policy/` |"),
    ("docs/policy.md", "policies", "table", "| name | class |"),
    ("docs/router.md", "policies", "line", "| `policy` | `mori` |"),
    ("docs/replay.md", "policies", "line", "| `--policies A,B` (`--policy A`) | `mori,ta+o,smg` |"),
    ("docs/simulator.md", "policies", "line", "| `--policies` | `mori,ta+o,ta,smg` |"),
    ("docs/deployment.md", "policies", "line", "| `MORI_POLICY` | `mori` |"),
    ("docs/emulator.md", "presets", "line", "| `--preset NAME` | `h100-8b` |"),
    ("docs/deployment.md", "presets", "line", "Other emulated hardware: `EMU_PRESET` ="),
]


def _after(text: str, start: str) -> str:
    """The rest of the one line that holds `start`, from there on."""
    lines = [line for line in text.splitlines() if start in line]
    assert len(lines) == 1, f"{len(lines)} lines hold {start!r}"
    return lines[0].split(start, 1)[1]


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header line starts with `header`."""
    lines = text.splitlines()
    (first,) = [i for i, line in enumerate(lines) if line.startswith(header)]
    rows = []
    for line in lines[first + 2 :]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in CELLS.split(line)[1:-1]])
    return rows


def listed(text: str, how: str, where: str) -> set[str]:
    """The names a page lists (a table's first cells, or a line's backticked names)."""
    if how == "table":
        cells = [row[0] for row in _table(text, where)]
        return {m.group(1) for cell in cells if (m := re.match(r"`([^`]+)`", cell))}
    return set(NAME.findall(_after(text, where)))


def _case_id(case: tuple[str, str, str, str]) -> str:
    return f"{case[0]}:{case[1]}"


@pytest.mark.parametrize("case", LISTS, ids=map(_case_id, LISTS))
def test_each_list_names_exactly_what_the_code_registers(case):
    page, what, how, where = case
    names = listed((REPO / page).read_text(), how, where)
    expected = EXPECTED[what]
    assert names == expected, (
        f"{page} lists {what}: missing {sorted(expected - names)}, "
        f"not registered {sorted(names - expected)}"
    )


@pytest.mark.parametrize("case", LISTS, ids=map(_case_id, LISTS))
def test_a_name_dropped_from_a_list_is_caught(case):
    """The check can fail: take one registered name out of the page's list (a table's row
    keeps its place with an empty first cell) and it is missing from what the page lists."""
    page, what, how, where = case
    text = (REPO / page).read_text()
    victim = max(n for n in EXPECTED[what] if f"`{n}`" not in where)
    dropped = text.replace(f"`{victim}`", "``")
    assert victim in listed(text, how, where)
    assert victim not in listed(dropped, how, where)


def test_the_policy_table_names_each_policys_class():
    """docs/policy.md's class column is the registry's target of each name."""
    rows = _table((REPO / "docs/policy.md").read_text(), "| name | class |")
    classes = {re.match(r"`([^`]+)`", name)[1]: cls.strip("`") for name, cls, *_ in rows}
    assert classes == {name: target.replace(":", ".") for name, target in REGISTRY.items()}
