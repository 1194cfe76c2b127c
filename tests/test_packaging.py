"""Versions claimed are versions tested, and ScaleFold's own metadata builds without warnings.

The torch/Triton range lives in ``scalefold.tested_versions``; pyproject.toml's lower bounds, the
floor job's pins (.ci/floor-constraints.txt), the Makefile's pins (CI's main suite) and the
Dockerfile's base-image check must all say the same.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from scalefold import tested_versions
from scalefold.tested_versions import FLOOR, TOP, outside_range

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _lower_bound(requirements: list[str], name: str) -> tuple[int, int]:
    (spec,) = [r for r in requirements if re.match(rf"{name}\b", r)]
    match = re.fullmatch(rf"{name}>=(\d+)\.(\d+)", spec)
    assert match, f"{spec!r}: expected a plain lower bound {name}>=X.Y"
    return int(match.group(1)), int(match.group(2))


def _pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([a-z][\w-]*)==(\S+)", text, re.MULTILINE))


def test_declared_floor_is_the_tested_floor():
    """pyproject.toml's torch and triton lower bounds (the dependency and every extra naming triton) are
    FLOOR, and the floor job installs exactly FLOOR (x.y.0), with a numpy its Triton's interpreter runs."""
    project = _pyproject()["project"]
    assert _lower_bound(project["dependencies"], "torch") == FLOOR["torch"]
    extras = project["optional-dependencies"]
    with_triton = [name for name, reqs in extras.items() if any(r.startswith("triton") for r in reqs)]
    assert {"triton", "test"} <= set(with_triton)
    for name in with_triton:
        assert _lower_bound(extras[name], "triton") == FLOOR["triton"], name
    pins = _pins((REPO / ".ci" / "floor-constraints.txt").read_text())
    assert pins["torch"] == "{}.{}.0".format(*FLOOR["torch"])
    assert pins["triton"] == "{}.{}.0".format(*FLOOR["triton"])
    if FLOOR["triton"] < (3, 7):  # tests/kernels/conftest.py: INTERPRETER_NUMPY_24_TRITON
        assert tuple(int(p) for p in pins["numpy"].split(".")[:2]) < (2, 4)


def test_main_suite_pins_are_the_newest_tested():
    """The Makefile's default torch and triton (what `make test`, hence CI's main suite, installs) are TOP."""
    makefile = (REPO / "Makefile").read_text()
    torch_spec = re.search(r"^TORCH_SPEC \?= torch==(\d+)\.(\d+)\.\d+$", makefile, re.MULTILINE)
    triton_spec = re.search(r"^TRITON_SPEC \?= triton==(\d+)\.(\d+)\.\d+$", makefile, re.MULTILINE)
    assert torch_spec and triton_spec
    assert tuple(map(int, torch_spec.groups())) == TOP["torch"]
    assert tuple(map(int, triton_spec.groups())) == TOP["triton"]
    assert '"$(TRITON_SPEC)"' in makefile


def test_container_build_checks_its_base_against_the_range():
    """The Dockerfile checks the base image's torch/Triton before installing, keeps the image's Triton
    (no `triton` extra), and copies what the metadata needs (LICENSE)."""
    text = (REPO / "Dockerfile").read_text()
    run = text[text.index("RUN python -m scalefold check-versions") :]
    assert run.index("scalefold check-versions") < run.index("pip install")
    assert "[triton" not in text and ",triton" not in text
    assert re.search(r"^COPY pyproject.toml README.md LICENSE \./$", text, re.MULTILINE)


@pytest.mark.parametrize(
    "package, version, verdict",
    [
        ("torch", "2.6.0", None),
        ("torch", "2.6.0+cu124", None),
        ("torch", "2.13.0+cpu", None),
        ("torch", "2.10.0a0+b4e4ee81d3", None),  # NGC 25.12: a pre-release above the floor's minor
        ("torch", "2.6.0a0+ecf3bae40a.nv25.1", "older than the tested floor"),  # NGC 25.01
        ("torch", "2.5.1", "older than the tested floor"),
        ("torch", "2.14.0", "newer than the newest tested"),
        ("triton", "3.2.0", None),
        ("triton", "3.9.0", None),
        ("triton", "3.1.0", "older than the tested floor"),
        ("triton", "3.10.0", "newer than the newest tested"),
        ("triton", None, "not installed"),
        ("triton", "unknown", "unreadable version"),
    ],
)
def test_outside_range(package, version, verdict):
    problem = outside_range(package, version)
    if verdict is None:
        assert problem is None
    else:
        assert verdict in problem and f"{package} " in problem


def test_check_command_names_the_versions_and_fails_outside(monkeypatch, capsys):
    """``scalefold check-versions``: one line of versions; exit 1 with the reason outside the range."""
    versions = {"torch": "2.5.1+cu124", "triton": "3.1.0", "numpy": "2.3.5"}
    monkeypatch.setattr(tested_versions, "installed", versions.get)
    assert tested_versions.main() == 1
    out, err = capsys.readouterr()
    assert out == "torch 2.5.1+cu124, triton 3.1.0, numpy 2.3.5\n"
    assert "torch 2.5.1+cu124 is older" in err and "triton 3.1.0 is older" in err
    versions.update(torch="2.13.0+cpu", triton="3.9.0")
    assert tested_versions.main() == 0


def test_wheel_builds_without_metadata_warnings(tmp_path):
    """``pip wheel . --no-deps`` (an isolated build with the setuptools pyproject.toml asks for): no
    warning from the build backend (e.g. setuptools' "`project.license` as a TOML table is deprecated"),
    the SPDX license and its file in the wheel. Needs the package index for setuptools (~10 s)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "scalefold", src / "scalefold", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-cache-dir", "-w", str(tmp_path / "dist")],
        cwd=src, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and re.search(r"Could not find a version that satisfies the requirement setuptools"
                                          r"|Failed to establish a new connection|Network is unreachable", output):  # fmt: skip
        pytest.skip(f"no package index to build with: {output.strip().splitlines()[-1]}")
    assert proc.returncode == 0, output[-3000:]
    # Python warning classes (BuildBackendWarning, SetuptoolsDeprecationWarning ...), not pip's own "WARNING:"
    warnings = [line.strip() for line in output.splitlines() if re.search(r"\w+Warning\b", line)]
    assert warnings == [], "\n".join(warnings)
    (wheel,) = (tmp_path / "dist").glob("scalefold-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist())
    assert "License-Expression: Apache-2.0" in metadata
