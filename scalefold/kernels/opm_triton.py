"""Triton kernels: the fused outer product mean (Supplementary Alg. 10), forward and backward.

``out_ij = (W_out flatten(sum_s a_si (x) b_sj) + bias) / (sum_s mask_si mask_sj + eps)``

``a`` ``[B, S, N1, C]`` and ``b`` ``[B, S, N2, C]`` (the masked projections, read in their own layout
through strides: no transposed copy), ``W_out`` ``[c_z, C * C]`` (column ``c * C + e`` pairs channel
``c`` of ``a`` with channel ``e`` of ``b``). The ``[N1, N2, C, C]`` outer product never exists in device
memory: each program builds it one channel of ``a`` at a time, for a tile of ``BI x BJ`` pairs, in
registers, and contracts it with that channel's ``C`` columns of ``W_out`` at once.

* ``_opm_fwd``: one program per ``(BI, BJ)`` tile of pairs. For each channel ``c``:
  ``t[i, (j, e)] = sum_s a[s, i, c] b[s, j, e]`` (``tl.dot`` over MSA-row blocks), reshaped (row-major,
  no reordering) to ``[(i, j), e]`` and multiplied into the ``[(i, j), c_z]`` accumulator by
  ``W_out[:, c C : (c + 1) C]^T``. Epilogue: the bias, and the mean's normaliser ``den = sum_s
  mask_si mask_sj + eps`` (an elementwise reduction, exact in fp32), written once for the backward.
* ``_opm_dw``: ``dW[z, (c, e)] = sum_ij dY_ij,z outer_ij,ce`` with ``dY = dout / den``: one program per
  (channel ``c``, split of the pair tiles), the outer product recomputed as in the forward; per-split
  partial sums (and the bias's ``sum_ij dY``), reduced in a fixed order after -- no atomics.
* ``_opm_dx`` (launched twice, for ``da`` and ``db``: the two are the same contraction with the roles of
  the pair's two residues swapped, by strides): one program per (residue block ``BP``, MSA-row block
  ``BS``); for each own channel ``u``, over blocks ``BQ`` of the other residue,
  ``d[(p, q), v] = dY[(p, q), :] W[:, (u, v)]`` (the outer product's gradient, one channel at a time,
  recomputed per MSA-row block: once at the Evoformer's 128 rows) and ``dX[s, p, u] += sum_(q, v)
  other[s, q, v] d[p, (q, v)]``.

Dots take the compute dtype's operands (bf16/fp16; fp32 exactly, or TF32 where PyTorch allows TF32
matmuls; fp64 exactly) and accumulate in fp32 (fp64 for fp64). The outer product and its gradient are
rounded to the compute dtype before their second product, as the reference's materialised tensors are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalefold.kernels import autotune
from scalefold.kernels.trimul_triton import _TL, _acc, dot_precision

#: the largest ``C`` (c_hidden) and ``c_z`` the kernels take: a program holds a ``[BI * BJ, c_z]`` accumulator
#: and ``C``-wide operand tiles in registers (the model's: C 32, c_z 128)
MAX_C = 64
MAX_CZ = 256


@triton.jit
def _outer_channel(A, B, bat, c, i, i_ok, jj, ee, col_ok, S, sab, sas, sai, sac, sbb, sbs, sbj, sbc,
                   ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr,
                   BS: tl.constexpr, CP: tl.constexpr):  # fmt: skip
    """``t[(i, j), e] = sum_s a[s, i, c] b[s, j, e]`` for one channel ``c`` of ``a``: ``[BI * BJ, CP]`` in
    the compute dtype (the outer product's rounding)."""
    t = tl.zeros([BI, BJ * CP], ACC)
    for s0 in range(0, S, BS):
        s = s0 + tl.arange(0, BS)
        s_ok = s < S
        a = tl.load(A + bat * sab + s[:, None] * sas + i[None, :] * sai + c * sac,
                    mask=s_ok[:, None] & i_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(B + bat * sbb + s[:, None] * sbs + jj[None, :] * sbj + ee[None, :] * sbc,
                    mask=s_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        t = tl.dot(tl.trans(a.to(DOT)), b.to(DOT), t, input_precision=PREC)
    return tl.reshape(t.to(DOT), [BI * BJ, CP])


@triton.jit
def _tile_pairs(pid_i, pid_j, N1, N2, BI: tl.constexpr, BJ: tl.constexpr, CP: tl.constexpr, C):
    """The tile's indices: ``i`` ``[BI]``; the b tile's columns ``(j, e)`` ``[BJ * CP]``; the pairs
    ``(ii, jj)`` ``[BI * BJ]`` in the outer product's row order."""
    i = pid_i * BI + tl.arange(0, BI)
    col = tl.arange(0, BJ * CP)
    jc = pid_j * BJ + col // CP
    ec = col % CP
    p = tl.arange(0, BI * BJ)
    ii = pid_i * BI + p // BJ
    jp = pid_j * BJ + p % BJ
    return i, i < N1, jc, ec, (jc < N2) & (ec < C), ii, jp, (ii < N1) & (jp < N2)


@triton.jit
def _opm_fwd(
    A, B, MASK_A, MASK_B, W, BIAS, OUT, DEN,
    S, N1, N2, C, CZ, eps,
    sab, sas, sai, sac, sbb, sbs, sbj, sbc,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    BI: tl.constexpr, BJ: tl.constexpr, BS: tl.constexpr, CP: tl.constexpr, CZP: tl.constexpr,
):  # fmt: skip
    pid_i, pid_j, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i, i_ok, jc, ec, col_ok, ii, jp, pair_ok = _tile_pairs(pid_i, pid_j, N1, N2, BI, BJ, CP, C)
    zc = tl.arange(0, CZP)
    z_ok = zc < CZ
    e = tl.arange(0, CP)
    e_ok = e < C
    acc = tl.zeros([BI * BJ, CZP], ACC)
    for c in range(0, C):
        t = _outer_channel(A, B, bat, c, i, i_ok, jc, ec, col_ok, S, sab, sas, sai, sac, sbb, sbs, sbj, sbc,
                           ACC, DOT, PREC, BI, BJ, BS, CP)  # fmt: skip
        w = tl.load(W + zc[None, :] * (C * C) + c * C + e[:, None], mask=e_ok[:, None] & z_ok[None, :], other=0.0)
        acc = tl.dot(t, w.to(DOT), acc, input_precision=PREC)
    # the mean's normaliser: the rows valid at both residues (0/1 masks, an exact sum), plus eps
    den = tl.zeros([BI * BJ], ACC)
    for s0 in range(0, S, BS):
        s = s0 + tl.arange(0, BS)
        ok = (s < S)[:, None] & pair_ok[None, :]
        ma = tl.load(MASK_A + (bat * S + s[:, None]) * N1 + ii[None, :], mask=ok, other=0.0).to(ACC)
        mb = tl.load(MASK_B + (bat * S + s[:, None]) * N2 + jp[None, :], mask=ok, other=0.0).to(ACC)
        den += tl.sum(ma * mb, 0)
    den = den + eps
    pair = (bat * N1 + ii) * N2 + jp
    tl.store(DEN + pair, den, mask=pair_ok)
    y = (acc + tl.load(BIAS + zc, mask=z_ok, other=0.0).to(ACC)[None, :]).to(DOT)
    out = y.to(ACC) / den.to(DOT).to(ACC)[:, None]  # the reference's rounding: Y, then the quotient
    tl.store(OUT + pair[:, None] * CZ + zc[None, :], out.to(OUT.dtype.element_ty), mask=pair_ok[:, None] & z_ok[None, :])


@triton.jit
def _load_dy(DOUT, DEN, rows, rows_ok, zc, z_ok, CZ, ACC: tl.constexpr, DOT: tl.constexpr):
    """``dY = dout / den`` for the pairs ``rows`` (flat pair indices): ``[rows, CZP]`` in the compute dtype."""
    d = tl.load(DOUT + rows[:, None] * CZ + zc[None, :], mask=rows_ok[:, None] & z_ok[None, :], other=0.0).to(ACC)
    den = tl.load(DEN + rows, mask=rows_ok, other=1.0).to(DOT).to(ACC)
    return (d / den[:, None]).to(DOT)


@triton.jit
def _opm_dw(
    A, B, DOUT, DEN, DW_PART, DB_PART,
    S, N1, N2, C, CZ, TILES_I, TILES_J, TILES, SPLITS,
    sab, sas, sai, sac, sbb, sbs, sbj, sbc,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    BI: tl.constexpr, BJ: tl.constexpr, BS: tl.constexpr, CP: tl.constexpr, CZP: tl.constexpr,
):  # fmt: skip
    """``DW_PART[split, z, c C + e]`` and, from the programs of channel 0, ``DB_PART[split, z]``."""
    c, split = tl.program_id(0), tl.program_id(1)
    zc = tl.arange(0, CZP)
    z_ok = zc < CZ
    e = tl.arange(0, CP)
    acc = tl.zeros([CP, CZP], ACC)
    acc_b = tl.zeros([CZP], ACC)
    for tile in range(split, TILES, SPLITS):
        bat = (tile // (TILES_I * TILES_J)).to(tl.int64)
        pid_i = (tile // TILES_J) % TILES_I
        pid_j = tile % TILES_J
        i, i_ok, jc, ec, col_ok, ii, jp, pair_ok = _tile_pairs(pid_i, pid_j, N1, N2, BI, BJ, CP, C)
        t = _outer_channel(A, B, bat, c, i, i_ok, jc, ec, col_ok, S, sab, sas, sai, sac, sbb, sbs, sbj, sbc,
                           ACC, DOT, PREC, BI, BJ, BS, CP)  # fmt: skip
        dy = _load_dy(DOUT, DEN, (bat * N1 + ii) * N2 + jp, pair_ok, zc, z_ok, CZ, ACC, DOT)
        acc = tl.dot(tl.trans(t), dy, acc, input_precision=PREC)
        acc_b += tl.sum(dy.to(ACC), 0)
    tl.store(DW_PART + split * CZ * C * C + zc[None, :] * (C * C) + c * C + e[:, None], acc,
             mask=(e < C)[:, None] & z_ok[None, :])  # fmt: skip
    if c == 0:
        tl.store(DB_PART + split * CZ + zc, acc_b, mask=z_ok)


@triton.jit
def _opm_dx(
    X, DOUT, DEN, W, DX,
    S, NP, NQ, C, CZ,
    sxb, sxs, sxq, sxc, sdp, sdq, swu, swv, sob, sos, sop, soc,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    BP: tl.constexpr, BQ: tl.constexpr, BS: tl.constexpr, CP: tl.constexpr, CZP: tl.constexpr,
):  # fmt: skip
    """``dX[s, p, u] = sum_(q, v) X[s, q, v] sum_z dY[p, q, z] W[z, u swu + v swv]``; ``dY``'s and the
    normaliser's flat pair index ``bat NP NQ + p sdp + q sdq``."""
    pid_p, pid_s, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    p = pid_p * BP + tl.arange(0, BP)
    s = pid_s * BS + tl.arange(0, BS)
    s_ok = s < S
    r = tl.arange(0, BP * BQ)
    pr = pid_p * BP + r // BQ
    col = tl.arange(0, BQ * CP)
    zc = tl.arange(0, CZP)
    z_ok = zc < CZ
    v = tl.arange(0, CP)
    for u in range(0, C):
        w = tl.load(W + zc[:, None] * (C * C) + u * swu + v[None, :] * swv, mask=z_ok[:, None] & (v < C)[None, :], other=0.0)
        acc = tl.zeros([BS, BP], ACC)
        for q0 in range(0, NQ, BQ):
            qr = q0 + r % BQ
            rows_ok = (pr < NP) & (qr < NQ)
            dy = _load_dy(DOUT, DEN, bat * NP * NQ + pr * sdp + qr * sdq, rows_ok, zc, z_ok, CZ, ACC, DOT)
            d = tl.reshape(tl.dot(dy, w.to(DOT), input_precision=PREC, out_dtype=ACC).to(DOT), [BP, BQ * CP])
            qc = q0 + col // CP
            vc = col % CP
            x = tl.load(X + bat * sxb + s[:, None] * sxs + qc[None, :] * sxq + vc[None, :] * sxc,
                        mask=s_ok[:, None] & ((qc < NQ) & (vc < C))[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(x.to(DOT), tl.trans(d), acc, input_precision=PREC)
        tl.store(DX + bat * sob + s[:, None] * sos + p[None, :] * sop + u * soc, acc.to(DX.dtype.element_ty),
                 mask=s_ok[:, None] & (p < NP)[None, :])  # fmt: skip


# Candidate launch configs (autotune.Tuner's lists; the first is the default). BI x BJ pairs per program
# (the [BI * BJ, c_z] fp32 accumulator in registers), BS MSA rows per dot step; the backward's BP residues and
# BQ other residues per step, BS MSA rows per program (the outer product's gradient is recomputed once per
# MSA-row block: 128 rows, the Evoformer's whole MSA, recompute it once).
OPM_CONFIGS = {
    "opm_fwd": [
        {"BI": 64, "BJ": 2, "BS": 32, "num_warps": 8, "num_stages": 1},
        {"BI": 32, "BJ": 2, "BS": 32, "num_warps": 4, "num_stages": 1},
        {"BI": 32, "BJ": 4, "BS": 32, "num_warps": 8, "num_stages": 1},
        {"BI": 64, "BJ": 1, "BS": 32, "num_warps": 4, "num_stages": 1},
    ],
    "opm_dw": [
        {"BI": 32, "BJ": 2, "BS": 32, "num_warps": 4, "num_stages": 1},
        {"BI": 64, "BJ": 2, "BS": 32, "num_warps": 8, "num_stages": 1},
        {"BI": 16, "BJ": 4, "BS": 32, "num_warps": 4, "num_stages": 1},
    ],
    "opm_dx": [
        {"BP": 16, "BQ": 2, "BS": 128, "num_warps": 8, "num_stages": 1},
        {"BP": 16, "BQ": 2, "BS": 128, "num_warps": 4, "num_stages": 1},
        {"BP": 32, "BQ": 2, "BS": 128, "num_warps": 8, "num_stages": 1},
        {"BP": 16, "BQ": 2, "BS": 64, "num_warps": 4, "num_stages": 1},
    ],
}
# Exact fp32/fp64 dots (CUDA cores: each thread holds more of the operand tiles) have their own tuners
# ("<kernel>_exact"), as the attention and triangle-multiplication kernels do
OPM_EXACT_CONFIGS = {
    "opm_fwd": [
        {"BI": 64, "BJ": 2, "BS": 32, "num_warps": 8, "num_stages": 1},
        {"BI": 32, "BJ": 2, "BS": 16, "num_warps": 4, "num_stages": 1},
    ],
    "opm_dw": [
        {"BI": 16, "BJ": 2, "BS": 16, "num_warps": 4, "num_stages": 1},
        {"BI": 32, "BJ": 2, "BS": 32, "num_warps": 8, "num_stages": 1},
    ],
    "opm_dx": [
        {"BP": 16, "BQ": 1, "BS": 64, "num_warps": 8, "num_stages": 1},
        {"BP": 16, "BQ": 2, "BS": 64, "num_warps": 8, "num_stages": 1},
        {"BP": 16, "BQ": 2, "BS": 32, "num_warps": 4, "num_stages": 1},
    ],
}
# Interpreter (CPU): few, small programs (16 is a dot's least extent)
INTERPRETER_CONFIGS = {
    "opm_fwd": {"BI": 16, "BJ": 4, "BS": 16, "num_warps": 1, "num_stages": 1},
    "opm_dw": {"BI": 16, "BJ": 4, "BS": 16, "num_warps": 1, "num_stages": 1},
    "opm_dx": {"BP": 16, "BQ": 4, "BS": 16, "num_warps": 1, "num_stages": 1},
}
#: ``opm_dw``'s splits of the pair tiles per channel (``C`` x splits programs; the partial sums are
#: ``splits x c_z x C^2`` fp32: 8 MiB at the model's shapes)
DW_SPLITS = 16


def unsupported(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why the fused kernels do not take these operands (one line naming the limit), or None."""
    c, cz = a.shape[-1], weight.shape[0]
    if dtype not in _TL:
        return f"dtype {dtype} (the kernels take float64, float32, bfloat16, float16)"
    if c > MAX_C:
        return f"c_hidden {c} above the kernels' limit {MAX_C}"
    if cz > MAX_CZ:
        return f"c_z {cz} above the kernels' limit {MAX_CZ}"
    if b.shape[-1] != c or weight.shape[-1] != c * c:
        return f"projections of {c} and {b.shape[-1]} channels with an output weight {tuple(weight.shape)}"
    return None


def shape_key(cz: int, c: int, s: int, n: int) -> dict:
    """The shape class of a call: ``c_z``, ``C``, and the MSA rows and the residues bucketed to powers of two."""
    return dict(CZ=cz, C=c, S=autotune.size_class(s), N=autotune.size_class(n))


def _launch(name: str, key: dict, like: torch.Tensor, launch) -> dict:
    precision = dot_precision(like.dtype)
    label = "tf32" if like.dtype == torch.float32 and precision == "tf32" else None
    if precision == "ieee":
        tuner = autotune.get_tuner(f"{name}_exact", OPM_EXACT_CONFIGS[name], INTERPRETER_CONFIGS[name])
    else:
        tuner = autotune.get_tuner(name, OPM_CONFIGS[name], INTERPRETER_CONFIGS[name])
    return tuner.run(autotune.make_key(key, like, label), launch)


def _consts(dtype: torch.dtype, cfg: dict, c: int, cz: int) -> dict:
    return dict(ACC=_acc(dtype)[0], DOT=_TL[dtype], PREC=dot_precision(dtype), CP=max(16, triton.next_power_of_2(c)),
                CZP=max(16, triton.next_power_of_2(cz)), **cfg)  # fmt: skip


def forward(a, b, mask_a, mask_b, weight, bias, eps: float):
    """``a`` ``[B, S, N1, C]``, ``b`` ``[B, S, N2, C]`` (any strides), masks ``[B, S, N1]`` / ``[B, S, N2]``
    (contiguous) -> ``(out [B, N1, N2, c_z], den [B, N1, N2])`` (``den``: the normaliser plus eps, fp32;
    fp64 for fp64)."""
    nb, s, n1, c = a.shape
    n2, cz = b.shape[2], weight.shape[0]
    out = torch.empty((nb, n1, n2, cz), dtype=a.dtype, device=a.device)
    den = torch.empty((nb, n1, n2), dtype=_acc(a.dtype)[1], device=a.device)

    def launch(cfg: dict) -> None:
        grid = (triton.cdiv(n1, cfg["BI"]), triton.cdiv(n2, cfg["BJ"]), nb)
        _opm_fwd[grid](a, b, mask_a, mask_b, weight, bias, out, den, s, n1, n2, c, cz, eps, *a.stride(),
                       *b.stride(), **_consts(a.dtype, cfg, c, cz))  # fmt: skip

    _launch("opm_fwd", shape_key(cz, c, s, n1), a, launch)
    return out, den


def backward(dout, a, b, weight, den):
    """``(da, db, dweight, dbias)`` of :func:`forward`'s ``out`` (``dout`` contiguous); ``dweight`` and
    ``dbias`` reduced from per-split partial sums in fp32 (fp64 for fp64), returned in ``weight``'s dtype."""
    nb, s, n1, c = a.shape
    n2, cz = b.shape[2], weight.shape[0]
    acc = _acc(a.dtype)[1]
    da = torch.empty((nb, s, n1, c), dtype=a.dtype, device=a.device)
    db = torch.empty((nb, s, n2, c), dtype=a.dtype, device=a.device)
    parts: list[torch.Tensor] = []

    def launch_dw(cfg: dict) -> None:
        tiles_i, tiles_j = triton.cdiv(n1, cfg["BI"]), triton.cdiv(n2, cfg["BJ"])
        tiles = nb * tiles_i * tiles_j
        splits = min(DW_SPLITS, tiles)
        parts[:] = [torch.empty((splits, cz, c * c), dtype=acc, device=a.device),
                    torch.empty((splits, cz), dtype=acc, device=a.device)]  # fmt: skip
        _opm_dw[(c, splits)](a, b, dout, den, *parts, s, n1, n2, c, cz, tiles_i, tiles_j, tiles, splits,
                             *a.stride(), *b.stride(), **_consts(a.dtype, cfg, c, cz))  # fmt: skip

    def dx(other, out, np_, nq, sdp, sdq, swu, swv):
        def launch(cfg: dict) -> None:
            grid = (triton.cdiv(np_, cfg["BP"]), triton.cdiv(s, cfg["BS"]), nb)
            _opm_dx[grid](other, dout, den, weight, out, s, np_, nq, c, cz, *other.stride(), sdp, sdq, swu, swv,
                          *out.stride(), **_consts(a.dtype, cfg, c, cz))  # fmt: skip

        _launch("opm_dx", shape_key(cz, c, s, np_), a, launch)

    dx(b, da, n1, n2, n2, 1, c, 1)  # da: p = i, q = j, u = c, v = e
    dx(a, db, n2, n1, 1, n2, 1, c)  # db: p = j, q = i, u = e, v = c
    _launch("opm_dw", shape_key(cz, c, s, n1), a, launch_dw)
    return da, db, parts[0].sum(0).to(weight.dtype), parts[1].sum(0).to(weight.dtype)


#: The MLPerf call sites (crop 256) as ``(name, S, N, c_m -> C, c_z)``: the Evoformer's (124 clusters + 4
#: template rows, C 32) and the extra-MSA stack's (1,024 sequences, C 32)
MLPERF_SITES = (("evoformer", 128, 256, 32, 128), ("extra_msa", 1024, 256, 32, 128))


def run_site(s: int, n: int, c: int, cz: int, dtype: torch.dtype) -> None:
    """Launch the kernels once, as one call's forward and backward do, on inputs made on the current default
    device (``meta``: shapes only; elsewhere random values). For the ahead-of-time check and tune-kernels."""
    meta = torch.empty(0).device.type == "meta"

    def new(*shape, dt=dtype):
        return torch.empty(shape, dtype=dt) if meta else torch.randn(shape, dtype=dt)

    a, b, w, bias = new(1, s, n, c), new(1, s, n, c), new(cz, c * c), new(cz)
    mask = new(1, s, n, dt=_acc(dtype)[1])
    out, den = forward(a, b, mask, mask, w, bias, 1e-3)
    backward(new(1, n, n, cz), a, b, w, den)
