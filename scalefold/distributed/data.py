"""Data under DAP / BP: one loader per model group, its batch broadcast to the group's ranks."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


def broadcast_batch(
    batch: Mapping[str, torch.Tensor] | None,
    src: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """``batch`` (a dict of tensors, given on global rank ``src`` only) on every rank of ``group``.

    Names, shapes and dtypes travel first (one object broadcast), then each tensor.
    """
    is_src = dist.get_rank() == src
    if is_src and batch is None:
        raise ValueError("the source rank of broadcast_batch must pass its batch")
    spec = [[(k, tuple(v.shape), v.dtype, v.device.type) for k, v in batch.items()]] if is_src else [None]
    dist.broadcast_object_list(spec, src=src, group=group)
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype, device_type in spec[0]:
        where = device if device is not None else torch.device(device_type)
        t = batch[name].contiguous() if is_src else torch.empty(shape, dtype=dtype, device=where)
        dist.broadcast(t, src=src, group=group)
        out[name] = t
    return out


__all__ = ["broadcast_batch"]
