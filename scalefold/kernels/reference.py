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
