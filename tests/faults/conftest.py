"""Faults injected for real: a size-limited tmpfs the test mounts, a tiny store, a clean launch environment.

:func:`small_disk` mounts a fresh ``tmpfs`` of a given size (``mount -t tmpfs -o size=...``: root, as in
CI) and unmounts it in teardown; where mounting is not allowed the test is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scalefold.config.training import TrainConfig
from scalefold.train.trainer import train

sys.path.insert(0, str(Path(__file__).parent))  # the tests here import fault_helpers (pytest's importlib mode)


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """A tiny synthetic store (created once by a one-step run)."""
    root = tmp_path_factory.mktemp("faults_store")
    path = root / "store.h5"
    cfg = TrainConfig.from_preset(
        "tiny", overrides={"out": str(root / "warm"), "store": str(path), "max_steps": 1, "eval_every": 0}, env={}
    )
    train(cfg)
    return path


def _mount(point: Path, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes at ``point``; the reason it cannot be, or None."""
    if sys.platform != "linux":
        return f"tmpfs mounts need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"mounting a tmpfs needs root (uid {os.geteuid()})"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        return f"mount -t tmpfs failed here: {(proc.stderr or proc.stdout).strip()}"
    return None


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Callable[[int], Path]]:
    """``small_disk(size_bytes)`` -> the root of a freshly mounted tmpfs of that size (unmounted in teardown)."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        reason = _mount(point, size)
        if reason is not None:
            pytest.skip(reason)
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)  # a process still holds it
