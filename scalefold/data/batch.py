"""Moving and copying feature batches: the one helper every consumer of a batch uses.

A batch is a ``dict`` of feature tensors (possibly nested, with non-tensor values such as chain ids);
floating-point features take the run's compute dtype, integer and boolean features keep theirs.
"""

from __future__ import annotations

import copy as _copy
from typing import Any

import torch


def move_batch(batch: Any, device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
               copy: bool = False, non_blocking: bool = False) -> Any:  # fmt: skip
    """``batch`` on ``device`` (None: where each tensor is), floating tensors in ``dtype`` (None: kept).

    ``copy=False`` returns a tensor that already has the device and dtype as it is (no copy), as
    ``Tensor.to`` does; ``copy=True`` never aliases the input (the model may then modify the result in
    place without touching, e.g., a cached batch), and deep-copies non-tensor values too.
    """
    if isinstance(batch, dict):
        return {k: move_batch(v, device, dtype, copy=copy, non_blocking=non_blocking) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        target = dtype if dtype is not None and batch.is_floating_point() else batch.dtype
        return batch.to(device=device or batch.device, dtype=target, non_blocking=non_blocking, copy=copy)
    return _copy.deepcopy(batch) if copy else batch


def recycling_slices(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The first ``n + 1`` recycling slices of a loader batch ``[..., R]``: a step with ``n`` no-grad passes."""
    return {k: v[..., : n + 1] for k, v in batch.items()}


def step_batch(batch: dict[str, torch.Tensor], n: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The first ``n + 1`` recycling slices of a loader batch ``[..., R]``, on ``device`` in ``dtype``."""
    return move_batch(recycling_slices(batch, n), device, dtype)


__all__ = ["move_batch", "recycling_slices", "step_batch"]
