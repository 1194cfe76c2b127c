"""Helpers of the fault tests: a clean launch environment, the logs parsed strictly, filling a disk."""

from __future__ import annotations

import json
import os
from pathlib import Path


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
