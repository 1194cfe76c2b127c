"""A persistent compile cache that the run controls (``--compile-cache DIR``).

torch keeps inductor's compiled graphs and Triton's kernels in a per-user folder of the system's
temporary directory: gone with the node, not shared by a job's nodes, shared (and raced) by its
ranks. :func:`configure_compile_cache` points both at ``DIR`` before anything compiles:

    DIR/<key>/inductor         TORCHINDUCTOR_CACHE_DIR: inductor's FX-graph and AOTAutograd caches,
                               its generated code and compiled kernels (C++ on CPU, Triton on GPU)
    DIR/<key>/triton/rank<r>   TRITON_CACHE_DIR: Triton's kernel cache, one per rank under Slurm /
                               torchrun (as NVIDIA's MLPerf scripts do), so ranks never race on a file
    DIR/<key>/scalefold-cache.json   what the folder was made for (the key below)

``<key>`` names what makes compiled code unusable elsewhere: the torch version, the Triton version,
the Python version and the device kind (the GPU's name and compute capability, or ``cpu-<machine>``).
Another torch, Triton, Python or GPU therefore uses a folder of its own and never reads a stale one.
Within a folder, inductor keys every entry by the graph itself (ScaleFold's code as traced, the input
shapes, dtypes and strides), inductor's configuration and the compiler: changed code or shapes add new
entries beside the old ones (delete ``DIR`` to reclaim the space). A folder whose record is missing,
unreadable or made for another key (copied, truncated, half-deleted) is removed and rebuilt with one
line saying so -- never a crash; so is a ``DIR`` that cannot be used (a file, no permission): the run
then compiles into a fresh temporary folder. Corrupt entries inside a sound folder: torch skips a cached
graph it cannot read (with a warning), and a corrupt compiled kernel that fails the compilation makes
:func:`compile_with_rebuild` empty the folder, with one line, and compile again (only for an error a corrupt
or stale cache raises: an out-of-memory or a failed CUDA-graph capture is never blamed on the cache).

Default ``DIR``: ``$XDG_CACHE_HOME/scalefold/compile`` (``~/.cache/scalefold/compile``); ``off``: leave
torch's own defaults alone.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

MANIFEST = "scalefold-cache.json"
FORMAT = 1
OFF = "off"


def default_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/scalefold/compile``, else ``~/.cache/scalefold/compile``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "scalefold" / "compile"


def device_kind(device: torch.device | str | None = None) -> str:
    """``"<GPU name> sm_<cc>"`` for a CUDA device (default: CUDA when available), else ``"cpu-<machine>"``."""
    device = torch.device(device) if device is not None else None
    use_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if use_cuda and torch.cuda.is_available():
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"{props.name} sm_{props.major}{props.minor}"
    return f"cpu-{platform.machine() or 'unknown'}"


def cache_key(device: torch.device | str | None = None) -> dict[str, str | int]:
    """What a cache folder is valid for: torch, Triton and Python versions and the device kind."""
    from importlib.metadata import PackageNotFoundError, version

    try:  # the installed version, without importing Triton (an import fixes its interpreter mode)
        triton_version = version("triton")
    except PackageNotFoundError:
        triton_version = "none"
    return {"format": FORMAT, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "device": device_kind(device)}  # fmt: skip


def key_name(key: Mapping[str, str | int]) -> str:
    """The folder name of ``key`` (letters, digits and ``._+-`` only)."""
    name = f"torch-{key['torch']}_triton-{key['triton']}_py{key['python']}_{key['device']}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", name)


def rank_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The process's global rank under torchrun (``RANK``), Slurm (``SLURM_PROCID``) or Open MPI; None alone."""
    env = os.environ if env is None else env
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


