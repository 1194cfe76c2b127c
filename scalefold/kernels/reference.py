"""Plain PyTorch references for the fused kernels (the numerics every fast path is tested against)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

# The structure module's geometry chains: references like the chains below, looked up here by name
# (scalefold.kernels.elementwise); written in their own module with the rotation algebra they share.
from scalefold.kernels.geometry import (  # noqa: F401
    backbone_update,
    ipa_attended_points,
    ipa_logits,
    ipa_points,
    sidechain_frames,
    structure_outputs,
)


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
    # a: [*, H, Nq, Nk]. The glue of masked_softmax, written out here (not called): each step rebinds ``a``, so
    # the previous logits-sized tensor is freed at once. Passed as an argument, the logits -- the largest
    # tensor of the block, 1 GiB in the extra-MSA row attention at MLPerf shapes (bf16) -- stay referenced by
    # this frame (as a local, or on the caller's stack when CPython does not inline the call, e.g. under a
    # profiler or a frame-evaluation hook) through the softmax, at the step's peak (the memory model's sites).
    if mask is not None:
        a = a + (mask.to(a.dtype) - 1.0) * inf
    if bias is not None:
        a = a + bias
    a = torch.softmax(a, dim=-1)
    o = torch.matmul(a, v)
    # o: [*, H, Nq, D]
    return o if gate is None else sigmoid_gate(o, gate)


# -- the memory-bound elementwise chains around the matmuls (scalefold.kernels.elementwise compiles them) --


def masked_softmax(a: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None, inf: float) -> torch.Tensor:
    """``softmax(a + (mask - 1) * inf + bias)`` over the last dimension (the attention logits' glue)."""
    if mask is not None:
        a = a + (mask.to(a.dtype) - 1.0) * inf
    if bias is not None:
        a = a + bias
    return torch.softmax(a, dim=-1)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` (the output gates of attention and of the triangle multiplications)."""
    return x * torch.sigmoid(gate)


def gated_projection(gate: torch.Tensor, mask: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """``sigmoid(gate) * mask * proj`` (the masked, gated projections of a triangle multiplication)."""
    return torch.sigmoid(gate) * mask * proj


def dropout_add(x: torch.Tensor, update: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The residual update ``x + update * mask`` (``mask``: a drawn, scaled dropout mask; None: no dropout)."""
    return x + (update if mask is None else update * mask)


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


def adam_swa_chunk_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    swa: torch.Tensor,
    compute: torch.Tensor | None,
    *,
    clip_scale: torch.Tensor | None,
    neg_step_size: torch.Tensor | float,
    bias_correction2_sqrt: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    swa_decay: float,
    swa_copy: bool,
    scratch: Sequence[torch.Tensor] | None = None,
) -> None:
    """One chunk of :func:`adam_swa_`: clip scale -> ``torch.optim.Adam`` (single-tensor path)
    operation by operation -> compute copy -> SWA.

    ``neg_step_size`` is ``-lr / bias_correction1``: a host float (Adam's own ``addcdiv_``) or a device
    scalar (no host read; ``p + (value * exp_avg) / denom`` in the order ``addcdiv_`` evaluates it, with the
    scalar cast to the master dtype as ``addcdiv_`` casts its ``value``: on the CPU bit for bit the same,
    ``tests/optim``; on CUDA within a few ulp). ``scratch``: three buffers of the chunk's length and master
    dtype for the temporaries (``None`` allocates).
    """
    s_grad, s_denom, s_update = scratch if scratch is not None else (None, None, None)
    if grad.dtype != param.dtype:  # low-precision compute grads: scale in the master dtype
        g = grad.to(param.dtype) if s_grad is None else s_grad.copy_(grad)
        if clip_scale is not None:
            g.mul_(clip_scale)
    elif clip_scale is not None:  # clip_grad_norm_ multiplies by the clamped coefficient
        g = torch.mul(grad, clip_scale, out=s_grad) if s_grad is not None else torch.mul(grad, clip_scale)
    else:
        g = grad
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = torch.sqrt(exp_avg_sq, out=s_denom) if s_denom is not None else exp_avg_sq.sqrt()
    denom.div_(bias_correction2_sqrt).add_(eps)
    if isinstance(neg_step_size, float):
        param.addcdiv_(exp_avg, denom, value=neg_step_size)
    else:
        update = torch.mul(exp_avg, neg_step_size, out=s_update) if s_update is not None else exp_avg * neg_step_size
        param.add_(update.div_(denom))
    if compute is not None:
        compute.copy_(param)
    if swa_copy:  # AveragedModel's first update copies the weights
        swa.copy_(param)
    else:  # MLPerf's avg + (p - avg) * (1 - decay), as one lerp pass (see adam_swa_)
        swa.lerp_(param, 1.0 - swa_decay)


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
    chunk_numel: int | None = None,
    scratch: Sequence[torch.Tensor] | None = None,
) -> None:
    """Reference fused optimizer step over flat buffers, in place (see ``scalefold.kernels.adam_swa_``).

    ``g = grad * clip_scale`` in the master dtype, then ``torch.optim.Adam``'s single-tensor update
    operation by operation (``step`` already incremented), then the compute copy and the SWA
    update: ``swa = param`` when ``swa_n_averaged == 0``, else the MLPerf reference's
    ``swa + (param - swa) * (1 - swa_decay)`` (``AveragedModel``'s ``avg_fn``) computed as
    ``swa.lerp_(param, 1 - swa_decay)``: the same formula for a weight below 0.5, in one pass
    instead of three, but lerp's vectorised CPU kernel may fuse the multiply-add, so the two differ
    in the last bit (fp32: ~1 ulp per step). Training has always used the lerp form.

    The step size stays a device scalar on every device (nothing is read back to the host, so a captured
    step -- :mod:`scalefold.compilation.emulated_capture` on the CPU -- replays it with each step's count);
    on the CPU the update equals ``torch.optim.Adam``'s ``addcdiv_`` with the host float bit for bit. ``chunk_numel``
    processes the buffers in chunks (temporaries stay in the CPU caches; ``None``: one pass) with
    ``scratch``: three master-dtype buffers of at least one chunk (``None`` allocates).
    """
    neg_step_size, bias_correction2_sqrt = adam_step_scalars(lr, step, beta1, beta2)
    scalars = dict(
        clip_scale=clip_scale, neg_step_size=neg_step_size, bias_correction2_sqrt=bias_correction2_sqrt,
        beta1=beta1, beta2=beta2, eps=eps, swa_decay=swa_decay, swa_copy=swa_n_averaged == 0,
    )  # fmt: skip
    numel = param.numel()
    chunk = chunk_numel or max(numel, 1)
    for start in range(0, numel, chunk):
        sl = slice(start, min(start + chunk, numel))
        n = sl.stop - sl.start
        adam_swa_chunk_(
            param[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], swa[sl], None if compute is None else compute[sl],
            **scalars, scratch=None if scratch is None else [t[:n] for t in scratch],
        )  # fmt: skip


class TrimulWeights(NamedTuple):
    """The parameters of a triangle multiplication (Alg. 11 / 12), ``weight``/``bias`` pairs in the
    reference model's order: the input LayerNorm, the projections ``a_p``, ``a_g``, ``b_p``, ``b_g``
    (``[c_hidden, c_z]``), the output gate ``g`` (``[c_z, c_z]``), the output LayerNorm and the output
    projection ``z`` (``[c_z, c_hidden]``)."""

    ln_in_w: torch.Tensor
    ln_in_b: torch.Tensor
    a_p_w: torch.Tensor
    a_p_b: torch.Tensor
    a_g_w: torch.Tensor
    a_g_b: torch.Tensor
    b_p_w: torch.Tensor
    b_p_b: torch.Tensor
    b_g_w: torch.Tensor
    b_g_b: torch.Tensor
    g_w: torch.Tensor
    g_b: torch.Tensor
    ln_out_w: torch.Tensor
    ln_out_b: torch.Tensor
    z_w: torch.Tensor
    z_b: torch.Tensor


def triangle_product(a: torch.Tensor, b: torch.Tensor, outgoing: bool) -> torch.Tensor:
    """``x_ij = sum_k a_ik b_jk`` (outgoing) or ``sum_k a_ki b_kj`` (incoming), channel by channel:
    ``a``, ``b``, ``x`` ``[*, N, N, C]``."""
    if outgoing:
        a = a.movedim(-1, -3)  # a_ik: [*, C, i, k]
        b = b.swapdims(-1, -3)  # b_jk -> [*, C, k, j]
    else:
        a = a.swapdims(-1, -3)  # a_ki -> [*, C, i, k]
        b = b.movedim(-1, -3)  # b_kj: [*, C, k, j]
    return torch.matmul(a, b).movedim(-3, -1)


def triangle_multiplication(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    w: TrimulWeights,
    outgoing: bool,
    eps_in: float = 1e-5,
    eps_out: float = 1e-5,
) -> torch.Tensor:
    """Reference triangle multiplication (Alg. 11 outgoing, Alg. 12 incoming); see
    :func:`scalefold.kernels.triangle_multiplication`. ``z`` ``[*, N, N, c_z]``, ``mask`` 0/1
    broadcasting to ``[*, N, N]`` (None: all ones) -> the update ``[*, N, N, c_z]``."""
    m = z.new_ones(z.shape[:-1]) if mask is None else mask.to(z.dtype)
    m = m.unsqueeze(-1)
    z = layer_norm(z, w.ln_in_w, w.ln_in_b, eps_in)
    a = gated_projection(F.linear(z, w.a_g_w, w.a_g_b), m, F.linear(z, w.a_p_w, w.a_p_b))
    b = gated_projection(F.linear(z, w.b_g_w, w.b_g_b), m, F.linear(z, w.b_p_w, w.b_p_b))
    x = triangle_product(a, b, outgoing)
    x = F.linear(layer_norm(x, w.ln_out_w, w.ln_out_b, eps_out), w.z_w, w.z_b)
    return sigmoid_gate(x, F.linear(z, w.g_w, w.g_b))


def outer_product_mean(
    a: torch.Tensor,
    b: torch.Tensor,
    mask_a: torch.Tensor,
    mask_b: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Reference outer product mean (Alg. 10 after the projections); see
    :func:`scalefold.kernels.outer_product_mean`. ``a`` ``[*, S, N1, C]``, ``b`` ``[*, S, N2, C]`` (masked),
    ``mask_a`` ``[*, S, N1, 1]``, ``mask_b`` ``[*, S, N2, 1]``, ``weight`` ``[c_z, C * C]`` -> ``[*, N1, N2, c_z]``.
    ``chunk_size`` slices the first residue axis (the outer product is made one slice at a time)."""
    a = a.transpose(-2, -3)
    b = b.transpose(-2, -3)
    # a, b: [*, N_res, N_seq, C]
    if chunk_size is None:
        outer = _project_outer(a, b, weight, bias)
    else:
        n = a.shape[-3]
        slices = [a.narrow(-3, start, min(chunk_size, n - start)) for start in range(0, n, chunk_size)]
        outer = torch.cat([_project_outer(a_, b, weight, bias) for a_ in slices], dim=-3)
    # outer: [*, N_res, N_res, c_z]
    norm = torch.einsum("...abc,...adc->...bdc", mask_a, mask_b)
    # norm: [*, N_res, N_res, 1] -- number of rows valid at both i and j
    return outer / (norm + eps)


def _project_outer(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # a: [*, I, N_seq, C], b: [*, J, N_seq, C]
    outer = torch.einsum("...bac,...dae->...bdce", a, b)
    # outer: [*, I, J, C, C]
    return F.linear(outer.reshape(outer.shape[:-2] + (a.shape[-1] * b.shape[-1],)), weight, bias)
    # [*, I, J, c_z]
