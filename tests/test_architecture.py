"""The package layering of docs/architecture.md, enforced: every import runs downward, no cycles.

Every ``import`` statement of every module under ``scalefold/`` is read from the source (lazy imports
inside functions included, ``if TYPE_CHECKING`` blocks too): a module may import modules of its own
top-level package or of a package on a *lower* layer, never one on its own layer or above; and no
two modules import each other, directly or around a loop. The layers are :data:`LAYERS` below, the
same table as the architecture page (a test checks that they agree).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "scalefold"
ARCHITECTURE_PAGE = REPO_ROOT / "docs" / "architecture.md"

#: Ground floor first. A module belongs to the longest prefix listed; a module may import its own
#: unit (the prefix it belongs to) and any unit on a lower layer. Units on one layer are independent.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("scalefold.errors",),
    ("scalefold.residue_constants", "scalefold.config", "scalefold.tested_versions", "scalefold.diskspace",
     "scalefold.__init__"),
    ("scalefold.distributed", "scalefold.kernels"),
    ("scalefold.model", "scalefold.lddt"),
    ("scalefold.losses", "scalefold.data"),
    ("scalefold.checkpoint", "scalefold.optim"),
    ("scalefold.mlperf",),
    ("scalefold.evaluation", "scalefold.compilation"),
    ("scalefold.train",),
    ("scalefold.inference", "scalefold.perf", "scalefold.kerneltools", "scalefold.reference_config",
     "scalefold.submission"),
    ("scalefold.commands", "scalefold.cli"),
    ("scalefold.__main__",),
)


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1] if len(parts) > 2 else parts[:-1] + ["__init__"]
    return ".".join(parts)


def imported_modules(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported scalefold module, line) for every import in ``path``; ``from pkg import name`` counts
    ``pkg.name`` when that is a module, else ``pkg``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
    return [(name, line) for name, line in found if name == "scalefold" or name.startswith("scalefold.")]


def unit_of(module: str) -> tuple[int, str]:
    """(layer index, unit) of a module: the longest listed prefix it falls under."""
    best: tuple[int, str] | None = None
    for index, units in enumerate(LAYERS):
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                if best is None or len(unit) > len(best[1]):
                    best = (index, unit)
    if module == "scalefold":
        return 1, "scalefold.__init__"
    if best is None:
        raise LookupError(f"module {module} is on no layer of tests/test_architecture.py LAYERS")
    return best


def import_graph(root: Path = PACKAGE) -> dict[str, list[tuple[str, int]]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files) | {m.rsplit(".", 1)[0] for m in files if m.endswith(".__init__")}
    graph = {}
    for module, path in files.items():
        own = module.rsplit(".", 1)[0] if module.endswith(".__init__") and module != "scalefold.__init__" else module
        graph[own] = [(t if t in files or t == "scalefold" else t, line) for t, line in imported_modules(path, own, known)]
    return graph


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    problems = []
    for module, targets in graph.items():
        layer, unit = unit_of(module)
        for target, line in targets:
            t_layer, t_unit = unit_of(target)
            if t_unit == unit:
                continue
            if t_layer >= layer:
                kind = "upward" if t_layer > layer else "sideways (same layer)"
                problems.append(f"{module}:{line} imports {target}: {kind}, layer {layer} ({unit}) -> {t_layer} ({t_unit})")
    return problems


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    edges = {m: sorted({t for t, _ in targets if t in graph and t != m}) for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_import_runs_downward():
    problems = upward_imports(import_graph())
    assert not problems, "imports against docs/architecture.md's layering:\n" + "\n".join(problems)


def test_no_two_modules_import_each_other():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_catches_a_planted_upward_import_and_cycle(tmp_path):
    """The rules above can fail: a copy of two modules with a planted upward import and a loop."""
    pkg = tmp_path / "scalefold"
    (pkg / "model").mkdir(parents=True)
    (pkg / "train").mkdir()
    for d in (pkg, pkg / "model", pkg / "train"):
        (d / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text("def f():\n    from scalefold.train import b  # lazy, still upward\n")
    (pkg / "train" / "b.py").write_text("from scalefold.model import a\n")
    graph = import_graph(pkg)
    assert upward_imports(graph) == [
        "scalefold.model.a:2 imports scalefold.train.b: upward, layer 3 (scalefold.model) -> 8 (scalefold.train)"
    ]
    assert cycles(graph) == [["scalefold.model.a", "scalefold.train.b"]]


def test_every_module_is_on_a_layer():
    for module in import_graph():
        unit_of(module)


def test_the_architecture_page_lists_the_same_layers():
    """docs/architecture.md's table names every unit of :data:`LAYERS` on the same floor."""
    if not ARCHITECTURE_PAGE.exists():
        pytest.fail(f"{ARCHITECTURE_PAGE} is missing")
    rows = re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", ARCHITECTURE_PAGE.read_text(encoding="utf-8"), re.MULTILINE)
    page = {int(floor): set(re.findall(r"`(scalefold[\w.]*)`", names)) for floor, names in rows}
    table = {i: set(units) - {"scalefold.__init__"} for i, units in enumerate(LAYERS)}
    assert page == table


