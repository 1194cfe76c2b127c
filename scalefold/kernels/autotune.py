"""Launch-config selection for the Triton kernels: the shipped table by default, autotuning on request.

A :class:`Tuner` per kernel (``attention_fwd``, ``layer_norm_bwd``, ``adam_swa`` ...) picks the
launch config (block sizes, ``num_warps``, ``num_stages``) for a :class:`Key` -- the *shape class*
(sizes bucketed to powers of two, plus the flags that change the program, as a string such as
``"NQ=256,NK=256,D=32,bias=1,shared=1,gate=1"``) and the dtype label (``bf16``/``fp16``/``fp32``/
``tf32``/``fp64``; ``tf32`` is fp32 storage with TF32 dots). On a GPU:

* **by default** (``SCALEFOLD_AUTOTUNE`` unset or ``0``) nothing is timed: the config comes from
  the launch-config table shipped in the package (:mod:`scalefold.kernels.launch_table`, entries
  per GPU architecture, e.g. ``sm_90``, for every kernel at the MLPerf call sites), and where the
  table has no entry for the key (another shape, another architecture) from the kernel's *default*
  config -- the first candidate of its list, which must never spill. A table entry that does not
  run on this GPU (too much shared memory, a malformed entry) falls back to the default config with
  one line on stderr (:meth:`Tuner.run`); a missing or unreadable table falls back to the defaults
  with one line, never to autotuning;
* **``SCALEFOLD_AUTOTUNE=1``**: each new key times every candidate config (``triton.testing.
  do_bench``) and keeps the fastest. Results live in ``<cache dir>/rank<r>/<kernel>.json`` (one
  directory per rank, so concurrent ranks never race on a file; ``SCALEFOLD_AUTOTUNE_DIR``) and
  :func:`share_from_rank0` broadcasts rank 0's table to every rank when ``torch.distributed`` is
  initialised, so all ranks launch identical configs. Call it after a warm-up step. On the first
  GPU session (an H200) this timing took longer than a whole 70 s demo run: it is for measuring,
  not for start-up. ``scalefold tune-kernels`` (:mod:`scalefold.kerneltools.tune`) times the
  candidates at the MLPerf shapes once and writes a table instead.

Unlike ``triton.autotune`` the benchmark runs through a caller-supplied launch function, so an
in-place kernel can be benchmarked on scratch copies of its operands, and tuning never bumps a
tensor's ``_version`` inside an autograd Function.

Candidates may differ per GPU architecture (``configs`` maps a compute capability such as 90 or
80 to its list; a device uses the entry of the highest capability not above its own): which
candidates compile and fit an architecture's shared memory is checked ahead of time, without a
GPU, by ``scalefold aot-check`` (``--table`` checks the table's entries).

Under ``TRITON_INTERPRET=1`` (CPU) or without CUDA nothing is timed or looked up: the single
interpreter config is used.
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
from typing import NamedTuple

import torch

from scalefold.errors import exception_summary

CACHE_DIR_ENV = "SCALEFOLD_AUTOTUNE_DIR"
ENABLE_ENV = "SCALEFOLD_AUTOTUNE"  # "1": time the candidates of each new key; else the launch-config table
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "scalefold" / "autotune"
# Benchmark settings (milliseconds of warm-up / measurement per candidate config).
BENCH_WARMUP_MS = 10
BENCH_REP_MS = 40
#: dtype labels of keys and of the launch-config table
DTYPE_LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}

_lock = threading.Lock()
_tuners: dict[str, Tuner] = {}
_received: dict[str, dict] = {}  # tables broadcast for kernels this rank has not used yet
_reported_first = False  # the first tuning report names the cache and the switch
_tuning_s = 0.0  # seconds this process spent timing candidates (SCALEFOLD_AUTOTUNE=1): tuning_seconds()


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotuning() -> bool:
    """True when ``SCALEFOLD_AUTOTUNE=1`` (or ``true``/``yes``/``on``) asks for timing at run time."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


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


class Key(NamedTuple):
    """What a launch config is chosen for: the shape class and the dtype label."""

    shape: str  # e.g. "NQ=256,NK=256,D=32,bias=1,shared=1,gate=1"
    dtype: str  # bf16 / fp16 / fp32 / tf32 / fp64

    def cache_text(self, device: str) -> str:
        """The key of the autotuning cache (``SCALEFOLD_AUTOTUNE=1``), per device name."""
        return repr((self.shape, self.dtype, device))


def shape_class(**fields: object) -> str:
    """``"NAME=value,..."`` in the given order (booleans as 0/1): a shape class as the table writes it."""
    return ",".join(f"{name}={int(v) if isinstance(v, bool) else v}" for name, v in fields.items())


def dtype_label(dtype: torch.dtype) -> str:
    return DTYPE_LABELS.get(dtype, str(dtype).replace("torch.", ""))


