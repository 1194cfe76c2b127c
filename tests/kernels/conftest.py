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