def _dotted_strings(root: Path) -> list[tuple[str, str]]:
    """(where, text) of every string literal under ``root`` that is a dotted ``scalefold.`` path."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if re.fullmatch(r"scalefold(\.\w+)+", text):
                    found.append((f"{path.relative_to(REPO_ROOT)}:{node.lineno}", text))
    return found


def test_module_paths_written_as_strings_import():
    """Module paths in strings (the subcommand table of ``cli.py``,
    ``monkeypatch`` targets and ``python -m`` modules in the tests) follow the moves: each names a
    module, or an attribute of one, that exists."""
    import importlib
    import importlib.util

    strings = _dotted_strings(PACKAGE) + [s for s in _dotted_strings(REPO_ROOT / "tests") if "test_architecture" not in s[0]]
    assert len(strings) > 10  # the tables above are found
    missing = []
    for where, text in strings:
        try:
            if importlib.util.find_spec(text) is not None:  # a module (found, not run: e.g. scalefold.__main__)
                continue
        except ModuleNotFoundError:  # a parent is not a package: text is module.attr
            pass
        module, _, attr = text.rpartition(".")
        try:
            if not hasattr(importlib.import_module(module), attr):
                missing.append(f"{where}: {text}")
        except ModuleNotFoundError:
            missing.append(f"{where}: {text}")
    assert not missing, "strings naming modules or attributes that do not exist:\n" + "\n".join(missing)


# -- rooms: whole folders on one floor, argument parsing only at the edge ----------------------------------


def special_cases(layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Units listed inside another listed unit (``scalefold.kernels.aot`` under ``scalefold.kernels``): a file
    on another floor than its folder. There are none: every folder stands on one floor."""
    units = [u for floor in layers for u in floor]
    return sorted(u for u in units if any(u.startswith(v + ".") for v in units if v != "scalefold.__init__"))


def folder_of(module: str) -> str:
    """The top-level unit (``scalefold.kernels``) of a module (``scalefold.kernels.aot``)."""
    return ".".join(module.split(".")[:2]) if module.startswith("scalefold.") else module


def upward_folder_imports(graph: dict[str, list[tuple[str, int]]], unit=unit_of) -> list[str]:
    """Imports between top-level folders that do not run down the folders' floors (each folder on the floor
    ``unit`` gives the folder itself): what the folder as a whole depends on, special cases or not."""
    found = []
    for module, targets in graph.items():
        src = folder_of(module)
        for target, line in targets:
            dst = folder_of(target)
            if dst != src and unit(dst)[0] >= unit(src)[0]:
                found.append(f"{module}:{line} imports {target}: folder {src} -> {dst}")
    return found


def argparse_outside_commands(root: Path = PACKAGE) -> list[str]:
    """Modules outside ``commands/`` and ``cli.py`` that import ``argparse``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("commands/") or rel == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) else [])  # fmt: skip
            if "argparse" in names:
                found.append(f"scalefold/{rel}:{node.lineno}")
    return found


def test_every_folder_stands_on_one_floor():
    """No unit is a file inside another unit's folder, and no folder imports a folder at or above its floor."""
    assert special_cases() == []
    assert upward_folder_imports(import_graph()) == []


def test_argument_parsing_only_in_commands_and_cli():
    assert argparse_outside_commands() == []


def test_the_room_checks_catch_a_tool_inside_the_kernels(tmp_path):
    """A planted fault: a kernel tool inside ``scalefold/kernels/`` that builds the model, listed as a unit of
    its own above the model, and parsing its own arguments. Each check names it."""
    pkg = tmp_path / "scalefold"
    for d in ("kernels", "model"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text("from scalefold.kernels import attention_op\n")
    (pkg / "kernels" / "attention_op.py").write_text("")
    (pkg / "kernels" / "tool.py").write_text("import argparse\n\nfrom scalefold.model import a\n")
    graph = import_graph(pkg)
    planted = (*LAYERS[:9], (*LAYERS[9], "scalefold.kernels.tool"), *LAYERS[10:])

    def unit(module):  # the layering of the planted LAYERS
        return max(((i, u) for i, us in enumerate(planted) for u in us if module == u or module.startswith(u + ".")),
                   key=lambda x: len(x[1]))  # fmt: skip

    assert special_cases(planted) == ["scalefold.kernels.tool"]
    assert upward_folder_imports(graph, unit) == [
        "scalefold.kernels.tool:3 imports scalefold.model.a: folder scalefold.kernels -> scalefold.model"
    ]
    assert upward_imports(graph) == [  # and with the real LAYERS, no special case: the file's own import
        "scalefold.kernels.tool:3 imports scalefold.model.a: upward, layer 2 (scalefold.kernels) -> 3 (scalefold.model)"
    ]
    assert argparse_outside_commands(pkg) == ["scalefold/kernels/tool.py:1"]
