"""Triton kernels: the fused triangle multiplication (Supplementary Alg. 11 / 12), forward and backward.

Rows are the ``M = B * N * N`` pair positions ``(b, p, q)`` of ``z`` ``[B, N, N, c_z]`` (row-major);
the hidden tensors ``a``, ``b``, ``x`` are *channel-major*, ``[B, C, N, N]``: each channel a plane in
the pair's own layout, so the product over the third edge is one batched matmul over ``B * C``
(``torch.matmul``: bf16 in, fp32 accumulate).

Forward, two kernels around the product:

* ``_in_fwd``: LayerNorm of a tile of ``z`` rows (statistics in fp32, fp64 for fp64), the five input
  projections as ``tl.dot`` against the concatenated weight ``[4C + c_z, c_z]`` (``a_p``, ``a_g``,
  ``b_p``, ``b_g``, ``g``), the gates ``a = sigmoid(a_g) * mask * a_p`` (same for ``b``) written
  channel-major, the output gate's logits ``g`` ``[M, c_z]`` and ``LN(z)`` (for the backward's matmuls);
* ``_out_fwd``: LayerNorm over the channels of the product ``x`` (read channel-major), the output
  projection as ``tl.dot`` and the gate ``out = y * sigmoid(g)``.

Backward:

* ``_out_bwd``: ``dy = dout * sigmoid(g)``, the gate's ``dg = dout * out * (1 - sigmoid(g))`` (from the
  saved output: ``y`` is not recomputed), ``dLN(x) = dy @ W_z`` accumulated over column blocks, ``dx``
  through the LayerNorm (channel-major), ``LN(x)`` for the weight gradient, and per-program partial sums
  (the LayerNorm's weight and bias, the output and gate biases: summed in a fixed order after --
  deterministic, no atomics);
* the product's gradients: two batched matmuls;
* ``_gates_bwd``: the four gate projections recomputed from the saved ``LN(z)`` by ``tl.dot`` (the gates
  are not stored) and differentiated, with their biases' partial sums;
* ``dLN(z) = d(proj) @ W_in`` and the weight gradients as matmuls; the input LayerNorm's backward is
  ``layer_norm_triton``'s.

Dots take the compute dtype's operands (bf16/fp16 on tensor cores; fp32 exactly, or as TF32 where
PyTorch allows TF32 matmuls; fp64 exactly) and accumulate in fp32 (fp64 for fp64). Fusing the
backward's ``dLN(z)`` into the gates' kernel as well held LN(z), its accumulator and eight dots' tiles in
registers: it spilled at c_z 128 on sm_90 for every tile of 32 rows or more, so that product and the weight
gradients are cuBLAS matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalefold.kernels import autotune


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _proj(xn, W, BIAS, cols, cols_ok, k, k_ok, K, ACC: tl.constexpr, PREC: tl.constexpr):
    """``xn @ W[cols, :]^T + BIAS[cols]`` with ``W`` ``[out, K]`` row-major; ``xn`` ``[ROWS, BLOCK_K]``."""
    w = tl.load(W + cols[None, :] * K + k[:, None], mask=cols_ok[None, :] & k_ok[:, None], other=0.0)
    acc = tl.dot(xn, w.to(xn.dtype), input_precision=PREC, out_dtype=ACC)
    return acc + tl.load(BIAS + cols, mask=cols_ok, other=0.0).to(ACC)[None, :]


@triton.jit
def _back(acc, dv, W, cols, cols_ok, k, k_ok, K, DOT: tl.constexpr, PREC: tl.constexpr):
    """``acc + dv @ W[cols, :]``: the gradient of :func:`_proj`'s input; ``dv`` ``[ROWS, BLOCK]`` (``acc``
    is the dot's accumulator, not a second tile)."""
    w = tl.load(W + cols[:, None] * K + k[None, :], mask=cols_ok[:, None] & k_ok[None, :], other=0.0)
    return tl.dot(dv.to(DOT), w.to(DOT), acc, input_precision=PREC)


