"""DALI loader backend -- measured, slower than the native loaders, so not part of ScaleFold.

Issue 3 asked for a loader backend on NVIDIA DALI's parallel external source, to be kept only if
the loader benchmark shows it is not slower than the native loader. It is slower, so ScaleFold
ships only its own loaders (:mod:`scalefold.data.loader`); this module stays in ``bench/`` so the
measurement can be repeated: ``python bench/loader_stall.py --with-dali`` (needs
``pip install nvidia-dali-cuda120`` or ``-cuda130``; CPU-only pipeline, ``device_id=None``).

:class:`DaliLoader` has the native loaders' interface (``DaliLoader(sample_fn, sampler,
num_workers=..., prefetch_factor=...)``; iterating yields ``(position, batch)``); its only DALI
operator is ``fn.external_source(parallel=True)``: DALI's Python worker processes call
``sample_fn(index, seed)`` and the PyTorch iterator hands the outputs back as tensors.

Measured (DALI 2.4.0, 2-core shared CPU box, 4 workers, prefetch 4, same workload and loop for
all three loaders; wait = time the loop waited for batches):

=====================================================  ==============  ==========  ========
workload                                               priority queue  in order    DALI
=====================================================  ==============  ==========  ========
200 steps of 50 ms, prep 50 ms, 10 % of samples x10    0.012 s         0.38 s      1.17 s
  (heavy tail, ScaleFold Fig. 4), run 2 of 2           (0.12 %)        (3.6 %)     (10.3 %)
150 steps of 30 ms, prep 150 ms, no slow samples       loop 5.79 s     5.79 s      6.41 s
  (loader-bound throughput)
=====================================================  ==============  ==========  ========

Why: DALI's prefetch queue delivers strictly in sampler order (a slow sample blocks every step
behind it -- the stall the priority-queue loader removes), and it adds a per-sample copy through
its own buffers. It also has no crash recovery (a dead worker ends the pipeline), no per-sample
timeout and no worker-init hook. Exceptions inside ``sample_fn`` are retried ``max_attempts``
times in the worker, then the sample is skipped and recorded in :attr:`skipped`.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from scalefold.data.loader import DEFAULT_MAX_ATTEMPTS, DEFAULT_PREFETCH_FACTOR, SampleFn, SkippedSample

logger = logging.getLogger(__name__)

BroadcastFn = Callable[[Any], Any]

# Extra outputs every sample carries: its position in the sampler sequence and a failure flag.
POSITION_KEY = "__position__"
FAILED_KEY = "__failed__"
# DALI's Python workers support these start methods ("forkserver" is mapped to "spawn").
_START_METHODS = {"fork": "fork", "spawn": "spawn", "forkserver": "spawn", None: "spawn"}


def dali_available() -> tuple[bool, str]:
    """``(True, version)`` when ``nvidia.dali`` imports, else ``(False, reason)``."""
    try:
        import nvidia.dali as dali
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return False, f"nvidia-dali is not importable ({type(exc).__name__}: {exc})"
    return True, str(dali.__version__)


@dataclass(frozen=True)
class _OutputSpec:
    """Layout of one batch entry as DALI sees it (DALI needs at least one dimension)."""

    key: str
    dtype: np.dtype
    ndim: int  # of the original value; 0-d values travel as shape [1]


def _to_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.ascontiguousarray(np.asarray(value))
    return array.reshape(1) if array.ndim == 0 else array


class _Source:
    """The per-sample callback DALI's worker processes run (picklable: ``sample_fn`` + pairs + layout)."""

    def __init__(
        self, sample_fn: SampleFn, pairs: Sequence[tuple[int, int]], specs: Sequence[_OutputSpec], max_attempts: int
    ) -> None:
        self.sample_fn = sample_fn
        self.pairs = list(pairs)
        self.specs = list(specs)
        self.max_attempts = max_attempts

    def __call__(self, info) -> tuple[np.ndarray, ...]:
        position = int(info.idx_in_epoch)
        if position >= len(self.pairs):
            raise StopIteration
        index, seed = self.pairs[position]
        error = ""
        for _ in range(self.max_attempts):
            try:
                batch = self.sample_fn(index, seed)
                arrays = [_to_array(batch[spec.key]).astype(spec.dtype, copy=False) for spec in self.specs]
                return (np.array([position], np.int64), np.array([0], np.uint8), *arrays)
            except Exception:  # noqa: BLE001 - retried, then reported as a skipped sample
                error = traceback.format_exc(limit=3)
        # Failed: empty arrays of the right dtype/rank, the message in the last output's place is
        # not possible (numeric outputs only), so the reason travels through the log.
        logger.warning(
            "sample at position %d (index %d) failed %d times:\n%s", position, index, self.max_attempts, error
        )
        empty = [np.zeros((0,) * max(spec.ndim, 1), spec.dtype) for spec in self.specs]
        return (np.array([position], np.int64), np.array([1], np.uint8), *empty)


