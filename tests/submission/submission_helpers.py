"""Shared by the submission tests: NVIDIA's public MLPerf HPC v3.0 OpenFold results (data/README.md)."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

DATA = Path(__file__).parent / "data"
NVIDIA_ARCHIVE = DATA / "nvidia_hpc_v3.0_openfold.tar.xz"
NVIDIA_STRONG = ("eos_n260_ngc23.09_pytorch", "strong", "openfold")
NVIDIA_WEAK = ("eos_n256_ngc23.09_pytorch", "weak", "openfold")


def unpack_nvidia(dest: Path, keep: tuple[tuple[str, str, str], ...] = (NVIDIA_STRONG, NVIDIA_WEAK)) -> Path:
    """NVIDIA's submitter folder (the OpenFold part, see data/README.md) unpacked into ``dest``; only the
    benchmark folders in ``keep`` (and their systems)."""
    with tarfile.open(NVIDIA_ARCHIVE) as tar:
        tar.extractall(dest, filter="data")
    folder = dest / "NVIDIA"
    for system, scaling, benchmark in (NVIDIA_STRONG, NVIDIA_WEAK):
        if (system, scaling, benchmark) not in keep:
            shutil.rmtree(folder / "results" / system)
            (folder / "systems" / f"{system}.json").unlink()
    return folder