@triton.jit
def _norm_rows(x, io_mask, K, eps):
    """``(x - mean) * rstd`` over axis 1 (masked entries 0), with ``mean`` and ``rstd``."""
    mean = tl.sum(x, 1) / K
    xc = tl.where(io_mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / K + eps)
    return xc * rstd[:, None], mean, rstd


@triton.jit
def _ln_backward(dxn, xhat, w, rstd, K):
    """LayerNorm's input gradient from the gradient of its output ``dxn``."""
    wdy = w[None, :] * dxn
    c1 = tl.sum(xhat * wdy, 1) / K
    c2 = tl.sum(wdy, 1) / K
    return (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def _in_fwd(
    Z, MASK, W, BIAS, LN_W, LN_B, A, B, G, ZN, MEAN, RSTD,
    M, NN, CZ, C, eps,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    k = tl.arange(0, BLOCK_K)
    k_ok = k < CZ
    io = row_ok[:, None] & k_ok[None, :]
    z = tl.load(Z + rows[:, None] * CZ + k[None, :], mask=io, other=0.0).to(ACC)
    zhat, mean, rstd = _norm_rows(z, io, CZ, eps)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    lw = tl.load(LN_W + k, mask=k_ok, other=0.0).to(ACC)
    lb = tl.load(LN_B + k, mask=k_ok, other=0.0).to(ACC)
    zn = tl.where(io, zhat * lw[None, :] + lb[None, :], 0.0).to(DOT)
    tl.store(ZN + rows[:, None] * CZ + k[None, :], zn, mask=io)  # kept for the backward's matmuls
    m = tl.load(MASK + rows, mask=row_ok, other=0.0).to(ACC)[:, None]
    batch = rows // NN
    plane = batch * C * NN + (rows - batch * NN)  # channel-major offset of channel 0
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        c_ok = cols < C
        out = plane[:, None] + cols[None, :].to(tl.int64) * NN
        o_ok = row_ok[:, None] & c_ok[None, :]
        a = _proj(zn, W, BIAS, cols, c_ok, k, k_ok, CZ, ACC, PREC) * m
        a = a * _sigmoid(_proj(zn, W, BIAS, C + cols, c_ok, k, k_ok, CZ, ACC, PREC))
        tl.store(A + out, a.to(A.dtype.element_ty), mask=o_ok)
        b = _proj(zn, W, BIAS, 2 * C + cols, c_ok, k, k_ok, CZ, ACC, PREC) * m
        b = b * _sigmoid(_proj(zn, W, BIAS, 3 * C + cols, c_ok, k, k_ok, CZ, ACC, PREC))
        tl.store(B + out, b.to(B.dtype.element_ty), mask=o_ok)
    for n0 in range(0, CZ, BLOCK_C):
        cols = n0 + tl.arange(0, BLOCK_C)
        c_ok = cols < CZ
        g = _proj(zn, W, BIAS, 4 * C + cols, c_ok, k, k_ok, CZ, ACC, PREC)
        tl.store(G + rows[:, None] * CZ + cols[None, :], g.to(G.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


@triton.jit
def _load_x(X, rows, row_ok, h, h_ok, NN, C, LN_W, LN_B, ACC: tl.constexpr):
    """A tile of the product ``x`` (channel-major) as rows ``[ROWS, BLOCK_H]``; ``h`` the channels."""
    batch = rows // NN
    offs = (batch * C * NN + (rows - batch * NN))[:, None] + h[None, :].to(tl.int64) * NN
    io = row_ok[:, None] & h_ok[None, :]
    lw = tl.load(LN_W + h, mask=h_ok, other=0.0).to(ACC)
    lb = tl.load(LN_B + h, mask=h_ok, other=0.0).to(ACC)
    return tl.load(X + offs, mask=io, other=0.0).to(ACC), offs, io, lw, lb


@triton.jit
def _out_fwd(
    X, LN_W, LN_B, W, BIAS, G, OUT, MEAN, RSTD,
    M, NN, C, CZ, eps,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    h = tl.arange(0, BLOCK_H)
    h_ok = h < C
    x, _, io, lw, lb = _load_x(X, rows, row_ok, h, h_ok, NN, C, LN_W, LN_B, ACC)
    xhat, mean, rstd = _norm_rows(x, io, C, eps)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    xn = tl.where(io, xhat * lw[None, :] + lb[None, :], 0.0).to(DOT)
    for n0 in range(0, CZ, BLOCK_C):
        cols = n0 + tl.arange(0, BLOCK_C)
        c_ok = cols < CZ
        o_ok = row_ok[:, None] & c_ok[None, :]
        y = _proj(xn, W, BIAS, cols, c_ok, h, h_ok, C, ACC, PREC)
        offs = rows[:, None] * CZ + cols[None, :]
        g = tl.load(G + offs, mask=o_ok, other=0.0).to(ACC)
        tl.store(OUT + offs, (y * _sigmoid(g)).to(OUT.dtype.element_ty), mask=o_ok)


@triton.jit
def _out_bwd(
    DOUT, OUT, X, LN_W, LN_B, W, G, MEAN, RSTD, DY, XN, DPROJ, DX, DW_PART, DB_PART, DG_PART, DYB_PART,
    M, NN, C, CZ, DPROJ_STRIDE,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    h = tl.arange(0, BLOCK_H)
    h_ok = h < C
    # the gate's gradient from the output itself (out = y * s, so y * s * (1 - s) = out * (1 - s)): y is
    # not recomputed, and LN(x) is not held in registers through the loop
    dxn = tl.zeros([ROWS, BLOCK_H], ACC)
    for n0 in range(0, CZ, BLOCK_C):
        cols = n0 + tl.arange(0, BLOCK_C)
        c_ok = cols < CZ
        o_ok = row_ok[:, None] & c_ok[None, :]
        offs = rows[:, None] * CZ + cols[None, :]
        s = _sigmoid(tl.load(G + offs, mask=o_ok, other=0.0).to(ACC))
        do = tl.load(DOUT + offs, mask=o_ok, other=0.0).to(ACC)
        dy = do * s
        tl.store(DY + offs, dy.to(DOT), mask=o_ok)
        tl.store(DYB_PART + pid * CZ + cols, tl.sum(dy, 0), mask=c_ok)  # the output bias's gradient, partial
        dg = do * tl.load(OUT + offs, mask=o_ok, other=0.0).to(ACC) * (1.0 - s)
        tl.store(DPROJ + rows[:, None] * DPROJ_STRIDE + 4 * C + cols[None, :], dg.to(DPROJ.dtype.element_ty), mask=o_ok)
        tl.store(DG_PART + pid * CZ + cols, tl.sum(dg, 0), mask=c_ok)
        dxn = _back(dxn, dy, W, cols, c_ok, h, h_ok, C, DOT, PREC)
    x, x_offs, io, lw, lb = _load_x(X, rows, row_ok, h, h_ok, NN, C, LN_W, LN_B, ACC)
    mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    xhat = tl.where(io, (x - mean[:, None]) * rstd[:, None], 0.0)
    tl.store(XN + rows[:, None] * C + h[None, :], (xhat * lw[None, :] + lb[None, :]).to(XN.dtype.element_ty), mask=io)
    dx = _ln_backward(dxn, xhat, lw, rstd, C)
    tl.store(DX + x_offs, dx.to(DX.dtype.element_ty), mask=io)
    tl.store(DW_PART + pid * C + h, tl.sum(dxn * xhat, 0), mask=h_ok)
    tl.store(DB_PART + pid * C + h, tl.sum(dxn, 0), mask=h_ok)


@triton.jit
def _gates_bwd(
    ZN, MASK, W, BIAS, DA, DB, DPROJ, DBIAS_PART, M, NN, CZ, C, DPROJ_STRIDE,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``d(a_p), d(a_g), d(b_p), d(b_g)`` (``DPROJ[:, :4C]``) with per-program partial sums of each (the
    biases' gradients): the projections recomputed from the saved ``LN(z)`` (``tl.dot``, as the forward),
    ``da``, ``db`` read channel-major."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    k = tl.arange(0, BLOCK_K)
    k_ok = k < CZ
    zn = tl.load(ZN + rows[:, None] * CZ + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
    m = tl.load(MASK + rows, mask=row_ok, other=0.0).to(ACC)[:, None]
    batch = rows // NN
    plane = batch * C * NN + (rows - batch * NN)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        c_ok = cols < C
        o_ok = row_ok[:, None] & c_ok[None, :]
        cm = plane[:, None] + cols[None, :].to(tl.int64) * NN
        for which in tl.static_range(2):
            off = which * 2 * C
            p = _proj(zn, W, BIAS, off + cols, c_ok, k, k_ok, CZ, ACC, PREC)
            s = _sigmoid(_proj(zn, W, BIAS, off + C + cols, c_ok, k, k_ok, CZ, ACC, PREC))
            if which == 0:
                d = tl.load(DA + cm, mask=o_ok, other=0.0).to(ACC) * m
            else:
                d = tl.load(DB + cm, mask=o_ok, other=0.0).to(ACC) * m
            dp = d * s
            dgate = d * p * s * (1.0 - s)
            base = rows[:, None] * DPROJ_STRIDE + off + cols[None, :]
            tl.store(DPROJ + base, dp.to(DPROJ.dtype.element_ty), mask=o_ok)
            tl.store(DPROJ + base + C, dgate.to(DPROJ.dtype.element_ty), mask=o_ok)
            tl.store(DBIAS_PART + pid * 4 * C + off + cols, tl.sum(dp, 0), mask=c_ok)
            tl.store(DBIAS_PART + pid * 4 * C + off + C + cols, tl.sum(dgate, 0), mask=c_ok)


# Candidate launch configs (autotune.Tuner's lists; the first is the default, launched where the
# launch-config table has no entry): rows per program and the width of the output-column blocks. The
# whole LayerNorm'd row (c_z or C wide) stays in registers beside one block of each projection. Compiled
# for sm_90 (Triton 3.9, bf16, c_z = C = 128; bench/RESULTS.md): 128-row forward tiles on 8 warps use
# 125-136 registers, no spills; the output backward (the dLN(x) accumulator and the LayerNorm's backward
# over a whole row) spilled with 64 rows or more on 4-16 warps, not with 32 rows on 4 warps (166 registers).
TRIMUL_CONFIGS = {
    "trimul_in_fwd": [
        {"ROWS": 128, "BLOCK_C": 32, "num_warps": 8, "num_stages": 1},
        {"ROWS": 64, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
        {"ROWS": 128, "BLOCK_C": 16, "num_warps": 8, "num_stages": 1},
        {"ROWS": 128, "BLOCK_C": 64, "num_warps": 8, "num_stages": 1},
        {"ROWS": 256, "BLOCK_C": 32, "num_warps": 16, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
    ],
    "trimul_out_fwd": [
        {"ROWS": 128, "BLOCK_C": 32, "num_warps": 8, "num_stages": 1},
        {"ROWS": 64, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
        {"ROWS": 128, "BLOCK_C": 16, "num_warps": 8, "num_stages": 1},
        {"ROWS": 128, "BLOCK_C": 64, "num_warps": 8, "num_stages": 1},
        {"ROWS": 128, "BLOCK_C": 32, "num_warps": 16, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
    ],
    "trimul_out_bwd": [
        {"ROWS": 32, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
        {"ROWS": 16, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 16, "num_warps": 4, "num_stages": 1},
        {"ROWS": 64, "BLOCK_C": 32, "num_warps": 8, "num_stages": 1},
    ],
    "trimul_gates_bwd": [
        {"ROWS": 128, "BLOCK_C": 32, "num_warps": 8, "num_stages": 1},
        {"ROWS": 64, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
        {"ROWS": 128, "BLOCK_C": 16, "num_warps": 8, "num_stages": 1},
        {"ROWS": 64, "BLOCK_C": 16, "num_warps": 4, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
    ],
}
# Exact fp32/fp64 dots (CUDA cores, the whole K extent of each operand tile in every thread's registers)
# have their own tuners ("<kernel>_exact"), as the attention kernels do: the 128-row forward tiles spilled
# kilobytes in fp32 on sm_90, and the input kernel spilled 200-800 B at c_z 128 with 16-64 rows on 2, 4 or
# 16 warps -- not with 16 rows on 8 warps (178 registers). The gates' backward recomputes the same
# projections: the input kernel's list.
TRIMUL_EXACT_CONFIGS = {
    "trimul_in_fwd": [
        {"ROWS": 16, "BLOCK_C": 16, "num_warps": 8, "num_stages": 1},
        {"ROWS": 16, "BLOCK_C": 16, "num_warps": 4, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 16, "num_warps": 8, "num_stages": 1},
    ],
    "trimul_out_fwd": [
        {"ROWS": 64, "BLOCK_C": 16, "num_warps": 8, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 16, "num_warps": 4, "num_stages": 1},
        {"ROWS": 16, "BLOCK_C": 16, "num_warps": 4, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
    ],
    "trimul_out_bwd": [
        {"ROWS": 32, "BLOCK_C": 16, "num_warps": 8, "num_stages": 1},
        {"ROWS": 16, "BLOCK_C": 16, "num_warps": 4, "num_stages": 1},
        {"ROWS": 16, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
        {"ROWS": 32, "BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
    ],
}
TRIMUL_EXACT_CONFIGS["trimul_gates_bwd"] = [dict(c) for c in TRIMUL_EXACT_CONFIGS["trimul_in_fwd"]]
# Interpreter (CPU): few programs (each costs milliseconds); 16-wide column blocks, so the test shapes
# (32 channels) run the column loops more than once.
INTERPRETER_CONFIG = {"ROWS": 64, "BLOCK_C": 16, "num_warps": 1, "num_stages": 1}


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s operand precision: exact for fp64, and for fp32 unless PyTorch allows TF32 matmuls."""
    if dtype == torch.float64 or (dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _acc(dtype: torch.dtype):
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


_TL = {torch.float64: tl.float64, torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def shape_key(cz: int, c: int, m: int) -> dict:
    """The shape class of a call: ``c_z``, ``c_hidden`` and the rows bucketed to a power of two."""
    return dict(CZ=cz, C=c, M=autotune.size_class(m))


def _launch(name: str, cz: int, c: int, m: int, like: torch.Tensor, launch) -> dict:
    """Launch kernel ``name`` with its config for this shape class (the launch-config table's, or timed with
    ``SCALEFOLD_AUTOTUNE=1``): exact dots have their own tuner (``<name>_exact``), fp32 with TF32 dots the
    dtype label ``tf32``."""
    precision = dot_precision(like.dtype)
    label = "tf32" if like.dtype == torch.float32 and precision == "tf32" else None
    key = autotune.make_key(shape_key(cz, c, m), like, label)
    if precision == "ieee" and name in TRIMUL_EXACT_CONFIGS:
        return autotune.get_tuner(f"{name}_exact", TRIMUL_EXACT_CONFIGS[name], INTERPRETER_CONFIG).run(key, launch)
    return autotune.get_tuner(name, TRIMUL_CONFIGS[name], INTERPRETER_CONFIG).run(key, launch)


def _consts(dtype: torch.dtype, cfg: dict) -> dict:
    return dict(ACC=_acc(dtype)[0], DOT=_TL[dtype], PREC=dot_precision(dtype), ROWS=cfg["ROWS"],
                BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip


def input_forward(z, mask, w_in, b_in, ln_w, ln_b, eps: float, n: int, dtype: torch.dtype):
    """``z`` ``[M, c_z]`` -> ``(a, b [B, C, N, N] channel-major, g [M, c_z], LN(z) [M, c_z], mean, rstd [M])``."""
    M, CZ = z.shape
    C = (w_in.shape[0] - CZ) // 4
    acc = _acc(dtype)[1]
    a = torch.empty((M // (n * n), C, n, n), dtype=dtype, device=z.device)
    b = torch.empty_like(a)
    g = torch.empty((M, CZ), dtype=dtype, device=z.device)
    zn = torch.empty_like(g)
    mean = torch.empty(M, dtype=acc, device=z.device)
    rstd = torch.empty_like(mean)

    def launch(cfg: dict) -> None:
        _in_fwd[(triton.cdiv(M, cfg["ROWS"]),)](
            z, mask, w_in, b_in, ln_w, ln_b, a, b, g, zn, mean, rstd, M, n * n, CZ, C, eps,
            BLOCK_K=max(16, triton.next_power_of_2(CZ)), **_consts(dtype, cfg),
        )  # fmt: skip

    _launch("trimul_in_fwd", CZ, C, M, a, launch)
    return a, b, g, zn, mean, rstd


def output_forward(x, ln_w, ln_b, w_out, b_out, g, eps: float):
    """``x`` ``[B, C, N, N]`` channel-major, ``g`` ``[M, c_z]`` -> ``(out [M, c_z], mean, rstd [M])``."""
    C, n = x.shape[1], x.shape[-1]
    M, CZ = g.shape
    acc = _acc(x.dtype)[1]
    out = torch.empty((M, CZ), dtype=x.dtype, device=x.device)
    mean = torch.empty(M, dtype=acc, device=x.device)
    rstd = torch.empty_like(mean)

    def launch(cfg: dict) -> None:
        _out_fwd[(triton.cdiv(M, cfg["ROWS"]),)](
            x, ln_w, ln_b, w_out, b_out, g, out, mean, rstd, M, n * n, C, CZ, eps,
            BLOCK_H=max(16, triton.next_power_of_2(C)), **_consts(x.dtype, cfg),
        )  # fmt: skip

    _launch("trimul_out_fwd", CZ, C, M, x, launch)
    return out, mean, rstd


def output_backward(dout, out, x, ln_w, ln_b, w_out, g, mean, rstd, dproj):
    """Writes ``dg`` into ``dproj[:, 4C:]``; returns ``(dy [M, c_z], LN(x) [M, C], dx like x, dln_w, dln_b,
    sum of dg [c_z], sum of dy [c_z])`` (the sums in fp32, fp64 for fp64: the biases' gradients)."""
    C, n = x.shape[1], x.shape[-1]
    M, CZ = g.shape
    acc = _acc(x.dtype)[1]
    dy = torch.empty((M, CZ), dtype=x.dtype, device=x.device)
    xn = torch.empty((M, C), dtype=x.dtype, device=x.device)
    dx = torch.empty_like(x)
    parts: list[torch.Tensor] = []

    def launch(cfg: dict) -> None:
        programs = triton.cdiv(M, cfg["ROWS"])
        parts[:] = [torch.empty((programs, width), dtype=acc, device=x.device) for width in (C, C, CZ, CZ)]
        _out_bwd[(programs,)](
            dout, out, x, ln_w, ln_b, w_out, g, mean, rstd, dy, xn, dproj, dx, *parts,
            M, n * n, C, CZ, dproj.stride(0), BLOCK_H=max(16, triton.next_power_of_2(C)), **_consts(x.dtype, cfg),
        )  # fmt: skip

    _launch("trimul_out_bwd", CZ, C, M, x, launch)
    return dy, xn, dx, parts[0].sum(0).to(ln_w.dtype), parts[1].sum(0).to(ln_b.dtype), parts[2].sum(0), parts[3].sum(0)


def gates_backward(zn, mask, w_in, b_in, da, db, dproj, n: int) -> torch.Tensor:
    """Fills ``dproj[:, :4C]`` (the four gated projections recomputed from the saved ``LN(z)`` and
    differentiated); returns the sum of each over the rows, ``[4C]`` in fp32 (fp64 for fp64)."""
    M, CZ = zn.shape
    C = da.shape[1]
    parts: list[torch.Tensor] = []

    def launch(cfg: dict) -> None:
        programs = triton.cdiv(M, cfg["ROWS"])
        parts[:] = [torch.empty((programs, 4 * C), dtype=_acc(da.dtype)[1], device=zn.device)]
        _gates_bwd[(programs,)](
            zn, mask, w_in, b_in, da, db, dproj, parts[0], M, n * n, CZ, C, dproj.stride(0),
            BLOCK_K=max(16, triton.next_power_of_2(CZ)), **_consts(da.dtype, cfg),
        )  # fmt: skip

    _launch("trimul_gates_bwd", CZ, C, M, da, launch)
    return parts[0].sum(0)


def product(a: torch.Tensor, b: torch.Tensor, outgoing: bool) -> torch.Tensor:
    """``x[c, i, j] = sum_k a_ik b_jk`` (outgoing) or ``a_ki b_kj`` (incoming), channel-major."""
    return torch.matmul(a, b.mT) if outgoing else torch.matmul(a.mT, b)


def product_backward(dx: torch.Tensor, a: torch.Tensor, b: torch.Tensor, outgoing: bool):
    """``(da, db)`` of :func:`product`, in ``a``'s and ``b``'s own (channel-major) layout."""
    if outgoing:
        return torch.matmul(dx, b), torch.matmul(dx.mT, a)
    return torch.matmul(b, dx.mT), torch.matmul(a, dx)


#: The MLPerf call sites (crop 256) as ``(name, batch, N, c_z, C)``: the Evoformer's and the extra-MSA stack's
#: pair (``[1, 256, 256, 128]``, C 128) and the template pair stack's (4 templates, c_t 64, C 64)
MLPERF_SITES = (("pair", 1, 256, 128, 128), ("template_pair", 4, 256, 64, 64))


def run_site(batch: int, n: int, cz: int, c: int, dtype: torch.dtype) -> None:
    """Launch the four kernels once, as one call's forward and backward do, on inputs made on the current
    default device (``meta``: shapes only, nothing runs -- the launches are what a recorder sees; elsewhere
    random values, for timing). For the ahead-of-time check and ``scalefold tune-kernels``."""
    meta = torch.empty(0).device.type == "meta"

    def new(*shape, dt=dtype):
        return torch.empty(shape, dtype=dt) if meta else torch.randn(shape, dtype=dt)

    m = batch * n * n
    z, mask, ln_z, ln_x = new(m, cz), new(m).sign().abs(), new(cz), new(c)
    w_in, b_in, w_out, b_out = new(4 * c + cz, cz), new(4 * c + cz), new(cz, c), new(cz)
    a, b, g, zn, mean, rstd = input_forward(z, mask, w_in, b_in, ln_z, ln_z, 1e-5, n, dtype)
    x = new(batch, c, n, n)
    out, mean_x, rstd_x = output_forward(x, ln_x, ln_x, w_out, b_out, g, 1e-5)
    dproj = torch.empty((m, 4 * c + cz), dtype=dtype)
    output_backward(new(m, cz), out, x, ln_x, ln_x, w_out, g, mean_x, rstd_x, dproj)
    gates_backward(zn, mask, w_in, b_in, a, b, dproj, n)
