"""Docstrings and comments name only modules that exist.

Every dotted ``scalefold.`` path written in a docstring or a comment of ``scalefold/`` (``:mod:`` /
``:func:`` roles, double-backticked or bare), every relative name of a Sphinx role (``:mod:`.steps```,
``:class:`~.run_data.TrainingData```: a module of the package the file is in, or a name of the file
itself) and every ``scalefold/....py`` file path resolves: to a module, or to a name a module defines
(``module.function``, ``module.Class.method``). Read from the source, nothing imported, so a rename that
leaves a stale pointer behind fails here. The checker is shown to fail on a planted fault.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "scalefold"

_ABSOLUTE = re.compile(r"(?<![\w./-])scalefold(?:\.[A-Za-z_]\w*)+")
_RELATIVE = re.compile(r":(?:mod|func|class|meth|data|attr|exc|obj):`~?(\.[A-Za-z_][\w.]*)`")
_FILE_PATH = re.compile(r"(?<![\w./-])(scalefold/[\w/]+\.py)\b")


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of ``path``."""
    source = path.read_text(encoding="utf-8")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    found.append((body[0].lineno, body[0].value.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


class _Package:
    """The modules under a package root and the names each defines, read from the source."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, Path] = {}
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.files[".".join(parts)] = path
        self._names: dict[str, dict[str, ast.AST | None]] = {}

    def names(self, module: str) -> dict[str, ast.AST | None]:
        """Top-level names of ``module``: its defs, classes, assignments and imports (submodules too)."""
        if module not in self._names:
            tree = ast.parse(self.files[module].read_text(encoding="utf-8"))
            names: dict[str, ast.AST | None] = {}
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.setdefault(node.name, node)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        for name in ast.walk(target):
                            if isinstance(name, ast.Name):
                                names.setdefault(name.id, None)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    for alias in node.names:
                        names.setdefault((alias.asname or alias.name).split(".")[0], None)
            names.update({m.rsplit(".", 1)[1]: None for m in self.files if m.rsplit(".", 1)[0] == module})
            if "__getattr__" in names:  # lazy exports: the string keys of the module's export table
                for node in tree.body:
                    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                        names.update({k.value: None for k in node.value.keys
                                      if isinstance(k, ast.Constant) and isinstance(k.value, str)})  # fmt: skip
            self._names[module] = names
        return self._names[module]

    def resolves(self, dotted: str) -> bool:
        """A module, or a module's name (and, for a class, one of its members)."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in self.files:
                rest = parts[cut:]
                if not rest:
                    return True
                node = self.names(module).get(rest[0], False)
                if node is False:
                    return False
                if len(rest) > 1 and isinstance(node, ast.ClassDef):  # Class.member: in its body
                    members = {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                    members |= {t.id for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                                for t in ast.walk(n) if isinstance(t, ast.Name)}  # fmt: skip
                    return rest[1] in members
                return True  # deeper attributes (of an instance, a function) are not checked
        return False


def stale_names(root: Path = PACKAGE) -> list[str]:
    """``file:line: name`` of every module path, relative name or file path in a docstring or comment under
    ``root`` that does not resolve."""
    package = _Package(root)
    problems = []
    for module, path in sorted(package.files.items()):
        where = path.relative_to(root.parent)
        own_package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for line, text in _texts(path):
            for name in _ABSOLUTE.findall(text):
                name = name.rstrip(".")
                if not package.resolves(name):
                    problems.append(f"{where}:{line}: {name}")
            for name in _RELATIVE.findall(text):
                name = name.rstrip(".")
                if not (package.resolves(own_package + name) or package.resolves(module + name)):
                    problems.append(f"{where}:{line}: {name}")
            for file in _FILE_PATH.findall(text):
                if not (root.parent / file).exists():
                    problems.append(f"{where}:{line}: {file}")
    return problems


def test_docstrings_and_comments_name_only_modules_that_exist():
    problems = stale_names()
    assert not problems, "docstrings / comments naming what does not exist:\n" + "\n".join(problems)


def test_the_checker_catches_planted_stale_names(tmp_path):
    """The rule can fail: a copy of a small package with a stale absolute path, a stale relative role, a
    stale class member and a missing file, beside names that resolve."""
    pkg = tmp_path / "scalefold"
    (pkg / "train").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "step.py").write_text(
        '"""The step (:class:`TrainingStep`)."""\n\n\nclass TrainingStep:\n    def run(self):\n        pass\n'
    )
    (pkg / "train" / "trainer.py").write_text(
        '"""Calls :class:`~.step.TrainingStep` and :meth:`scalefold.train.step.TrainingStep.run`;\n'
        'the old :mod:`.steps`, :func:`scalefold.train.checkpointing.save` and\n'
        ':meth:`scalefold.train.step.TrainingStep.walk` are gone."""\n\n'
        "# see scalefold/train/step.py, not scalefold/train/cuda_graphs.py\n"
    )
    assert stale_names(pkg) == [
        "scalefold/train/trainer.py:1: scalefold.train.checkpointing.save",
        "scalefold/train/trainer.py:1: scalefold.train.step.TrainingStep.walk",
        "scalefold/train/trainer.py:1: .steps",
        "scalefold/train/trainer.py:5: scalefold/train/cuda_graphs.py",
    ]
