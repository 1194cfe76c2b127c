"""Gradient synchronisation under DP x BP x DAP.

After backward, a parameter's gradient on one rank is

* *partial* over the DAP group if it lives in a DAP-sharded block (each rank saw its shard): the
  true gradient is the **sum** over the DAP group;
* *partial* over the BP pair if it belongs to one branch of a Parallel Evoformer block (only the
  branch's owner computed it, the peer holds zero): **sum** over the BP pair;
* *replicated* otherwise (embedders, structure module, heads, stack outputs, the parallel block's
  outer product mean): identical on the ranks of a DAP group / BP pair, **not** summed.

Then data-parallel replicas are averaged. Both rules fold into one mean over all training ranks
(what DDP and the bucket-clipping hook of ``scalefold.optim.clipping`` do) once every
gradient is multiplied by ``grad_scale(p) = (dap if sharded) * (bp if branch-owned)``:
``mean_{dp,bp,dap}(g * scale) = mean_dp(sum_{sharded axes} g)``. The model's parallel stacks
(:mod:`scalefold.distributed.parallelize`) name which parameters are sharded or branch-owned;
:func:`install_grad_scale_hooks`
applies the factor as the gradient is produced (so DDP buckets and the clip norm see the true
gradient); :func:`all_reduce_mean` is the explicit, DDP-free reduction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn


class ParallelStack(Protocol):
    """What gradient synchronisation reads of a parallel stack (the protocol of the same name in
    :mod:`scalefold.distributed.parallelize`, which implements the stacks; repeated here so that this
    module, which :mod:`~scalefold.distributed.parallelize` imports, imports nothing back)."""

    def sharded_parameters(self) -> Iterable[nn.Parameter]: ...

    def branch_parameters(self) -> Iterable[nn.Parameter]: ...


def grad_scales(stacks: Sequence[ParallelStack], dap_size: int, bp_size: int) -> dict[nn.Parameter, float]:
    """``{param: factor}`` for every parameter of ``stacks`` whose factor is not 1: ``dap_size``
    for the DAP-sharded blocks' parameters, times ``bp_size`` for a Parallel Evoformer's branches."""
    scales: dict[nn.Parameter, float] = {}
    if dap_size > 1:
        for stack in stacks:
            for p in stack.sharded_parameters():
                scales[p] = float(dap_size)
    if bp_size > 1:
        for stack in stacks:
            for p in stack.branch_parameters():
                scales[p] = scales.get(p, 1.0) * bp_size
    return scales


def install_grad_scale_hooks(stacks: Sequence[ParallelStack], dap_size: int, bp_size: int) -> list:
    """Multiply each gradient by its factor as it is produced; returns the hook handles."""
    handles = []
    for p, s in grad_scales(stacks, dap_size, bp_size).items():
        handles.append(p.register_hook(lambda g, s=s: g * s))
    return handles


@torch.no_grad()
def all_reduce_mean(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Average ``p.grad`` over ``group`` in one flat all-reduce (missing gradients count as zero)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


__all__ = [
    "grad_scales",
    "install_grad_scale_hooks",
    "all_reduce_mean",
]
