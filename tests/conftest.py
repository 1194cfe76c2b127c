"""Shared pytest fixtures.

Test data lives outside the repository, in ``../shared`` beside the checkout (or wherever
``SCALEFOLD_SHARED`` points).  Tests that need it request the ``shared_dir`` fixture (or one of
the more specific ones) and are skipped with a clear reason when it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# `scalefold train` counts its step's FLOPs once per configuration (a fake step in a child process) for the
# tflops / mfu of metrics.jsonl; the suite's many short CLI runs skip that, tests/train/test_throughput.py
# runs it (SCALEFOLD_COUNT_FLOPS=1).
os.environ.setdefault("SCALEFOLD_COUNT_FLOPS", "0")
# Triton reads TRITON_INTERPRET at its first import: on a CPU-only host the kernels' interpreter must be
# on before any test (or torch.compile's inductor) imports Triton (scalefold.kernels sets it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _shared_root() -> Path:
    env = os.environ.get("SCALEFOLD_SHARED")
    return Path(env) if env else REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    root = _shared_root()
    if not root.is_dir():
        pytest.skip(f"shared test data not found at {root} (set SCALEFOLD_SHARED)")
    return root


@pytest.fixture(scope="session")
def reference_dir(shared_dir: Path) -> Path:
    path = shared_dir / "reference"
    if not path.is_dir():
        pytest.skip(f"reference goldens not found at {path}")
    return path


@pytest.fixture(scope="session")
def golden_small(reference_dir: Path) -> dict:
    path = reference_dir / "golden_small.pt"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="session")
def golden_modules(reference_dir: Path) -> dict:
    path = reference_dir / "golden_modules.pt"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="session")
def data_dir(shared_dir: Path) -> Path:
    path = shared_dir / "data"
    if not path.is_dir():
        pytest.skip(f"shared PDB/alignment test data not found at {path}")
    return path


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread (two spin-waiting threads on a shared 2-core box are ~10x slower); a
    module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """``SCALEFOLD_EARLY_TRACEBACKS=1``: print a failing test's traceback as soon as it fails, not in the
    end-of-session summary -- a run cut short by a wall-clock limit (a lent GPU machine's command
    limit, ``bench/gpu_session.sh``) still shows why each finished test failed."""
    if report.failed and os.environ.get("SCALEFOLD_EARLY_TRACEBACKS", "0") not in ("", "0"):
        print(f"\n----- {report.nodeid} ({report.when}) failed -----\n{report.longreprtext}\n-----", flush=True)
