"""Kernel tests run the Triton kernels in Triton's CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined, i.e. before
``scalefold.kernels.triton_ops`` is first imported -- this conftest is imported before the test
modules. Tests that need Triton ``pytest.importorskip`` it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: Triton releases before 3.7 run kernels in the CPU interpreter only with numpy < 2.4 (numpy 2.4
#: no longer converts the interpreter's 1-element arrays to Python scalars: ``range(0, N, BLOCK)``
#: in a kernel fails with "only 0-dimensional arrays can be converted to Python scalars")
INTERPRETER_NUMPY_24_TRITON = (3, 7)


def _interpreter_mismatch() -> str | None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    import numpy

    from scalefold.kernels import triton_version

    version = triton_version()
    numpy_version = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    if version is None or version >= INTERPRETER_NUMPY_24_TRITON or numpy_version < (2, 4):
        return None
    return (f"Triton {version[0]}.{version[1]}'s CPU interpreter needs numpy < 2.4 (numpy {numpy.__version__} "
            "is installed): pip install 'numpy<2.4', or Triton >= 3.7")  # fmt: skip


@pytest.fixture(autouse=True)
def _interpreter_works_with_numpy(request):
    """Tests that run kernels in the interpreter fail with one clear line, not 19 cryptic ones, when the
    installed numpy is too new for the installed Triton's interpreter."""
    if hasattr(request.module, "triton_ops"):
        problem = _interpreter_mismatch()
        if problem:
            pytest.fail(problem, pytrace=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _private_autotune_cache(tmp_path, monkeypatch):
    """Tuning results of a test go to a throw-away directory, never to ``~/.cache``."""
    monkeypatch.setenv("SCALEFOLD_AUTOTUNE_DIR", str(tmp_path / "autotune"))
