"""What a run records about its code and its machine (``provenance.json`` in the run directory), for the
MLPerf submission built from it (``scalefold submission pack``): the code's identity (ScaleFold's version,
the git commit of the checkout when there is one, a sha256 of the package's sources), the software
versions actually imported and the hardware the logging rank saw (processor, memory, accelerators, nodes).

Standard library only, except what the run has imported already (torch, when present). Never fails a run:
an unreadable fact is left out (``None``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import scalefold

PROVENANCE_FILE = "provenance.json"
#: the packages whose versions a submission's system description names (the "software stack")
SOFTWARE = ("torch", "triton", "numpy", "mlperf-logging", "mpi4py", "nvidia-dali-cuda120", "h5py")


def package_root() -> Path:
    """The ``scalefold`` package's directory (its sources)."""
    return Path(scalefold.__file__).resolve().parent


def source_files(root: Path | None = None) -> list[Path]:
    """The package's Python sources, sorted: what the code hash covers."""
    root = root or package_root()
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def code_sha256(root: Path | None = None) -> str:
    """sha256 over every source file's path (relative to the package) and bytes: equal for equal code."""
    root = root or package_root()
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_commit(root: Path | None = None) -> str | None:
    """``<commit>`` (``+dirty`` when the checkout has uncommitted changes) of the checkout holding the
    package, None outside a git checkout or without git."""
    root = root or package_root()
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False)  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def code_identity() -> dict[str, Any]:
    """The running code: version, git commit (or None), sources' sha256."""
    return {"scalefold_version": scalefold.__version__, "git_commit": git_commit(), "code_sha256": code_sha256()}


def software_versions() -> dict[str, str]:
    """Python, the OS and each installed package of :data:`SOFTWARE` (absent ones left out); CUDA, cuDNN and
    NCCL as torch reports them when it is imported with CUDA."""
    versions = {"python": platform.python_version()}
    for name in SOFTWARE:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "cuda", None):
        versions["cuda"] = torch.version.cuda
        if torch.backends.cudnn.is_available():
            versions["cudnn"] = str(torch.backends.cudnn.version())
        try:
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            pass
    return versions


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpuinfo_values(field: str) -> set[str]:
    try:
        return {line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.split(":", 1)[0].strip() == field}  # fmt: skip
    except OSError:
        return set()


def _cpu_sockets() -> int | None:
    return len(_cpuinfo_values("physical id")) or None


def _cpu_cores() -> int | None:
    """Physical cores per processor (``cpu cores`` of /proc/cpuinfo)."""
    cores = _cpuinfo_values("cpu cores")
    return int(next(iter(cores))) if len(cores) == 1 and next(iter(cores)).isdigit() else None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _os_name() -> str:
    try:
        fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
        name = fields.get("PRETTY_NAME", "").strip('"')
    except OSError:
        name = ""
    return name or f"{platform.system()} {platform.release()}"


def _accelerators() -> dict[str, Any]:
    """The CUDA devices this process sees (name, memory, count), when torch is imported with CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {"accelerator_model_name": None, "accelerators_visible": 0}
    props = torch.cuda.get_device_properties(0)
    return {"accelerator_model_name": props.name, "accelerators_visible": torch.cuda.device_count(),
            "accelerator_memory_gib": round(props.total_memory / 2**30, 1)}  # fmt: skip


def hardware(num_nodes: int, ranks_per_node: int, uses_accelerators: bool) -> dict[str, Any]:
    """The logging rank's node: processor model, sockets, logical CPUs, memory; the accelerators; the job's
    node count and ranks (= accelerators when the run uses them) per node."""
    facts = {
        "host_processor_model_name": _cpu_model(), "host_processors_per_node": _cpu_sockets(),
        "host_processor_core_count": _cpu_cores(),
        "host_processor_vcpu_count": os.cpu_count(), "host_memory_gib": _memory_gib(),
        "number_of_nodes": num_nodes, "ranks_per_node": ranks_per_node,
        "operating_system": _os_name(), "kernel": f"{platform.system()} {platform.release()}",
        **_accelerators(),
    }  # fmt: skip
    facts["accelerators_per_node"] = ranks_per_node if uses_accelerators else 0
    return facts


def collect(num_nodes: int = 1, ranks_per_node: int = 1, uses_accelerators: bool = False) -> dict[str, Any]:
    """Everything :data:`PROVENANCE_FILE` holds."""
    return {"code": code_identity(), "software": software_versions(),
            "hardware": hardware(num_nodes, ranks_per_node, uses_accelerators)}  # fmt: skip


def write_provenance(out: Path, num_nodes: int, ranks_per_node: int, uses_accelerators: bool) -> Path | None:
    """Write :data:`PROVENANCE_FILE` into the run directory ``out`` (the logging rank, at the start of the
    run); a failure is reported in one line and never stops the run. Returns the path, or None."""
    path = Path(out) / PROVENANCE_FILE
    try:
        text = json.dumps(collect(num_nodes, ranks_per_node, uses_accelerators), indent=2) + "\n"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"scalefold train: WARNING: could not write {path} ({type(exc).__name__}: {exc}); "
              "`scalefold submission pack` will ask for the system's facts", flush=True)  # fmt: skip
        return None
    return path


def read_provenance(run_dir: Path) -> dict[str, Any] | None:
    """A run directory's :data:`PROVENANCE_FILE`, or None when it has none (a run of an older ScaleFold, or
    another implementation's log)."""
    path = Path(run_dir) / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
