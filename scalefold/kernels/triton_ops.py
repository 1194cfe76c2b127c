"""The Triton kernels as PyTorch custom ops (``torch.ops.scalefold.*``), with autograd.

Registering them with ``torch.library.custom_op`` (plus a fake/meta implementation for shape
propagation) makes each kernel one opaque node to ``torch.compile`` (a raw Triton launch inside a
compiled region fails) and keeps it capturable in CUDA graphs. ``scalefold.kernels`` dispatches
here; nothing else should import this module directly.

Ops (canonical layouts, see each kernel module):

* ``scalefold::attention_fwd`` / ``attention_bwd`` -- ``attention_triton``;
* ``scalefold::layer_norm_fwd`` / ``layer_norm_bwd`` -- ``layer_norm_triton``;
* ``scalefold::adam_swa_`` (in place) -- ``adam_swa_triton``;
* ``scalefold::trimul_fwd`` / ``trimul_bwd`` -- ``trimul_triton`` (the fused triangle multiplication);
* ``scalefold::opm_fwd`` / ``opm_bwd`` -- ``opm_triton`` (the fused outer product mean).

Without CUDA the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here, before
any kernel is defined, unless the environment already says otherwise.

No ``from __future__ import annotations`` here: ``torch.library.custom_op`` infers each op's schema
from its annotations, and torch 2.4 (the floor, see ``pyproject.toml``) cannot read them as strings.
"""

import math
import os

import torch
from torch.utils.flop_counter import register_flop_formula

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scalefold.kernels import adam_swa_triton, attention_triton, layer_norm_triton, opm_triton, trimul_triton  # noqa: E402
from scalefold.kernels.reference import TrimulWeights, adam_step_scalars  # noqa: E402

_EMPTY = (0,)  # placeholder output for an absent gradient (custom ops cannot return None)