def make_key(shape: str | Mapping[str, object], tensor: torch.Tensor, dtype: str | None = None) -> Key:
    """The :class:`Key` of a launch on ``tensor``: ``shape`` (a :func:`shape_class` string or its
    fields) and ``dtype`` (default: the label of ``tensor``'s dtype)."""
    text = shape if isinstance(shape, str) else shape_class(**shape)
    return Key(text, dtype or dtype_label(tensor.dtype))


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


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
        self.table: dict[str, dict] = {}  # autotuning results (SCALEFOLD_AUTOTUNE=1), by Key.cache_text
        self._loaded = False
        self._chosen: dict[tuple[int, Key], dict] = {}  # (capability, key) -> config from the table or default
        self._table_entries: set[tuple[int, Key]] = set()  # the chosen configs that are table entries

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

    def pick(self, key: Key, launch: Callable[[dict], None]) -> dict:
        """The config for ``key``: on a GPU the launch-config table's entry (or the default config),
        or, with ``SCALEFOLD_AUTOTUNE=1``, the fastest candidate, timing ``launch(config)`` for each
        on first use. ``launch`` must be safe to repeat (not accumulate into live state)."""
        if interpreting() or not torch.cuda.is_available():
            return self.interpreter_config
        capability = _capability()
        if not autotuning():
            return self._from_table(key, capability)
        cache_key = key.cache_text(_device_name())
        with _lock:
            if not self._loaded:
                self.load()
            if cache_key in self.table:
                return self.table[cache_key]
        t0 = time.perf_counter()
        best = self._benchmark(launch, capability)
        with _lock:
            self.table[cache_key] = best
            self.save()
        _report(self.name, cache_key, len(self.candidates(capability)), time.perf_counter() - t0, best, self.path)
        return best

    def run(self, key: Key, launch: Callable[[dict], None], bench: Callable[[dict], None] | None = None) -> dict:
        """Launch with the config :meth:`pick` gives (timing ``bench``, default ``launch``, when
        autotuning) and return it. A table entry that fails to launch on this GPU (out of shared
        memory or registers, a compile error) is replaced by the default config, with one line on
        stderr, for this key from then on; any other failure propagates."""
        config = self.pick(key, bench or launch)
        try:
            launch(config)
        except Exception as exc:
            fallback = self._fallback(key, config, exc)
            if fallback is None:
                raise
            launch(fallback)
            return fallback
        return config

    def _from_table(self, key: Key, capability: int) -> dict:
        memo = (capability, key)
        config = self._chosen.get(memo)
        if config is None:
            from scalefold.kernels import launch_table

            default = self.default(capability)
            config = launch_table.lookup(self.name, key, capability, default)
            if config != default:  # an entry equal to the default has nothing to fall back to
                self._table_entries.add(memo)
            with _lock:
                self._chosen[memo] = config
        return config

    def _fallback(self, key: Key, config: dict, exc: Exception) -> dict | None:
        """The default config in place of a table entry that failed to launch; None when ``config``
        is not a table entry (the failure is then not the table's)."""
        if interpreting() or not torch.cuda.is_available() or autotuning():
            return None
        capability = _capability()
        memo = (capability, key)
        if memo not in self._table_entries:
            return None
        from scalefold.kernels import launch_table

        default = self.default(capability)
        launch_table.notice(
            f"{launch_table.describe(self.name, key, capability)}: entry {config} does not run on "
            f"{_device_name()} ({exception_summary(exc)}); using the default {default}"
        )
        with _lock:
            self._table_entries.discard(memo)
            self._chosen[memo] = default
        return default

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
    """One line on stderr per tuning (a new kernel x shape class, ``SCALEFOLD_AUTOTUNE=1``): the first
    steps of such a run spend their time here (each candidate compiled and timed; the first GPU
    session's demo run did not reach step 1 in 70 s), so say so; the result is cached in ``path``."""
    global _reported_first, _tuning_s
    _tuning_s += seconds
    hint = ""
    if not _reported_first:
        _reported_first = True
        hint = f" [results cached in {path.parent}; without {ENABLE_ENV}=1 the shipped launch-config table is used]"
    print(f"autotune: {name} {key}: {candidates} configs timed in {seconds:.1f} s -> {best}{hint}",
          file=sys.stderr, flush=True)  # fmt: skip


def tuning_seconds() -> float:
    """Seconds this process has spent autotuning so far (each new kernel x shape class with
    ``SCALEFOLD_AUTOTUNE=1``): a run's time account counts them as compilation
    (:mod:`scalefold.train.time_account`)."""
    return _tuning_s


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


def reset_launch_table() -> None:
    """Forget the launch-config table read and every config the kernels chose from it (tests, a changed
    ``SCALEFOLD_LAUNCH_CONFIGS``)."""
    from scalefold.kernels import launch_table

    launch_table.reset()
    for tuner in list(_tuners.values()):
        tuner._chosen.clear()
        tuner._table_entries.clear()


__all__ = [
    "Key",
    "Tuner",
    "autotuning",
    "cache_dir",
    "get_tuner",
    "interpreting",
    "dtype_label",
    "make_key",
    "set_per_rank_triton_cache_dir",
    "shape_class",
    "share_from_rank0",
    "size_class",
]
