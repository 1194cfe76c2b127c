"""Plain PyTorch references for the fused kernels (the numerics every fast path is tested against)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    scale: float | None = None,
    inf: float = 1e9,
) -> torch.Tensor:
    """Reference gated attention; see :func:`scalefold.kernels.attention`.

    The order of operations follows the MLPerf reference model (scale the queries, add the
    mask offset, then the bias) so that float64 results agree with it to rounding.
    """
    q = q / math.sqrt(q.shape[-1]) if scale is None else q * scale
    a = torch.matmul(q, k.transpose(-1, -2))
    # a: [*, H, Nq, Nk]
    if mask is not None:
        a = a + (mask.to(a.dtype) - 1.0) * inf
    if bias is not None:
        a = a + bias
    a = torch.softmax(a, dim=-1)
    o = torch.matmul(a, v)
    # o: [*, H, Nq, D]
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return o


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Reference LayerNorm over the last dimension.

    Under bf16 compute the statistics are taken in float32 and the result cast back, the same
    contract the fused kernel keeps.
    """
    if x.dtype in (torch.bfloat16, torch.float16):
        y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
        return y.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight.to(x.dtype), bias.to(x.dtype), eps)


def adam_step_scalars(
    lr: torch.Tensor, step: torch.Tensor, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-lr / bias_correction1, sqrt(bias_correction2))`` as float64 device scalars.

    ``torch.optim.Adam`` computes these as Python floats (float64); keeping them in device
    tensors lets a CUDA graph replay the step with the current ``lr`` and ``step``.
    """
    step = step.to(torch.float64)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return -(lr.to(torch.float64) / bias_correction1), bias_correction2.sqrt()


@torch.no_grad()
def adam_swa_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    swa: torch.Tensor,
    compute: torch.Tensor | None = None,
    *,
    lr: torch.Tensor,
    step: torch.Tensor,
    clip_scale: torch.Tensor | None = None,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-6,
    swa_decay: float = 0.9,
    swa_n_averaged: int = 1,
) -> None:
    """Reference fused optimizer step over flat buffers, in place (see ``scalefold.kernels.adam_swa_``).

    ``g = grad * clip_scale`` in the master dtype, then ``torch.optim.Adam``'s single-tensor
    update operation by operation (``step`` already incremented), then the compute copy and the
    SWA update (``swa = param`` when ``swa_n_averaged == 0``, else
    ``swa += (param - swa) * (1 - swa_decay)``). Same math as
    ``scalefold.train.flat_optimizer._reference_update_``.
    """
    neg_step_size, bias_correction2_sqrt = adam_step_scalars(lr, step, beta1, beta2)
    g = grad.to(param.dtype)
    if clip_scale is not None:
        g = g * clip_scale
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.add_((exp_avg * neg_step_size).div_(denom))
    if compute is not None:
        compute.copy_(param)
    if swa_n_averaged == 0:
        swa.copy_(param)
    else:
        swa.add_((param - swa).mul_(1.0 - swa_decay))
