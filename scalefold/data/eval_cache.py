"""Evaluation data: targets spread over evaluation ranks by LPT, features cached in host memory.

ScaleFold's asynchronous evaluation replays the same validation targets every evaluation, so
their features are computed once (the first evaluation, with loader workers) and kept in host
DRAM; later evaluations read the cache. Each evaluation rank gets a subset of targets chosen by
longest-processing-time-first scheduling with cost proportional to L^2 (the pair
representation dominates), which keeps the ranks' evaluation times balanced.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from scalefold.data.loader import PriorityQueueLoader


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


def _copy_batch(batch: Any) -> Any:
    """A copy the model may modify in place without touching the cache (tensors cloned)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if isinstance(batch, dict):
        return {k: _copy_batch(v) for k, v in batch.items()}
    if torch is not None and isinstance(batch, torch.Tensor):
        return batch.clone()
    return copy.deepcopy(batch)


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
    ) -> None:
        if len(targets) != len(lengths):
            raise ValueError(f"{len(targets)} targets but {len(lengths)} lengths")
        self.sample_fn = sample_fn
        self.assigned = assign_lpt(lengths, num_ranks)[rank]  # indices into ``targets``
        self.targets = [tuple(targets[i]) for i in self.assigned]
        self.num_workers = num_workers
        self.mp_context = mp_context
        self._cache: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def filled(self) -> bool:
        return self._cache is not None

    def fill(self) -> None:
        """Build every assigned target's features (in target order) and keep them."""
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
            self._cache = [batches[p] for p in range(len(self.targets))]
        else:
            self._cache = [self.sample_fn(index, seed) for index, seed in self.targets]

    def __iter__(self) -> Iterator[Any]:
        """Yields a fresh copy of each cached batch (building the cache on first use)."""
        self.fill()
        for batch in self._cache:
            yield _copy_batch(batch)


__all__ = ["assign_lpt", "rank_costs", "quadratic_cost", "EvalCache"]