@dataclass(frozen=True)
class CompileCache:
    """Where this process's compiled code goes (see the module's docstring)."""

    root: Path | None  # DIR (None: off, torch's defaults)
    path: Path | None  # DIR/<key>
    inductor_dir: Path | None
    triton_dir: Path | None
    warm: bool  # the folder held compiled code already when the run started
    note: str | None = None  # what was rebuilt and why (printed once)

    def clear(self) -> None:
        """Empty inductor's and this rank's Triton folder (the record stays: the key still holds)."""
        for d in (self.inductor_dir, self.triton_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        if self.path is None:
            return "compile cache: off (torch's defaults)"
        return f"compile cache: {self.path} ({'warm' if self.warm else 'cold'})"


def _problem(path: Path, key: Mapping[str, str | int]) -> str | None:
    """Why the folder ``path`` cannot be reused (None: it can, or it does not exist yet)."""
    if not path.exists():
        return None
    if not path.is_dir():
        return "not a folder"
    try:
        recorded = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (not made by ScaleFold, or half-written)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"unreadable {MANIFEST} ({type(exc).__name__})"
    if not isinstance(recorded, dict):
        return f"unreadable {MANIFEST} (not an object)"
    stale = {k: (recorded.get(k), v) for k, v in key.items() if recorded.get(k) != v}
    if stale:
        return "stale: made for " + ", ".join(f"{k} {old!r} (now {new!r})" for k, (old, new) in stale.items())
    return None


def _has_entries(path: Path) -> bool:
    return path.is_dir() and any(p.is_file() for p in path.rglob("*"))


def configure_compile_cache(
    root: str | os.PathLike | None = None, device: torch.device | str | None = None, rank: int | None = None,
    env: dict[str, str] | None = None, log: Callable[[str], None] | None = None,
) -> CompileCache:  # fmt: skip
    """Point inductor's and Triton's caches at ``root`` (None: :func:`default_cache_root`; ``"off"``: leave
    torch's defaults) by setting ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` in ``env`` (default
    ``os.environ``); call it before anything compiles. ``rank`` (default :func:`rank_from_env`) gives
    Triton a folder per rank. A stale or corrupt folder is rebuilt and an unusable ``root`` replaced by a
    temporary folder, each with one line to ``log`` (default: stderr)."""
    env = os.environ if env is None else env
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if root is not None and str(root).strip().lower() == OFF:
        return CompileCache(None, None, None, None, warm=False)
    root = Path(root).expanduser() if root is not None and str(root).strip() else default_cache_root(env)
    key = cache_key(device)
    path = root / key_name(key)
    note = None
    problem = _problem(path, key)
    if problem is not None:
        note = f"compile cache {path}: {problem}; rebuilding it"
        shutil.rmtree(path, ignore_errors=True)
        if path.exists() and not path.is_dir():
            path.unlink(missing_ok=True)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not (path / MANIFEST).exists():
            tmp = path / f".{MANIFEST}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(key, indent=1) + "\n")
            os.replace(tmp, path / MANIFEST)  # atomic: another rank writing the same record is harmless
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="scalefold-compile-")) / key_name(key)
        note = (
            f"compile cache {root}: unusable ({type(exc).__name__}: {exc.strerror or exc}); compiling into {fallback}"
        )
        root, path = fallback.parent, fallback
        path.mkdir(parents=True, exist_ok=True)
        (path / MANIFEST).write_text(json.dumps(key, indent=1) + "\n")
    if note:
        say(note)
    rank = rank_from_env(env) if rank is None else rank
    inductor_dir = path / "inductor"
    triton_dir = path / "triton" / (f"rank{rank}" if rank is not None else "rank0")
    warm = _has_entries(inductor_dir) or _has_entries(triton_dir)
    for d in (inductor_dir, triton_dir):
        d.mkdir(parents=True, exist_ok=True)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    env["TRITON_CACHE_DIR"] = str(triton_dir)
    cache = CompileCache(root, path, inductor_dir, triton_dir, warm=warm, note=note)
    if env is os.environ:
        _active.append(cache)
    return cache


_active: list[CompileCache] = []  # the cache configure_compile_cache set up last (the environment is process-wide)