class DaliLoader:
    """Loader backend on DALI's parallel external source; same arguments as ``PriorityQueueLoader``.

    Args:
        sample_fn: picklable ``(index, seed) -> dict`` of tensors / arrays / numbers.
        sampler: iterable of ``(index, seed)`` pairs.
        num_workers: DALI Python worker processes (``py_num_workers``).
        prefetch_factor: samples built ahead per worker: DALI's prefetch queue holds
            ``num_workers * prefetch_factor`` batches (the native loaders' bound).
        max_attempts: tries per sample (exceptions only) before it is skipped.
        mp_context: ``"spawn"`` (default; ``"forkserver"`` maps to it) or ``"fork"``.
        broadcast: hook applied to each batch before it is yielded (DAP: send to the group).
        keys: batch keys, in order; default: build the first pair once in this process to learn
            the keys and dtypes (DALI must know its outputs before it starts).
    """

    def __init__(
        self,
        sample_fn: SampleFn,
        sampler: Iterable[tuple[int, int]],
        num_workers: int = 2,
        prefetch_factor: int = DEFAULT_PREFETCH_FACTOR,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        sample_timeout: float | None = None,
        mp_context: str | None = None,
        broadcast: BroadcastFn | None = None,
        worker_init: Callable[[int], None] | None = None,
        keys: Sequence[str] | None = None,
    ) -> None:
        available, detail = dali_available()
        if not available:
            raise RuntimeError(f"the DALI loader needs NVIDIA DALI: {detail}; pip install nvidia-dali-cuda120")
        if num_workers < 1 or prefetch_factor < 1 or max_attempts < 1:
            raise ValueError("num_workers, prefetch_factor and max_attempts must be >= 1")
        if sample_timeout is not None:
            raise ValueError("the DALI loader has no per-sample timeout; use the native loaders for sample_timeout")
        if worker_init is not None:
            raise ValueError("the DALI loader has no worker_init hook; use the native loaders for worker_init")
        if mp_context not in _START_METHODS:
            raise ValueError(f"mp_context must be one of fork/spawn/forkserver, got {mp_context!r}")
        self.sample_fn = sample_fn
        self.pairs = [(int(i), int(s)) for i, s in sampler]
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.max_attempts = max_attempts
        self.start_method = _START_METHODS[mp_context]
        self.broadcast = broadcast
        self._keys = list(keys) if keys is not None else None
        self._specs: list[_OutputSpec] | None = None
        self._pipeline = None
        self.skipped: list[SkippedSample] = []
        self.restarts = 0  # DALI does not restart workers

    # -- interface shared with the native loaders
    @property
    def queue_depth(self) -> int:
        """Batches DALI builds ahead (``num_workers * prefetch_factor``)."""
        return self.num_workers * self.prefetch_factor

    @property
    def worker_pids(self) -> list[int]:
        return []  # DALI does not expose its worker processes

    def __len__(self) -> int:
        return len(self.pairs)

    def _output_specs(self) -> list[_OutputSpec]:
        if self._specs is None:
            index, seed = self.pairs[0]
            probe = self.sample_fn(index, seed)
            keys = self._keys if self._keys is not None else list(probe)
            self._specs = [_OutputSpec(k, _to_array(probe[k]).dtype, _value_ndim(probe[k])) for k in keys]
        return self._specs

    def start(self, wait_ready: bool = True) -> None:
        """Build the DALI pipeline; building starts its worker processes (``wait_ready`` is implied)."""
        if self._pipeline is not None or not self.pairs:
            return
        import nvidia.dali as dali
        import nvidia.dali.fn as fn

        specs = self._output_specs()
        source = _Source(self.sample_fn, self.pairs, specs, self.max_attempts)

        @dali.pipeline_def(
            batch_size=1,
            num_threads=1,
            device_id=None,  # CPU-only pipeline
            py_num_workers=self.num_workers,
            py_start_method=self.start_method,
            prefetch_queue_depth=self.queue_depth,
            exec_dynamic=True,
        )
        def pipeline():
            outputs = fn.external_source(
                source=source,
                num_outputs=len(specs) + 2,
                batch=False,
                parallel=True,
                prefetch_queue_depth=self.queue_depth,  # batches the workers build ahead
            )
            return tuple(outputs)

        self._pipeline = pipeline()
        self._pipeline.build()  # starts the Python workers and begins prefetching

    def close(self) -> None:
        """Shut the pipeline and its workers down (idempotent)."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            del pipeline

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """Yields ``(position, batch)`` in sampler order (failed samples are skipped)."""
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        if not self.pairs:
            return
        self.start(wait_ready=False)
        specs = self._output_specs()
        names = [POSITION_KEY, FAILED_KEY, *(spec.key for spec in specs)]
        iterator = DALIGenericIterator([self._pipeline], names, auto_reset=False)
        try:
            for outputs in iterator:
                data = outputs[0]
                position = int(data[POSITION_KEY].reshape(-1)[0])
                if int(data[FAILED_KEY].reshape(-1)[0]):
                    index, seed = self.pairs[position]
                    reason = "exception in sample_fn (traceback in the worker's log)"
                    self.skipped.append(SkippedSample(position, index, seed, self.max_attempts, reason))
                    continue
                # DALI reuses its output buffers: copy, drop DALI's batch dim, restore 0-d values.
                batch = {spec.key: _restore(data[spec.key][0], spec) for spec in specs}
                if self.broadcast is not None:
                    batch = self.broadcast(batch)
                yield position, batch
        finally:
            self.close()

    def __enter__(self) -> DaliLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _value_ndim(value: Any) -> int:
    return value.dim() if isinstance(value, torch.Tensor) else np.asarray(value).ndim


def _restore(tensor: torch.Tensor, spec: _OutputSpec) -> torch.Tensor:
    out = tensor.clone()
    return out.reshape(()) if spec.ndim == 0 else out


__all__ = ["DaliLoader", "dali_available", "POSITION_KEY"]
