"""tests/conftest.py's SCALEFOLD_EARLY_TRACEBACKS hook: a failure's traceback is printed when the test
fails (before the next test runs), so a run cut short by a wall-clock limit still says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, early: str) -> str:
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tests / "test_x.py").write_text(
        "def test_fails():\n    assert 1 == 2, 'boom-marker'\n\n"
        "def test_next():\n    print('NEXT-TEST-RAN')\n"
    )
    env = dict(os.environ, SCALEFOLD_EARLY_TRACEBACKS=early)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "-q", str(tests)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)  # fmt: skip
    return proc.stdout


def test_traceback_printed_before_the_next_test_runs(tmp_path):
    out = _run(tmp_path, "1")
    assert "test_x.py::test_fails (call) failed" in out
    assert out.index("boom-marker") < out.index("NEXT-TEST-RAN")


def test_off_by_default(tmp_path):
    out = _run(tmp_path, "0")
    assert "(call) failed -----" not in out
    assert out.index("NEXT-TEST-RAN") < out.index("boom-marker")  # only in the end-of-session summary