def active_cache() -> CompileCache | None:
    """The cache :func:`configure_compile_cache` set up last in this process (None: none)."""
    return _active[-1] if _active else None


# What a corrupt or stale cache entry raises when compiled code is loaded from it: a truncated or overwritten
# shared object (the dynamic loader's words), a truncated pickle, a half-written file. Matched in the message of
# any exception in the chain (inductor wraps the loader's error in its own).
CACHE_ERROR_MARKERS = (
    "invalid elf header", "file too short", "wrong elf class", "not a dynamic executable", "undefined symbol",
    "cannot open shared object", "ran out of input", "pickle data was truncated", "invalid load key",
    "bad magic number", "unexpected end of data", "compressed file ended",
)  # fmt: skip
# What is never the cache's fault, even when the cache held entries: running out of memory, a CUDA-graph
# capture that failed. Rebuilding would only double the time to the same failure and start the next run cold.
NOT_CACHE_MARKERS = (
    "out of memory", "outofmemory", "stream is capturing", "cudaerrorstreamcapture", "graph capture", "capture failed",
    "capture_begin", "capture_end",
)  # fmt: skip


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes / contexts, outermost first (each once)."""
    seen: list[BaseException] = []
    while exc is not None and all(exc is not e for e in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def is_cache_error(exc: BaseException, cache: CompileCache | None = None) -> bool:
    """Whether ``exc`` means a corrupt or stale compile cache: an unpickling / truncated-file error or a
    loader error (:data:`CACHE_ERROR_MARKERS`), or any error naming a file inside ``cache``'s folders -- and
    never an out-of-memory or CUDA-graph capture error (:data:`NOT_CACHE_MARKERS`) anywhere in the chain."""
    import pickle

    chain = _chain(exc)
    texts = [f"{type(e).__name__}: {e}".lower() for e in chain]
    if any(isinstance(e, torch.OutOfMemoryError) for e in chain) or any(m in t for t in texts for m in NOT_CACHE_MARKERS):
        return False
    if any(isinstance(e, (EOFError, pickle.UnpicklingError)) for e in chain):
        return True
    if any(m in t for t in texts for m in CACHE_ERROR_MARKERS):
        return True
    folders = [str(d).lower() for d in (cache.inductor_dir, cache.triton_dir) if d is not None] if cache else []
    return any(d in t for t in texts for d in folders)


def compile_with_rebuild(
    fn: Callable[[], T], cache: CompileCache | None = None, log: Callable[[str], None] | None = None
) -> T:
    """``fn()`` -- the first calls of compiled code, where compilation happens. torch skips a cached graph it
    cannot unpickle, but a corrupt compiled kernel in the cache (a truncated ``.so``) fails the compilation;
    then, when the cache held entries and the error is one a corrupt or stale cache raises
    (:func:`is_cache_error`), the cache is emptied with one line, dynamo's in-memory state reset and ``fn`` run
    once more (a cold compile). Any other error -- an out-of-memory, a failed CUDA-graph capture, a bug --
    propagates at once, the cache untouched. ``fn`` must be safe to repeat (a warm-up; a step before its update)."""
    cache = cache or active_cache()
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- anything compilation raises (BackendCompilerFailed, CppCompileError, ...)
        if cache is None or cache.path is None or not cache.warm or not is_cache_error(exc, cache):
            raise
        say = log or (lambda line: print(line, file=sys.stderr, flush=True))
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        say(f"compile cache {cache.path}: compiling from it failed ({type(exc).__name__}: {first}); rebuilding it")
        cache.clear()
        torch._dynamo.reset()
        return fn()


__all__ = [
    "CACHE_ERROR_MARKERS", "CompileCache", "FORMAT", "MANIFEST", "NOT_CACHE_MARKERS", "OFF", "active_cache", "cache_key",
    "compile_with_rebuild", "configure_compile_cache", "default_cache_root", "is_cache_error",
    "device_kind", "key_name", "rank_from_env",
]  # fmt: skip