def _auxiliary_outputs(ctx, *aux: torch.Tensor) -> None:
    """Mark an operator's auxiliary outputs (statistics and planes saved for its backward) non-differentiable
    and stop autograd materialising the gradients nobody produced: by default each undefined output gradient
    reaches the backward formula as a full ``zeros`` tensor (a launch and its bytes per auxiliary output, every
    call), which these formulas never read. The backward formulas take ``None`` for them, and for the main
    output's gradient where it has none (returning no gradient then)."""
    ctx.mark_non_differentiable(*aux)
    ctx.set_materialize_grads(False)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("scalefold::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask_offset: torch.Tensor | None,
    gate: torch.Tensor | None,
    scale: float,
    R: int,
    C: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical-layout forward: ``(o, row_max, row_logsum)``."""
    return attention_triton.attention_forward(q, k, v, bias, mask_offset, gate, scale, R, C)


@attention_fwd.register_fake
def _(q, k, v, bias, mask_offset, gate, scale, R, C):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    stats = q.new_empty(q.shape[:-1], dtype=acc)
    return attention_triton.output_layout(q), stats, torch.empty_like(stats)


@torch.library.custom_op("scalefold::attention_bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask_offset: torch.Tensor | None,
    gate: torch.Tensor | None,
    o: torch.Tensor,
    row_max: torch.Tensor,
    row_logsum: torch.Tensor,
    scale: float,
    R: int,
    C: int,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical-layout backward: ``(dq, dk, dv, dbias, dgate)``, empty tensors for absent ones."""
    dq, dk, dv, dbias, dgate = attention_triton.attention_backward(
        do, q, k, v, bias, mask_offset, gate, o, row_max, row_logsum, scale, R, C, need_dbias
    )
    dbias = q.new_empty(_EMPTY) if dbias is None else dbias
    dgate = q.new_empty(_EMPTY) if dgate is None else dgate
    return dq, dk, dv, dbias, dgate


@attention_bwd.register_fake
def _(do, q, k, v, bias, mask_offset, gate, o, row_max, row_logsum, scale, R, C, need_dbias):
    dbias = bias.new_empty(bias.shape) if (need_dbias and bias is not None) else q.new_empty(_EMPTY)
    dgate = torch.empty_like(gate) if gate is not None else q.new_empty(_EMPTY)
    return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dgate


def _attention_setup_context(ctx, inputs, output):
    q, k, v, bias, mask_offset, gate, scale, R, C = inputs
    o, row_max, row_logsum = output
    ctx.save_for_backward(q, k, v, bias, mask_offset, gate, o, row_max, row_logsum)
    ctx.scale, ctx.R, ctx.C = scale, R, C
    _auxiliary_outputs(ctx, row_max, row_logsum)


def _attention_backward(ctx, do, _d_row_max, _d_row_logsum):
    if do is None:
        return (None,) * 9
    q, k, v, bias, mask_offset, gate, o, row_max, row_logsum = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias, dgate = attention_bwd(
        do, q, k, v, bias, mask_offset, gate, o, row_max, row_logsum, ctx.scale, ctx.R, ctx.C, need_dbias
    )
    return (
        dq, dk, dv,
        dbias if need_dbias else None,
        None,
        dgate if gate is not None else None,
        None, None, None,
    )  # fmt: skip


torch.library.register_autograd("scalefold::attention_fwd", _attention_backward, setup_context=_attention_setup_context)


def _mask_offset(
    mask: torch.Tensor, batch: tuple[int, ...], tail: tuple[int, int, int], inf: float, dtype: torch.dtype
) -> torch.Tensor:
    """``(mask - 1) * inf`` as ``[Z, Hm, NQm, NKm]`` (the mask's own size-1 dims kept)."""
    ndim = len(batch) + 3
    if mask.dim() > ndim:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {batch + tail}")
    mask = mask.reshape((1,) * (ndim - mask.dim()) + tuple(mask.shape))
    mask_tail = tuple(mask.shape[len(batch) :])
    # contiguous: a unit key stride is specialised by Triton (vector loads, fewer registers); the ending-node
    # triangle attention passes its transposed mask, which the cast lays out contiguous (no extra copy). The
    # offset is made on the mask's own shape, then broadcast over the batch (a copy only where that needs one).
    offset = (mask.to(dtype, memory_format=torch.contiguous_format) - 1.0) * inf
    return offset.expand(tuple(batch) + mask_tail).reshape((math.prod(batch),) + mask_tail).contiguous()


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
    """Triton gated attention with pair bias; semantics of :func:`scalefold.kernels.attention`."""
    *batch, H, NQ, D = q.shape
    batch = tuple(batch)
    NK = k.shape[-2]
    Z = math.prod(batch)
    if scale is None:
        scale = 1.0 / math.sqrt(D)

    def canon(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.expand(batch + (H, n, D)).reshape(Z, H, n, D)

    q4, k4, v4 = canon(q, NQ), canon(k, NK), canon(v, NK)
    g4 = canon(gate, NQ) if gate is not None else None
    R = C = 1
    bias5 = None
    if bias is not None:
        bias5, R, C = attention_triton.canonical_bias(bias, batch, (H, NQ, NK))
        # the model's bias is [*, N, N, H] moved to [*, H, N, N] (key stride H); one small copy makes
        # the key stride 1, which Triton specialises (vector loads instead of a 64-bit address per
        # element: the attention kernels spilled registers at the MLPerf shapes without it). A bias
        # broadcast over the batch (stride 0) is left alone: the copy would materialise it.
        if bias5.stride(-1) != 1 and all(st != 0 or n == 1 for n, st in zip(bias5.shape, bias5.stride())):
            bias5 = bias5.contiguous()
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    offset = _mask_offset(mask, batch, (H, NQ, NK), inf, acc) if mask is not None else None
    o, _, _ = attention_fwd(q4, k4, v4, bias5, offset, g4, float(scale), R, C)
    return o.reshape(batch + (H, NQ, D))


# ----------------------------------------------------------------------------------------------
# LayerNorm
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("scalefold::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, C]`` -> ``(y, mean, rstd)``."""
    return layer_norm_triton.layer_norm_forward(x, weight, bias, eps)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    stats = x.new_empty(x.shape[:1], dtype=acc)
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


@torch.library.custom_op("scalefold::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``."""
    return layer_norm_triton.layer_norm_backward(dy.contiguous(), x, weight, mean, rstd)


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, _bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    _auxiliary_outputs(ctx, mean, rstd)


def _layer_norm_backward(ctx, dy, _d_mean, _d_rstd):
    if dy is None:
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_bwd(dy, x, weight, mean, rstd)
    return dx, dweight, dbias, None


torch.library.register_autograd(
    "scalefold::layer_norm_fwd", _layer_norm_backward, setup_context=_layer_norm_setup_context
)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Triton LayerNorm over the last dimension; semantics of :func:`scalefold.kernels.layer_norm`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y, _, _ = layer_norm_fwd(x2, weight, bias, float(eps))
    return y.reshape(shape)


# ----------------------------------------------------------------------------------------------
# Adam + SWA
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("scalefold::adam_swa_", mutates_args=("param", "exp_avg", "exp_avg_sq", "swa", "compute"))
def adam_swa_op(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    swa: torch.Tensor,
    compute: torch.Tensor | None,
    clip_scale: torch.Tensor | None,
    neg_step_size: torch.Tensor,
    bias_correction2_sqrt: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    swa_decay: float,
    swa_copy: bool,
) -> None:
    adam_swa_triton.adam_swa_launch(
        param, grad, exp_avg, exp_avg_sq, swa, compute, clip_scale, neg_step_size, bias_correction2_sqrt,
        beta1, beta2, eps, swa_decay, swa_copy,
    )  # fmt: skip


@adam_swa_op.register_fake
def _(param, grad, exp_avg, exp_avg_sq, swa, compute, clip_scale, neg_step_size, bias_correction2_sqrt,
      beta1, beta2, eps, swa_decay, swa_copy):  # fmt: skip
    return None


def adam_swa_update_(
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
    """Fused Adam + SWA step on flat 1-D buffers; semantics of :func:`scalefold.kernels.adam_swa_`.

    (Called by :func:`scalefold.kernels.adam_swa_`, the one dispatch point the flat optimizer steps through.)
    """
    for t in (param, grad, exp_avg, exp_avg_sq, swa) + ((compute,) if compute is not None else ()):
        if not t.is_contiguous() or t.numel() != param.numel():
            raise ValueError("adam_swa_update_ expects contiguous flat buffers of equal length")
    neg_step_size, bias_correction2_sqrt = adam_step_scalars(lr, step, beta1, beta2)
    adam_swa_op(
        param, grad, exp_avg, exp_avg_sq, swa, compute, clip_scale, neg_step_size, bias_correction2_sqrt,
        float(beta1), float(beta2), float(eps), float(swa_decay), swa_n_averaged == 0,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Triangle multiplication
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("scalefold::trimul_fwd", mutates_args=())
def trimul_fwd(
    z: torch.Tensor,
    mask: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor,
    ln_in_w: torch.Tensor,
    ln_in_b: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
    ln_out_w: torch.Tensor,
    ln_out_b: torch.Tensor,
    eps_in: float,
    eps_out: float,
    n: int,
    outgoing: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``z`` ``[M, c_z]`` -> ``(out [M, c_z], a, b, x [B, C, N, N], g [M, c_z], LN(z) [M, c_z], mean, rstd,
    mean_x, rstd_x)`` in the compute dtype (``w_in``'s)."""
    a, b, g, zn, mean, rstd = trimul_triton.input_forward(
        z, mask, w_in, b_in, ln_in_w, ln_in_b, eps_in, n, w_in.dtype
    )
    x = trimul_triton.product(a, b, outgoing)
    out, mean_x, rstd_x = trimul_triton.output_forward(x, ln_out_w, ln_out_b, w_out, b_out, g, eps_out)
    return out, a, b, x, g, zn, mean, rstd, mean_x, rstd_x


@trimul_fwd.register_fake
def _(z, mask, w_in, b_in, ln_in_w, ln_in_b, w_out, b_out, ln_out_w, ln_out_b, eps_in, eps_out, n, outgoing):
    M, CZ = z.shape
    C = w_out.shape[1]
    acc = torch.float64 if w_in.dtype == torch.float64 else torch.float32
    planes = z.new_empty((M // (n * n), C, n, n), dtype=w_in.dtype)
    stats = z.new_empty((M,), dtype=acc)
    out = z.new_empty((M, CZ), dtype=w_in.dtype)
    return (out, planes, torch.empty_like(planes), torch.empty_like(planes), torch.empty_like(out),
            torch.empty_like(out), stats, torch.empty_like(stats), torch.empty_like(stats),
            torch.empty_like(stats))  # fmt: skip


@torch.library.custom_op("scalefold::trimul_bwd", mutates_args=())
def trimul_bwd(
    dout: torch.Tensor,
    out: torch.Tensor,
    z: torch.Tensor,
    mask: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor,
    ln_in_w: torch.Tensor,
    w_out: torch.Tensor,
    ln_out_w: torch.Tensor,
    ln_out_b: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    x: torch.Tensor,
    g: torch.Tensor,
    zn: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    mean_x: torch.Tensor,
    rstd_x: torch.Tensor,
    n: int,
    outgoing: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dz, dw_in, db_in, dln_in_w, dln_in_b, dw_out, db_out, dln_out_w, dln_out_b)``: the output kernel
    (``dy``, ``dg``, ``dx`` through the output LayerNorm), the product's two batched matmuls, the gates
    (recomputed), the weight gradients as matmuls and the input LayerNorm's backward kernel."""
    dproj = torch.empty((z.shape[0], w_in.shape[0]), dtype=w_in.dtype, device=z.device)
    dy, xn, dx, dln_out_w, dln_out_b, dg_sum, db_out = trimul_triton.output_backward(
        dout.contiguous(), out, x, ln_out_w, ln_out_b, w_out, g, mean_x, rstd_x, dproj
    )
    da, db = trimul_triton.product_backward(dx, a, b, outgoing)
    del dx
    db_in = torch.cat([trimul_triton.gates_backward(zn, mask, w_in, b_in, da, db, dproj, n), dg_sum])
    del da, db
    dz, dln_in_w, dln_in_b = layer_norm_triton.layer_norm_backward(torch.matmul(dproj, w_in), z, ln_in_w, mean, rstd)
    dw_in, dw_out = torch.matmul(dproj.mT, zn), torch.matmul(dy.mT, xn)
    return dz, dw_in, db_in.to(b_in.dtype), dln_in_w, dln_in_b, dw_out, db_out.to(w_out.dtype), dln_out_w, dln_out_b


@trimul_bwd.register_fake
def _(dout, out, z, mask, w_in, b_in, ln_in_w, w_out, ln_out_w, ln_out_b, a, b, x, g, zn, mean, rstd,
      mean_x, rstd_x, n, outgoing):  # fmt: skip
    cz = w_out.shape[0]
    return (z.new_empty(z.shape), w_in.new_empty(w_in.shape), b_in.new_empty(b_in.shape), ln_in_w.new_empty(cz),
            ln_in_w.new_empty(cz), w_out.new_empty(w_out.shape), w_out.new_empty(cz), ln_out_w.new_empty(ln_out_w.shape),
            ln_out_b.new_empty(ln_out_b.shape))  # fmt: skip


def _trimul_setup_context(ctx, inputs, output):
    z, mask, w_in, b_in, ln_in_w, _, w_out, _, ln_out_w, ln_out_b, _, _, n, outgoing = inputs
    out, a, b, x, g, zn, mean, rstd, mean_x, rstd_x = output
    ctx.save_for_backward(out, z, mask, w_in, b_in, ln_in_w, w_out, ln_out_w, ln_out_b, a, b, x, g, zn,
                          mean, rstd, mean_x, rstd_x)  # fmt: skip
    ctx.n, ctx.outgoing = n, outgoing
    _auxiliary_outputs(ctx, a, b, x, g, zn, mean, rstd, mean_x, rstd_x)


def _trimul_backward(ctx, dout, *_unused):
    if dout is None:
        return (None,) * 14
    out, *saved = ctx.saved_tensors
    grads = trimul_bwd(dout, out, *saved, ctx.n, ctx.outgoing)
    dz, dw_in, db_in, dln_in_w, dln_in_b, dw_out, db_out, dln_out_w, dln_out_b = grads
    return dz, None, dw_in, db_in, dln_in_w, dln_in_b, dw_out, db_out, dln_out_w, dln_out_b, None, None, None, None


torch.library.register_autograd("scalefold::trimul_fwd", _trimul_backward, setup_context=_trimul_setup_context)


def _trimul_model_flops(z_shape, w_in_shape, w_out_shape, n: int) -> int:
    """Matrix FLOPs of a triangle multiplication's forward as the PyTorch path runs them: the five input
    projections, the product over the third edge and the output projection."""
    rows, cz = z_shape
    c = w_out_shape[1]
    return 2 * rows * cz * w_in_shape[0] + 2 * (rows // (n * n)) * c * n**3 + 2 * rows * c * cz


# The kernels' FLOPs for torch.utils.flop_counter (and ``scalefold estimate-step``, which reads its registry):
# the forward's products, and twice those for the backward (each product's two gradients). The backward
# also recomputes the four gate projections (2 M c_z 4C, one matmul): a recomputation, not counted here.
@register_flop_formula(torch.ops.scalefold.trimul_fwd)
def _(z, mask, w_in, *args, out_shape=None, **kwargs) -> int:
    w_out, n = args[3], args[9]
    return _trimul_model_flops(z, w_in, w_out, n)


@register_flop_formula(torch.ops.scalefold.trimul_bwd)
def _(dout, out, z, mask, w_in, *args, out_shape=None, **kwargs) -> int:
    w_out, n = args[2], args[14]
    return 2 * _trimul_model_flops(z, w_in, w_out, n)


def _compute_dtype(z: torch.Tensor) -> torch.dtype:
    """The dtype the projections and the product run in: autocast's (bf16 training) for fp32 ``z``,
    else ``z``'s own."""
    device = z.device.type
    if z.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return z.dtype


def triangle_multiplication(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    w: TrimulWeights,
    outgoing: bool,
    eps_in: float = 1e-5,
    eps_out: float = 1e-5,
) -> torch.Tensor:
    """Fused triangle multiplication; semantics of :func:`scalefold.kernels.triangle_multiplication`
    (the mask gets no gradient)."""
    *lead, n, n2, cz = z.shape
    if n != n2:
        raise ValueError(f"triangle multiplication expects a square pair [*, N, N, c_z], got {tuple(z.shape)}")
    lead = tuple(lead)
    dtype = _compute_dtype(z)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    m = z.new_ones(()) if mask is None else mask
    m = m.detach().to(acc).expand(lead + (n, n)).reshape(-1).contiguous()
    z2 = z.reshape(-1, cz).contiguous()
    w_in = torch.cat([w.a_p_w, w.a_g_w, w.b_p_w, w.b_g_w, w.g_w]).to(dtype)
    b_in = torch.cat([w.a_p_b, w.a_g_b, w.b_p_b, w.b_g_b, w.g_b]).to(dtype)
    out = trimul_fwd(z2, m, w_in, b_in, w.ln_in_w, w.ln_in_b, w.z_w.to(dtype).contiguous(), w.z_b.to(dtype),
                     w.ln_out_w, w.ln_out_b, float(eps_in), float(eps_out), n, bool(outgoing))[0]  # fmt: skip
    return out.reshape(lead + (n, n, cz))


# ----------------------------------------------------------------------------------------------
# Outer product mean
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("scalefold::opm_fwd", mutates_args=())
def opm_fwd(
    a: torch.Tensor,
    b: torch.Tensor,
    mask_a: torch.Tensor,
    mask_b: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` ``[B, S, N1, C]``, ``b`` ``[B, S, N2, C]``, masks ``[B, S, N*]`` -> ``(out [B, N1, N2, c_z],
    den [B, N1, N2])`` (``den``: the mean's normaliser plus eps, kept for the backward)."""
    return opm_triton.forward(a, b, mask_a, mask_b, weight, bias, eps)


@opm_fwd.register_fake
def _(a, b, mask_a, mask_b, weight, bias, eps):
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    shape = (a.shape[0], a.shape[2], b.shape[2])
    return a.new_empty(shape + (weight.shape[0],)), a.new_empty(shape, dtype=acc)


@torch.library.custom_op("scalefold::opm_bwd", mutates_args=())
def opm_bwd(
    dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, den: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, dweight, dbias)``: two launches of the input-gradient kernel and the weight's."""
    return opm_triton.backward(dout.contiguous(), a, b, weight, den)


@opm_bwd.register_fake
def _(dout, a, b, weight, den):
    return a.new_empty(a.shape), b.new_empty(b.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[:1])


def _opm_setup_context(ctx, inputs, output):
    a, b, _mask_a, _mask_b, weight, _bias, _eps = inputs
    ctx.save_for_backward(a, b, weight, output[1])
    _auxiliary_outputs(ctx, output[1])


def _opm_backward(ctx, dout, _d_den):
    if dout is None:
        return (None,) * 7
    da, db, dweight, dbias = opm_bwd(dout, *ctx.saved_tensors)
    return da, db, None, None, dweight, dbias, None


torch.library.register_autograd("scalefold::opm_fwd", _opm_backward, setup_context=_opm_setup_context)


def _opm_model_flops(a_shape, b_shape, weight_shape) -> int:
    """Matrix FLOPs of an outer product mean's forward as the PyTorch path runs them, less the normaliser: the
    outer product (an einsum over the MSA rows) and the output projection (what has a gradient)."""
    nb, s, n1, c = a_shape
    n2, cz = b_shape[2], weight_shape[0]
    return 2 * nb * n1 * n2 * c * c * (s + cz)


def _opm_norm_flops(a_shape, b_shape) -> int:
    """The mean's normaliser ``sum_s mask_si mask_sj``: the PyTorch path's einsum of the masks (a batched
    matmul, ``2 B N1 N2 S``); the kernel's epilogue does the same multiply-adds. Forward only (no gradient)."""
    nb, s, n1, _ = a_shape
    return 2 * nb * n1 * b_shape[2] * s


# Forward: the model's products (the normaliser's included, so that model FLOPs are the same on both kernel
# paths); backward: twice the products with a gradient (each product's two gradients; the masks have none).
# The backward's kernels also recompute the outer product (for the weight's gradient) and its gradient (once
# per block of 128 MSA rows, in each of the two input-gradient launches): recomputation, not counted here.
@register_flop_formula(torch.ops.scalefold.opm_fwd)
def _(a, b, mask_a, mask_b, weight, *args, out_shape=None, **kwargs) -> int:
    return _opm_model_flops(a, b, weight) + _opm_norm_flops(a, b)


@register_flop_formula(torch.ops.scalefold.opm_bwd)
def _(dout, a, b, weight, den, *args, out_shape=None, **kwargs) -> int:
    return 2 * _opm_model_flops(a, b, weight)


def outer_product_unsupported(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`outer_product_mean` does not take these operands (one line naming the limit), or None."""
    return opm_triton.unsupported(a, b, weight, _compute_dtype(a))


def outer_product_mean(
    a: torch.Tensor,
    b: torch.Tensor,
    mask_a: torch.Tensor,
    mask_b: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Fused outer product mean; semantics of :func:`scalefold.kernels.outer_product_mean` (the masks get no
    gradient)."""
    *lead, s, n1, c = a.shape
    lead = tuple(lead)
    n2 = b.shape[-2]
    dtype = _compute_dtype(a)
    acc = torch.float64 if dtype == torch.float64 else torch.float32

    def flat(t: torch.Tensor, n: int, tail: tuple[int, ...]) -> torch.Tensor:
        return t.expand(lead + (s, n) + tail).reshape((-1, s, n) + tail)

    a4, b4 = flat(a.to(dtype), n1, (c,)), flat(b.to(dtype), n2, (c,))
    ma = flat(mask_a.detach().to(acc).reshape(mask_a.shape[:-1]), n1, ()).contiguous()
    mb = flat(mask_b.detach().to(acc).reshape(mask_b.shape[:-1]), n2, ()).contiguous()
    out, _ = opm_fwd(a4, b4, ma, mb, weight.to(dtype).contiguous(), bias.to(dtype), float(eps))
    return out.reshape(lead + out.shape[1:])


__all__ = ["adam_swa_update_", "attention", "layer_norm", "outer_product_mean", "triangle_multiplication"]
