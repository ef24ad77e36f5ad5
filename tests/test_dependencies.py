"""Every third-party module the package imports is declared in pyproject.toml: the router's in
its dependencies, the engine patch's and the kernels' there or in an extra (they run inside
SGLang's environment, or with the `kernels` extra).
A fresh `pip install .` then never meets an ImportError that a dev machine hid."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"router", "engine_patches", "kernels"}
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())[0]
    return re.sub(r"[-_.]+", "-", name).lower()


CORE = {_name(r) for r in PROJECT["dependencies"]}
EXTRAS = {_name(r) for reqs in PROJECT["optional-dependencies"].values() for r in reqs}
DISTRIBUTIONS = importlib.metadata.packages_distributions()


def imports(root: str) -> dict[str, str]:
    """Top-level modules imported under `root` (absolute imports), each with one file that
    imports it."""
    found: dict[str, str] = {}
    for path in sorted((REPO / root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return found


def third_party(root: str) -> dict[str, str]:
    return {
        module: where
        for module, where in imports(root).items()
        if module not in sys.stdlib_module_names and module not in FIRST_PARTY
    }


def distributions(module: str) -> set[str]:
    """The distributions that provide `module` here; one of its own name when none is
    installed (the engine's modules live in SGLang's environment)."""
    return {_name(d) for d in DISTRIBUTIONS.get(module, [module])}


@pytest.mark.parametrize(
    ("root", "declared"),
    [("router", CORE), ("engine_patches", CORE | EXTRAS), ("kernels", CORE | EXTRAS)],
)
def test_every_third_party_import_is_declared(root: str, declared: set[str]) -> None:
    modules = third_party(root)
    assert modules, f"found no imports under {root}/"
    missing = {m: where for m, where in modules.items() if not distributions(m) & declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_scan_sees_what_the_router_imports() -> None:
    """The check can fail: numpy, yaml (PyYAML) and starlette are imported by the router."""
    modules = third_party("router")
    assert {"numpy", "yaml", "starlette", "httptools"} <= modules.keys()
    assert "pyyaml" in distributions("yaml")
