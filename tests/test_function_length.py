"""No function of the ``scalefold`` package is longer than 80 lines (ScaleFold issue 24, item 4).

Length = ``end_lineno - lineno + 1`` of the ``def`` (its decorators excluded; docstring, comments
and blank lines inside it included), for every function and method, nested ones too. Triton
kernel bodies (decorated ``@triton.jit``, ``@triton.autotune(...)`` or ``@triton.heuristics(...)``)
are exempt: a kernel is one unit of GPU code that cannot call a Python helper.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "scalefold"
MAX_LINES = 80
#: ``triton.<name>`` decorators that make a function a Triton kernel (exempt from the limit).
TRITON_KERNEL_DECORATORS = frozenset({"jit", "autotune", "heuristics"})

#: Known offenders still to be split, as ``"path:qualified name"`` (none today). An entry that is no
#: longer over the limit (or no longer exists) fails ``test_allow_list_is_current``, so the list cannot
#: outlive the functions it excuses.
ALLOWED_LONG_FUNCTIONS: frozenset[str] = frozenset()


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated ``@triton.jit`` / ``@triton.autotune(...)`` / ``@triton.heuristics(...)``."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "triton"
            and target.attr in TRITON_KERNEL_DECORATORS
        ):
            return True
    return False


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length)`` of every non-kernel function in ``source``;
    qualified names join enclosing classes and functions with dots (``Class.method``)."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _is_triton_kernel(child):
                    continue
                found.append((f"{prefix}{child.name}", child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def long_functions() -> dict[str, int]:
    """``{"path:qualified name": length}`` of every function of the package over the limit."""
    out: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        for name, _, length in function_lengths(path.read_text(encoding="utf-8")):
            if length > MAX_LINES:
                out[f"{rel}:{name}"] = max(length, out.get(f"{rel}:{name}", 0))
    return out


def test_no_function_over_the_limit():
    """Every function outside the allow-list is at most MAX_LINES long."""
    offenders = {key: n for key, n in long_functions().items() if key not in ALLOWED_LONG_FUNCTIONS}
    listing = "\n".join(f"  {key}:{n}" for key, n in sorted(offenders.items()))
    assert not offenders, f"functions longer than {MAX_LINES} lines (file:function:length):\n{listing}"


def test_allow_list_is_current():
    """Every allow-listed function still exists and is still too long (else: drop it from the list)."""
    long = long_functions()
    stale = sorted(key for key in ALLOWED_LONG_FUNCTIONS if key not in long)
    assert not stale, f"allow-listed but not (or no longer) over {MAX_LINES} lines: remove from the list: {stale}"


def test_measurement():
    """The checker counts from ``def`` to the last line (decorators excluded), sees methods and nested
    functions under qualified names, and exempts exactly the Triton kernel decorators."""

    def body(n: int) -> str:  # a function of exactly n lines
        return "".join(f"    x{i} = {i}\n" for i in range(n - 2)) + "    return 0\n"

    source = textwrap.dedent(
        """
        import functools
        import triton

        @functools.lru_cache
        def exactly_80():
        {b80}
        def exactly_81():
        {b81}
        class Model:
            @staticmethod
            def method():
        {method}
        def outer():
            def inner():
        {inner}
            return inner

        @triton.autotune(configs=[], key=[])
        @triton.jit
        def kernel():
        {b200}
        @triton.heuristics({{}})
        def heuristic_kernel():
        {b200}
        @triton.testing.perf_report([])
        def not_a_kernel():
        {b81}
        """
    ).format(
        b80=body(80),
        b81=body(81),
        b200=body(200),
        method=textwrap.indent(body(90), "    "),
        inner=textwrap.indent(body(85), "    "),
    )
    lengths = {name: n for name, _, n in function_lengths(source)}
    assert lengths["exactly_80"] == 80 and lengths["exactly_81"] == 81
    assert lengths["Model.method"] == 90
    assert lengths["outer.inner"] == 85
    assert lengths["not_a_kernel"] == 81
    assert "kernel" not in lengths and "heuristic_kernel" not in lengths
