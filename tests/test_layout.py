"""The code's layout is its architecture: layers import downwards only, and the docs name
only paths that exist.

Layers of the router, top to bottom (each `router/*/__init__.py` says the same in words):
entry points (`cli`, `serve`, `demo`) -> `owner` -> `plane` -> `engines`, `protocol` ->
`wire`; `config` reads `policy` and the hardware `presets`; the tools `sim` and `replay`
stand on `policy` (and `sim` on `presets`) and speak only what an engine or a client
speaks of the shell; the pure `policy` core and `presets` import nothing of the project.
Imports inside `if TYPE_CHECKING:` are annotations only and do not count. The README states
the same rules in a table, checked against `ALLOWED` here.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("router", "engine_patches", "kernels")

# group -> the groups its modules may import (a module may always import its own group).
ALLOWED: dict[str, set[str]] = {
    "router.policy": set(),
    "router.wire": set(),
    "router.protocol": {"router.wire", "router.policy"},
    "router.engines": {"router.wire", "router.policy", "router.config"},
    "router.plane": {"router.protocol", "router.engines", "router.wire", "router.config"},
    "router.owner": {
        "router.plane",
        "router.protocol",
        "router.engines",
        "router.wire",
        "router.config",
        "router.policy",
    },
    "router.presets": set(),
    "router.config": {"router.policy", "router.presets"},
    "router.replay": {"router.policy", "router.protocol"},
    "router.sim": {
        "router.policy",
        "router.presets",
        "router.replay",
        "router.protocol",
        "router.wire",
        "kernels",
    },
    "router.calibrate": {"router.sim", "router.presets", "router.protocol", "router.policy"},
    "engine_patches": {"router.policy", "kernels"},
    "kernels": set(),
}
ENTRY_POINTS = {"router", "router.cli", "router.serve", "router.demo"}  # may import anything
MAX_TOP_LEVEL_MODULES = 8


def _modules() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:` (annotation-only imports)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        yield child
        yield from _runtime_nodes(child)


def _imports(name: str, annotations: bool = False) -> set[str]:
    """The project modules `name` imports at run time (`from a import b` counts a.b if a
    module); with `annotations`, also those imported for type annotations only."""
    out = set()
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {m for m in out if m in MODULES}


GRAPH = {name: _imports(name) - {name} for name in MODULES}
# with the annotation-only imports: two modules that name each other's types are one concept
# split in two, or one hands the other more than it reads
TYPED_GRAPH = {name: _imports(name, annotations=True) - {name} for name in MODULES}


def group(name: str) -> str:
    """A module's group: `router.X` for a module in sub-package X, else the module itself."""
    parts = name.split(".")
    if parts[0] != "router":
        return parts[0]
    package = ".".join(parts[:2])
    if len(parts) > 1 and (REPO / "router" / parts[1] / "__init__.py").exists():
        return package
    return name


def test_at_most_eight_modules_directly_under_router() -> None:
    top = sorted(p.name for p in (REPO / "router").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_every_sub_package_says_what_lives_there_and_what_it_may_import() -> None:
    packages = [p for p in (REPO / "router").iterdir() if p.is_dir() and p.name != "__pycache__"]
    for package in packages + [REPO / root for root in ROOTS[1:] if (REPO / root).is_dir()]:
        init = package / "__init__.py"
        assert init.exists(), f"{package} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init} has no docstring"
        assert "may import" in doc.lower(), f"{init} does not say what it may import"


def test_no_import_cycles_not_even_through_annotations() -> None:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(TYPED_GRAPH[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(TYPED_GRAPH):
        if name not in state:
            visit(name, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", sorted(m for m in MODULES if group(m) not in ENTRY_POINTS))
def test_imports_go_down_the_layers(name: str) -> None:
    mine = group(name)
    assert mine in ALLOWED, f"{name}: group {mine} has no rule in ALLOWED"
    wrong = sorted(dep for dep in GRAPH[name] if group(dep) not in ALLOWED[mine] | {mine, "router"})
    assert not wrong, f"{name} ({mine}) imports {wrong}; may import {sorted(ALLOWED[mine])}"


PATH_IN_DOCS = re.compile(
    r"(?<![\w/.-])((?:router|engine_patches|kernels|bench|configs|traces|docker|scripts|docs|tests)"
    r"/[\w./*<>-]*[\w*>])"
)
# Files a reader creates, named by the docs as such (`cp docker/.env.example docker/.env`,
# an example error message), not files of the repository.
CREATED_BY_THE_READER = {"docker/.env", "traces/bad.jsonl"}


def _named_paths() -> Iterator[tuple[str, str]]:
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for match in PATH_IN_DOCS.finditer(doc.read_text()):
            yield doc.relative_to(REPO).as_posix(), match.group(1)


def _exists(path: str) -> bool:
    """A path; a glob pattern that matches at least one file; a placeholder (`<date>`,
    a file a command writes) whose folder exists."""
    if "<" in path:
        return (REPO / path).parent.is_dir()
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def test_every_path_the_docs_name_exists() -> None:
    missing = sorted(
        {
            f"{doc}: {path}"
            for doc, path in _named_paths()
            if path not in CREATED_BY_THE_READER and not _exists(path)
        }
    )
    assert not missing, "\n".join(missing)


def _readme_rules() -> dict[str, set[str]]:
    """The README's table of what each layer may import ("How it is built")."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("| layer | may import") :].split("\n\n")[0].splitlines()[2:]
    rules: dict[str, set[str]] = {}
    for row in table:
        layers, allowed = (cell.strip() for cell in row.strip("|").split("|"))
        names = re.findall(r"`([\w.]+)`", allowed)
        for layer in re.findall(r"`([\w.]+)`", layers.split("(")[0]):
            rules[layer] = set(names)
    return rules


def test_the_readme_states_the_import_rules_this_file_checks() -> None:
    def full(name: str) -> str:
        return name if name in ("kernels", "engine_patches") else f"router.{name}"

    stated = {
        full(layer): {full(name) for name in names}
        for layer, names in _readme_rules().items()
        if full(layer) not in ENTRY_POINTS
    }
    assert stated == ALLOWED
