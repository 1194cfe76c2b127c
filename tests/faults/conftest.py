"""Faults injected for real: a size-limited tmpfs the test mounts, a tiny store, a clean launch environment.

:func:`small_disk` mounts a fresh ``tmpfs`` of a given size (``mount -t tmpfs -o size=...``: root, as in
CI) and unmounts it in teardown; where mounting is not allowed the test is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scalefold.config.training import TrainConfig
from scalefold.train.trainer import train


def clean_env() -> dict[str, str]:
    """The environment of a fresh launch: no inherited rank, Slurm or ScaleFold variables; one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DGXSYSTEM"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    env["SCALEFOLD_COUNT_FLOPS"] = "0"
    return env


def records(path: Path) -> list[dict]:
    """Every line of a ``metrics.jsonl`` parsed (a torn line fails the test)."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def mllog(path: Path) -> list[dict]:
    """The ``:::MLLOG`` records of a log, each parsed (a torn line fails the test)."""
    return [json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in path.read_text().splitlines() if ":::MLLOG " in ln]


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


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` with one file until at most ``leave`` bytes are free (a real ENOSPC ends the filling)."""
    filler = disk / "filler.bin"
    block = b"\0" * (1 << 16)
    with open(filler, "ab") as f:
        while True:
            st = os.statvfs(disk)
            room = st.f_bavail * st.f_frsize - leave
            if room <= 0:
                break
            try:
                f.write(block[: min(len(block), room)])
                f.flush()
            except OSError:
                break
    return filler
