"""Evaluation data: targets spread over evaluation ranks by LPT, features cached in host memory.

ScaleFold's asynchronous evaluation replays the same validation targets every evaluation, so
their features are computed once (the first evaluation, with loader workers) and kept in host
DRAM; later evaluations read the cache. Each evaluation rank gets a subset of targets chosen by
longest-processing-time-first scheduling with cost proportional to L^2 (the pair
representation dominates), which keeps the ranks' evaluation times balanced.

The cache never holds accelerator memory: whatever ``sample_fn`` returns is moved to the host
when the cache is filled (optionally into pinned memory, for asynchronous host-to-device copies),
and :meth:`EvalCache.batches` moves one batch at a time to the evaluation device -- only the
batch being evaluated occupies device memory (180 full-length validation targets with their
recycling dimension would not fit next to the model).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from scalefold.data.loader import PriorityQueueLoader

logger = logging.getLogger(__name__)


def quadratic_cost(length: int) -> float:
    """Evaluation cost model of one target: L^2."""
    return float(length) ** 2


def assign_lpt(
    lengths: Sequence[int], num_ranks: int, cost: Callable[[int], float] = quadratic_cost
) -> list[list[int]]:
    """Longest-processing-time-first assignment of targets to ranks.

    Targets are taken in decreasing cost (ties: lower index first) and each goes to the rank
    with the smallest total cost so far (ties: lower rank). Returns, per rank, the target
    indices in ascending order. The result is a 4/3-approximation of the optimal makespan.
    """
    if num_ranks < 1:
        raise ValueError("num_ranks must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-cost(lengths[i]), i))
    loads = [(0.0, r) for r in range(num_ranks)]  # heap of (load, rank)
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        load, rank = heapq.heappop(loads)
        assignment[rank].append(i)
        heapq.heappush(loads, (load + cost(lengths[i]), rank))
    return [sorted(a) for a in assignment]


def rank_costs(
    lengths: Sequence[int], assignment: Sequence[Sequence[int]], cost: Callable[[int], float] = quadratic_cost
) -> list[float]:
    """Total cost per rank of an assignment."""
    return [sum(cost(lengths[i]) for i in targets) for targets in assignment]


def _to_host(batch: Any, pin_memory: bool) -> Any:
    """``batch`` with every tensor in host memory (pinned when ``pin_memory``)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return batch
    if isinstance(batch, dict):
        return {k: _to_host(v, pin_memory) for k, v in batch.items()}
    if type(batch) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in batch):
        return type(batch)(_to_host(v, pin_memory) for v in batch)
    if isinstance(batch, torch.Tensor):
        if batch.device.type != "cpu":
            batch = batch.cpu()
        if pin_memory and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch
    return batch


