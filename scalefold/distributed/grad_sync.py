"""Gradient synchronisation under DP x BP x DAP.

After backward, a parameter's gradient on one rank is

* *partial* over the DAP group if it lives in a DAP-sharded block (each rank saw its shard): the
  true gradient is the **sum** over the DAP group;
* *partial* over the BP pair if it belongs to one branch of a Parallel Evoformer block (only the
  branch's owner computed it, the peer holds zero): **sum** over the BP pair;
* *replicated* otherwise (embedders, structure module, heads, stack outputs, the parallel block's
  outer product mean): identical on the ranks of a DAP group / BP pair, **not** summed.

Then data-parallel replicas are averaged. Both rules fold into one mean over all training ranks
(what DDP and the bucket-clipping hook of ``scalefold.train.grad_clipping`` do) once every
gradient is multiplied by ``grad_scale(p) = (dap if sharded) * (bp if branch-owned)``:
``mean_{dp,bp,dap}(g * scale) = mean_dp(sum_{sharded axes} g)``. :func:`install_grad_scale_hooks`
applies the factor as the gradient is produced (so DDP buckets and the clip norm see the true
gradient); :func:`all_reduce_mean` is the explicit, DDP-free reduction.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

MSA_BRANCH_MODULES = ("msa_att_row", "msa_att_col", "msa_dropout_rowwise", "core.msa_transition")
PAIR_BRANCH_MODULES = (
    "core.tri_mul_out",
    "core.tri_mul_in",
    "core.tri_att_start",
    "core.tri_att_end",
    "core.pair_transition",
)


def _sharded_stacks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "dap_group") and hasattr(m, "blocks")]


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the blocks of every DAP-capable stack (Evoformer, extra-MSA, template)."""
    return [p for stack in _sharded_stacks(model) for p in stack.blocks.parameters()]


def branch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters owned by one branch of a Parallel Evoformer block (not its outer product mean)."""
    params = []
    for module in model.modules():
        if getattr(module, "parallel", False) and hasattr(module, "core"):
            for name in MSA_BRANCH_MODULES + PAIR_BRANCH_MODULES:
                params.extend(module.get_submodule(name).parameters())
    return params


def grad_scales(model: nn.Module, dap_size: int, bp_size: int) -> dict[nn.Parameter, float]:
    """``{param: factor}`` for every parameter whose factor is not 1."""
    scales: dict[nn.Parameter, float] = {}
    if dap_size > 1:
        for p in sharded_parameters(model):
            scales[p] = float(dap_size)
    if bp_size > 1:
        for p in branch_parameters(model):
            scales[p] = scales.get(p, 1.0) * bp_size
    return scales


def install_grad_scale_hooks(model: nn.Module, dap_size: int, bp_size: int) -> list:
    """Multiply each gradient by its factor as it is produced; returns the hook handles."""
    handles = []
    for p, s in grad_scales(model, dap_size, bp_size).items():
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
    "sharded_parameters",
    "branch_parameters",
    "grad_scales",
    "install_grad_scale_hooks",
    "all_reduce_mean",
]
