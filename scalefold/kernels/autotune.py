"""Autotuning of the Triton kernels' launch configurations, persisted and shared across ranks.

A :class:`Tuner` per kernel maps a key -- ``(shape class, dtype, device name)`` -- to the fastest
of its candidate configs. Results live in ``<cache dir>/rank<r>/<kernel>.json`` (one directory
per rank, so concurrent ranks never race on a file) and :func:`share_from_rank0` broadcasts rank
0's table to every rank when ``torch.distributed`` is initialised, so all ranks launch identical
configs (and only rank 0 needs to have paid for the tuning). Call it after a warm-up step.

Unlike ``triton.autotune`` the benchmark runs through a caller-supplied launch function, so an
in-place kernel can be benchmarked on scratch copies of its operands, and tuning never bumps a
tensor's ``_version`` inside an autograd Function.

Candidates may differ per GPU architecture (``configs`` maps a compute capability such as 90 or
80 to its list; a device uses the entry of the highest capability not above its own): which
candidates compile and fit an architecture's shared memory is checked ahead of time, without a
GPU, by ``python -m scalefold.kernels.aot``. The first candidate is the *default*: the config used
without autotuning (``SCALEFOLD_AUTOTUNE=0``), which must never spill.

Under ``TRITON_INTERPRET=1`` (CPU) or without CUDA nothing is timed: the single interpreter
config is used.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from scalefold.errors import exception_summary

CACHE_DIR_ENV = "SCALEFOLD_AUTOTUNE_DIR"
ENABLE_ENV = "SCALEFOLD_AUTOTUNE"  # "0": launch each kernel's default config, time nothing
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "scalefold" / "autotune"
# Benchmark settings (milliseconds of warm-up / measurement per candidate config).
BENCH_WARMUP_MS = 10
BENCH_REP_MS = 40

_lock = threading.Lock()
_tuners: dict[str, Tuner] = {}
_received: dict[str, dict] = {}  # tables broadcast for kernels this rank has not used yet
_reported_first = False  # the first tuning report names the cache and the switch


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def cache_dir(rank: int | None = None) -> Path:
    """This rank's tuning-cache directory."""
    root = Path(os.environ.get(CACHE_DIR_ENV, DEFAULT_CACHE_DIR))
    return root / f"rank{_rank() if rank is None else rank}"


def set_per_rank_triton_cache_dir(root: os.PathLike | None = None) -> Path:
    """Point ``TRITON_CACHE_DIR`` at a per-rank directory (unless already set): concurrent ranks
    compiling the same kernel into one shared cache directory race on its files."""
    if "TRITON_CACHE_DIR" in os.environ:
        return Path(os.environ["TRITON_CACHE_DIR"])
    base = Path(root) if root is not None else Path.home() / ".triton" / "cache"
    path = base / f"rank{_rank()}"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


def size_class(n: int) -> int:
    """Bucket a size to the next power of two (shapes in one class share a config)."""
    return 1 << max(0, int(n) - 1).bit_length()


def make_key(shape_class: tuple, tensor: torch.Tensor) -> str:
    """``(shape class, dtype, device name)`` as a string usable as a JSON key."""
    if tensor.is_cuda:
        device = torch.cuda.get_device_name(tensor.device)
    else:
        device = "interpreter" if interpreting() else str(tensor.device.type)
    return repr((tuple(shape_class), str(tensor.dtype).replace("torch.", ""), device))