class EvalCache:
    """This rank's validation batches, built once and then replayed from host memory.

    Args:
        sample_fn: picklable ``(index, seed) -> features`` (e.g. store lookup +
            ``process_validation_features``).
        targets: ``(index, seed)`` of every validation target (the reference seeds each target
            with ``validation_seed(chain_id)``).
        lengths: residue count of each target (LPT cost).
        rank, num_ranks: this evaluation rank and the size of the evaluation group.
        num_workers: loader workers for the first pass (0: build in this process).
        mp_context: multiprocessing start method for the workers.
        pin_memory: keep the cached tensors in pinned (page-locked) host memory so that
            :meth:`batches` can copy them to the GPU asynchronously; ignored (with a log line)
            where no CUDA device is available.

    Iterating yields host copies; ``batches(device, dtype)`` yields per-batch device copies.
    """

    def __init__(
        self,
        sample_fn: Callable[[int, int], Any],
        targets: Sequence[tuple[int, int]],
        lengths: Sequence[int],
        rank: int = 0,
        num_ranks: int = 1,
        num_workers: int = 0,
        mp_context: str | None = None,
        pin_memory: bool = False,
    ) -> None:
        if len(targets) != len(lengths):
            raise ValueError(f"{len(targets)} targets but {len(lengths)} lengths")
        self.sample_fn = sample_fn
        self.assigned = assign_lpt(lengths, num_ranks)[rank]  # indices into ``targets``
        self.targets = [tuple(targets[i]) for i in self.assigned]
        self.num_workers = num_workers
        self.mp_context = mp_context
        self.pin_memory = pin_memory
        self._cache: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def filled(self) -> bool:
        return self._cache is not None

    def _pin(self) -> bool:
        if not self.pin_memory:
            return False
        import torch

        if torch.cuda.is_available():
            return True
        logger.info("EvalCache: pin_memory requested but no CUDA device; caching in pageable host memory")
        return False

    def fill(self) -> None:
        """Build every assigned target's features (in target order) and keep them in host memory."""
        if self._cache is not None:
            return
        if self.num_workers > 0 and self.targets:
            loader = PriorityQueueLoader(
                self.sample_fn,
                self.targets,
                num_workers=self.num_workers,
                deterministic=True,
                mp_context=self.mp_context,
            )
            with loader:
                batches = dict(loader)
            if loader.skipped:
                reasons = "; ".join(f"target {s.index}: {s.reason.splitlines()[0]}" for s in loader.skipped)
                raise RuntimeError(f"could not build validation features: {reasons}")
            cache = [batches[p] for p in range(len(self.targets))]
        else:
            cache = [self.sample_fn(index, seed) for index, seed in self.targets]
        pin = self._pin()
        self._cache = [_to_host(batch, pin) for batch in cache]

    def batches(self, device: Any = None, dtype: Any = None) -> Iterator[Any]:
        """Each cached batch, copied to ``device`` one at a time (building the cache on first use).

        Floating-point tensors take ``dtype`` when given. The copies are new tensors (the model
        may modify them in place); from pinned memory the host-to-device copies are asynchronous
        (``non_blocking``), ordered on the current stream before the batch is used.
        """
        from scalefold.data.batch import move_batch  # torch only when batches are used

        self.fill()
        non_blocking = self.pin_memory and device is not None and str(device) != "cpu"
        for batch in self._cache:
            yield move_batch(batch, device, dtype, copy=True, non_blocking=non_blocking)  # never aliases the cache

    def __iter__(self) -> Iterator[Any]:
        """Yields a fresh host copy of each cached batch (building the cache on first use)."""
        return self.batches()


def validation_cache(
    store_path: str, chain_ids: list[str], features: Any, rank: int = 0, num_ranks: int = 1,
    num_workers: int = 0, pin_memory: bool = False,
) -> EvalCache:
    """The :class:`~scalefold.evaluation.cache.EvalCache` of rank ``rank`` of ``num_ranks`` for the
    validation chains ``chain_ids`` of a store: targets spread by LPT with cost L² (residue counts from
    the store's chain table), each with the reference's fixed validation seed (``"eval"`` mode).
    Nothing is computed until the cache is filled."""
    from scalefold.data.dataset import StoreSample
    from scalefold.data.store import Store

    with Store.open(store_path) as store:
        table = store.chain_table()
    length_of = dict(zip((str(c) for c in table["chain_id"]), (int(n) for n in table["length"])))
    missing = [c for c in chain_ids if c not in length_of]
    if missing:
        raise KeyError(f"{store_path}: validation chains {missing[:10]} are not in the store")
    return EvalCache(
        StoreSample(str(store_path), list(chain_ids), features, mode="eval"),
        [(i, 0) for i in range(len(chain_ids))], [length_of[c] for c in chain_ids],
        rank=rank, num_ranks=num_ranks, num_workers=num_workers, pin_memory=pin_memory,
    )  # fmt: skip


__all__ = ["assign_lpt", "rank_costs", "quadratic_cost", "EvalCache", "validation_cache"]