class Tuner:
    """Picks (and remembers) the fastest launch config of one kernel per key."""

    def __init__(
        self, name: str, configs: Sequence[dict] | Mapping[int, Sequence[dict]], interpreter_config: dict
    ) -> None:
        self.name = name
        if isinstance(configs, Mapping):  # per compute capability
            self.configs_by_arch = {int(cap): [dict(c) for c in cs] for cap, cs in configs.items()}
        else:
            self.configs_by_arch = {0: [dict(c) for c in configs]}
        self.interpreter_config = dict(interpreter_config)
        self.table: dict[str, dict] = {}
        self._loaded = False

    def candidates(self, capability: int | None = None) -> list[dict]:
        """The candidate configs for a device of compute capability ``capability`` (e.g. 90);
        ``None``: the lowest architecture's list."""
        caps = sorted(self.configs_by_arch)
        fitting = [c for c in caps if capability is not None and c <= capability]
        return self.configs_by_arch[fitting[-1] if fitting else caps[0]]

    def default(self, capability: int | None = None) -> dict:
        """The config used without autotuning: the first candidate."""
        return self.candidates(capability)[0]

    # -- persistence ---------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return cache_dir() / f"{self.name}.json"

    def load(self) -> None:
        self._loaded = True
        try:
            self.table.update(json.loads(self.path.read_text()))
        except (OSError, ValueError):
            pass

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.table, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError:  # a read-only home must not stop training
            pass

    # -- selection -----------------------------------------------------------------------------

    def pick(self, key: str, launch: Callable[[dict], None]) -> dict:
        """The config for ``key``; benchmarks ``launch(config)`` for every candidate on first use
        (CUDA only). ``launch`` must be safe to repeat (not accumulate into live state)."""
        if interpreting() or not torch.cuda.is_available():
            return self.interpreter_config
        capability = _capability()
        if os.environ.get(ENABLE_ENV, "1") == "0":
            return self.default(capability)
        with _lock:
            if not self._loaded:
                self.load()
            if key in self.table:
                return self.table[key]
        t0 = time.perf_counter()
        best = self._benchmark(launch, capability)
        with _lock:
            self.table[key] = best
            self.save()
        _report(self.name, key, len(self.candidates(capability)), time.perf_counter() - t0, best, self.path)
        return best

    def _benchmark(self, launch: Callable[[dict], None], capability: int | None = None) -> dict:
        import triton.testing

        timings = []
        errors = []
        for cfg in self.candidates(capability):
            try:
                ms = triton.testing.do_bench(functools.partial(launch, cfg), warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS)
            except Exception as exc:  # out of shared memory / registers for this shape: not a candidate
                errors.append(f"{cfg}: {exception_summary(exc)}")
                continue
            timings.append((ms, cfg))
        if not timings:  # every candidate failed: say why (a bad launch, not only a too-small device)
            raise RuntimeError(f"no launch config of {self.name} runs on this device:\n  " + "\n  ".join(errors))
        return min(timings, key=lambda t: t[0])[1]


def _report(name: str, key: str, candidates: int, seconds: float, best: dict, path: Path) -> None:
    """One line on stderr per tuning (a new kernel x shape class): on a GPU the first steps of a run
    spend their time here (each candidate compiled and timed; the first GPU session's demo run did not
    reach step 1 in 70 s), so say so; the result is cached in ``path``."""
    global _reported_first
    hint = ""
    if not _reported_first:
        _reported_first = True
        hint = f" [results cached in {path.parent}; {ENABLE_ENV}=0 launches each kernel's default config untimed]"
    print(f"autotune: {name} {key}: {candidates} configs timed in {seconds:.1f} s -> {best}{hint}",
          file=sys.stderr, flush=True)  # fmt: skip


def _capability() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def get_tuner(name: str, configs: Sequence[dict] | Mapping[int, Sequence[dict]], interpreter_config: dict) -> Tuner:
    """The process-wide tuner of kernel ``name``."""
    with _lock:
        if name not in _tuners:
            _tuners[name] = Tuner(name, configs, interpreter_config)
            _tuners[name].table.update(_received.pop(name, {}))
        return _tuners[name]


def share_from_rank0() -> None:
    """Broadcast rank 0's tuning tables to every rank (collective: call on all ranks)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    with _lock:
        for tuner in _tuners.values():
            if not tuner._loaded:
                tuner.load()
        payload = [{name: dict(t.table) for name, t in sorted(_tuners.items())}]
    dist.broadcast_object_list(payload, src=0)
    with _lock:
        for name, table in payload[0].items():
            if name in _tuners:
                _tuners[name].table.update(table)
                _tuners[name].save()
            else:
                _received.setdefault(name, {}).update(table)


__all__ = [
    "Tuner",
    "cache_dir",
    "get_tuner",
    "interpreting",
    "make_key",
    "set_per_rank_triton_cache_dir",
    "share_from_rank0",
    "size_class",
]
