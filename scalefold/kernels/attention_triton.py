"""Triton kernels: gated multi-head attention with an additive pair bias (Supplementary Alg. 7, 13, 14).

``o = sigmoid(g) * softmax(scale * q k^T + (mask - 1) * inf + bias) v``

Forward: FlashAttention-2 style. One program per (query block, batch, head) streams the key
blocks with an online softmax; scores and softmax statistics are kept in fp32 (fp64 for fp64
inputs); the sigmoid gate is applied in the epilogue. The statistics are saved as the row max
``m`` and ``log(l)`` *separately*, not as one log-sum-exp: a fully masked row has ``m ~ -inf``
(the reference's finite ``-1e9``) and ``m + log(l)`` would round ``log(l)`` away in fp32.

Backward, three kernels, no atomics:

* ``_attn_bwd_preprocess``: ``delta = rowsum(dO * o)`` (``= rowsum(dO_attn * O_attn)``),
  ``dO_attn = dO * sigmoid(g)`` and ``dg = dO * o * (1 - sigmoid(g))`` -- so the ungated output
  never needs to be stored;
* ``_attn_bwd_dkdv``: one program per (key block, batch, head) loops over the query blocks
  (FA-2);
* ``_attn_bwd_dq_dbias``: one program per (query block, key split, bias group, head) loops over
  its key blocks and, inside, over the *batch-like axis that shares the bias* (MSA sequences for
  row attention, rows ``i`` for triangle attention), accumulating ``dbias = sum_r dS_r`` for one
  ``[BLOCK_M, BLOCK_N]`` tile in registers and writing it once. The reduction order is fixed, so
  the bias gradient is deterministic, and no ``[Z, H, N, N]`` scratch exists. ``dQ`` stays in
  registers when a group has one member; otherwise each program read-modify-writes the dQ rows it
  owns in an fp32 buffer (one buffer per key split, summed afterwards).

Layout (built by :func:`canonical_layout`): ``q``, ``k``, ``v``, ``g`` are ``[Z, H, N, D]`` with
arbitrary strides; the batch index ``z`` is decomposed as ``z = (a * R + r) * C + c`` and the
bias is ``[A, C, Hb, NQb, NKb]`` (size-1 dims broadcast, stride 0), i.e. shared over ``r``. The
mask arrives as the additive offset ``(mask - 1) * inf``, ``[Z, Hm, NQm, NKm]`` (size-1 dims
broadcast).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from scalefold.kernels import autotune

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scores(
    q,
    kt,
    z,
    a,
    c,
    h,
    rows,
    cols,
    NQ,
    NK,
    scale,
    BIAS,
    sba,
    sbc,
    sbh,
    sbm,
    sbn,
    MASK,
    smz,
    smh,
    smm,
    smn,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BY_KEY: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``scale * q k^T + mask_offset + bias`` for one tile (reference order); -inf outside the tile."""
    s = tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * scale
    inside = (rows[:, None] < NQ) & (cols[None, :] < NK)
    if HAS_MASK:
        if MASK_BY_KEY:  # the model's masks: one value per key, broadcast over the queries
            mask_row = tl.load(MASK + z * smz + h * smh + cols * smn, mask=cols < NK, other=0.0)
            s += mask_row.to(ACC_DTYPE)[None, :]
        else:
            mask_ptrs = MASK + z * smz + h * smh + rows[:, None] * smm + cols[None, :] * smn
            s += tl.load(mask_ptrs, mask=inside, other=0.0).to(ACC_DTYPE)
    if HAS_BIAS:
        bias_ptrs = BIAS + a * sba + c * sbc + h * sbh + rows[:, None] * sbm + cols[None, :] * sbn
        s += tl.load(bias_ptrs, mask=inside, other=0.0).to(ACC_DTYPE)
    return tl.where(inside, s, float("-inf"))


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    BIAS,
    MASK,
    GATE,
    O,
    ROW_MAX,
    ROW_LOGSUM,
    sqz,
    sqh,
    sqm,
    sqd,
    skz,
    skh,
    skn,
    skd,
    svz,
    svh,
    svn,
    svd,
    sba,
    sbc,
    sbh,
    sbm,
    sbn,
    smz,
    smh,
    smm,
    smn,
    sgz,
    sgh,
    sgm,
    sgd,
    soz,
    soh,
    som,
    sod,
    H,
    NQ,
    NK,
    D,
    R,
    C,
    scale,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BY_KEY: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    zh = tl.program_id(0).to(tl.int64)  # axis 0: Z * H can pass CUDA's 65,535 cap of axes 1 and 2
    pid_m = tl.program_id(1)
    z = zh // H
    h = zh % H
    a = z // (R * C)
    c = z % C
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < NQ
    dim_ok = dims < D

    q = tl.load(
        Q + z * sqz + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    # q: [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)
    for start_n in range(0, NK, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < NK
        kt = tl.load(
            K + z * skz + h * skh + cols[None, :] * skn + dims[:, None] * skd,
            mask=dim_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        # kt: [BLOCK_D, BLOCK_N]
        s = _scores(
            q,
            kt,
            z,
            a,
            c,
            h,
            rows,
            cols,
            NQ,
            NK,
            scale,
            BIAS,
            sba,
            sbc,
            sbh,
            sbm,
            sbn,
            MASK,
            smz,
            smh,
            smm,
            smn,
            HAS_BIAS,
            HAS_MASK,
            MASK_BY_KEY,
            ACC_DTYPE,
            DOT_PRECISION,
        )
        # s: [BLOCK_M, BLOCK_N]; rows past NQ are all -inf -> keep their statistics finite
        s = tl.where(row_ok[:, None], s, tl.where(col_ok[None, :], 0.0, float("-inf")))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + z * svz + h * svh + cols[:, None] * svn + dims[None, :] * svd,
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        m_i = m_new
    o = acc / l_i[:, None]
    io_mask = row_ok[:, None] & dim_ok[None, :]
    if HAS_GATE:
        g = tl.load(GATE + z * sgz + h * sgh + rows[:, None] * sgm + dims[None, :] * sgd, mask=io_mask, other=0.0)
        o = o / (1.0 + tl.exp(-g.to(ACC_DTYPE)))
    tl.store(O + z * soz + h * soh + rows[:, None] * som + dims[None, :] * sod, o.to(O.dtype.element_ty), mask=io_mask)
    stat = zh * NQ + rows
    tl.store(ROW_MAX + stat, m_i, mask=row_ok)
    tl.store(ROW_LOGSUM + stat, tl.log(l_i), mask=row_ok)


@triton.jit
def _attn_bwd_preprocess(
    O,
    DO,
    GATE,
    DO_ATTN,
    DGATE,
    DELTA,
    soz,
    soh,
    som,
    sod,
    sdz,
    sdh,
    sdm,
    sdd,
    sgz,
    sgh,
    sgm,
    sgd,
    sdgz,
    sdgh,
    sdgm,
    sdgd,
    H,
    NQ,
    D,
    HAS_GATE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    zh = tl.program_id(0).to(tl.int64)  # axis 0: Z * H can pass CUDA's 65,535 cap of axes 1 and 2
    pid_m = tl.program_id(1)
    z = zh // H
    h = zh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    io_mask = (rows[:, None] < NQ) & (dims[None, :] < D)
    o = tl.load(O + z * soz + h * soh + rows[:, None] * som + dims[None, :] * sod, mask=io_mask, other=0.0).to(
        ACC_DTYPE
    )
    do = tl.load(DO + z * sdz + h * sdh + rows[:, None] * sdm + dims[None, :] * sdd, mask=io_mask, other=0.0).to(
        ACC_DTYPE
    )
    # contiguous [Z, H, NQ, D] dO_attn: a scalar (int64) base plus int32 in-tile offsets
    base = zh * NQ * D
    out = rows[:, None] * D + dims[None, :]
    tl.store(DELTA + zh * NQ + rows, tl.sum(do * o, 1), mask=rows < NQ)
    if HAS_GATE:
        g = tl.load(GATE + z * sgz + h * sgh + rows[:, None] * sgm + dims[None, :] * sgd, mask=io_mask, other=0.0)
        sig = 1.0 / (1.0 + tl.exp(-g.to(ACC_DTYPE)))
        # dgate in the gate's own layout (strided)
        dgate_ptrs = DGATE + z * sdgz + h * sdgh + rows[:, None] * sdgm + dims[None, :] * sdgd
        tl.store(dgate_ptrs, (do * o * (1.0 - sig)).to(DGATE.dtype.element_ty), mask=io_mask)
        do = do * sig
    tl.store(DO_ATTN + base + out, do.to(DO_ATTN.dtype.element_ty), mask=io_mask)


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    BIAS,
    MASK,
    DO_ATTN,
    ROW_MAX,
    ROW_LOGSUM,
    DELTA,
    DK,
    DV,
    sqz,
    sqh,
    sqm,
    sqd,
    skz,
    skh,
    skn,
    skd,
    svz,
    svh,
    svn,
    svd,
    sba,
    sbc,
    sbh,
    sbm,
    sbn,
    smz,
    smh,
    smm,
    smn,
    H,
    NQ,
    NK,
    D,
    R,
    C,
    scale,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BY_KEY: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    zh = tl.program_id(0).to(tl.int64)  # axis 0: Z * H can pass CUDA's 65,535 cap of axes 1 and 2
    pid_n = tl.program_id(1)
    z = zh // H
    h = zh % H
    a = z // (R * C)
    c = z % C
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < NK
    dim_ok = dims < D
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + z * skz + h * skh + cols[:, None] * skn + dims[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + z * svz + h * svh + cols[:, None] * svn + dims[None, :] * svd, mask=kv_mask, other=0.0)
    # k, v: [BLOCK_N, BLOCK_D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC_DTYPE)
    for start_m in range(0, NQ, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < NQ
        q_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(Q + z * sqz + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=q_mask, other=0.0)
        do = tl.load(DO_ATTN + zh * NQ * D + rows[:, None] * D + dims[None, :], mask=q_mask, other=0.0)
        row_max = tl.load(ROW_MAX + zh * NQ + rows, mask=row_ok, other=0.0)
        row_logsum = tl.load(ROW_LOGSUM + zh * NQ + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + zh * NQ + rows, mask=row_ok, other=0.0)
        s = _scores(
            q,
            tl.trans(k),
            z,
            a,
            c,
            h,
            rows,
            cols,
            NQ,
            NK,
            scale,
            BIAS,
            sba,
            sbc,
            sbh,
            sbm,
            sbn,
            MASK,
            smz,
            smh,
            smm,
            smn,
            HAS_BIAS,
            HAS_MASK,
            MASK_BY_KEY,
            ACC_DTYPE,
            DOT_PRECISION,
        )
        p = tl.exp((s - row_max[:, None]) - row_logsum[:, None])
        # p: [BLOCK_M, BLOCK_N], zero outside the tile
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    # contiguous [Z, H, NK, D] (strided stores here spill registers at the A100 fp32 default config)
    base = zh * NK * D
    out = cols[:, None] * D + dims[None, :]
    tl.store(DK + base + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + base + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_dbias(
    Q,
    K,
    V,
    BIAS,
    MASK,
    DO_ATTN,
    ROW_MAX,
    ROW_LOGSUM,
    DELTA,
    DQ,
    DBIAS,
    sqz,
    sqh,
    sqm,
    sqd,
    skz,
    skh,
    skn,
    skd,
    svz,
    svh,
    svn,
    svd,
    sba,
    sbc,
    sbh,
    sbm,
    sbn,
    smz,
    smh,
    smm,
    smn,
    H,
    NQ,
    NK,
    D,
    R,
    C,
    scale,
    SPLIT_BLOCKS,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BY_KEY: tl.constexpr,
    NEED_DBIAS: tl.constexpr,
    DQ_IN_REGISTERS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    ach = tl.program_id(0).to(tl.int64)  # axis 0: A * C * H can pass CUDA's 65,535 cap of axes 1 and 2
    split = tl.program_id(1).to(tl.int64)
    pid_m = tl.program_id(2)
    h = ach % H
    a = (ach // H) // C
    c = (ach // H) % C
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < NQ
    dim_ok = dims < D
    q_mask = row_ok[:, None] & dim_ok[None, :]
    Z = (tl.num_programs(0) // H) * R  # axis 0 has A * C * H programs: Z = A * R * C
    dq_acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)
    n_blocks = tl.cdiv(NK, BLOCK_N)
    first = split * SPLIT_BLOCKS
    last = tl.minimum(first + SPLIT_BLOCKS, n_blocks)
    for block in range(first, last):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < NK
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        dbias = tl.zeros([BLOCK_M, BLOCK_N], ACC_DTYPE)
        for r in range(0, R):
            # the batch-like members sharing this bias tile, in a fixed order
            z = (a * R + r) * C + c
            zh = z * H + h
            q = tl.load(Q + z * sqz + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=q_mask, other=0.0)
            do = tl.load(DO_ATTN + zh * NQ * D + rows[:, None] * D + dims[None, :], mask=q_mask, other=0.0)
            row_max = tl.load(ROW_MAX + zh * NQ + rows, mask=row_ok, other=0.0)
            row_logsum = tl.load(ROW_LOGSUM + zh * NQ + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + zh * NQ + rows, mask=row_ok, other=0.0)
            k = tl.load(K + z * skz + h * skh + cols[:, None] * skn + dims[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(V + z * svz + h * svh + cols[:, None] * svn + dims[None, :] * svd, mask=kv_mask, other=0.0)
            s = _scores(
                q,
                tl.trans(k),
                z,
                a,
                c,
                h,
                rows,
                cols,
                NQ,
                NK,
                scale,
                BIAS,
                sba,
                sbc,
                sbh,
                sbm,
                sbn,
                MASK,
                smz,
                smh,
                smm,
                smn,
                HAS_BIAS,
                HAS_MASK,
                MASK_BY_KEY,
                ACC_DTYPE,
                DOT_PRECISION,
            )
            p = tl.exp((s - row_max[:, None]) - row_logsum[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
            ds = p * (dp - delta[:, None])
            # ds: [BLOCK_M, BLOCK_N]
            if NEED_DBIAS:
                dbias += ds
            dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
            if DQ_IN_REGISTERS:
                dq_acc += dq
            else:
                dq_ptrs = DQ + ((split * Z + z) * H + h) * NQ * D + rows[:, None] * D + dims[None, :]
                tl.store(dq_ptrs, tl.load(dq_ptrs, mask=q_mask, other=0.0) + dq, mask=q_mask)
                tl.debug_barrier()  # the rows are read back at the next key block, maybe by other threads
        if NEED_DBIAS:
            # contiguous [A, C, H, NQ, NK]
            dbias_ptrs = DBIAS + ((a * C + c) * H + h) * NQ * NK + rows[:, None] * NK + cols[None, :]
            tl.store(dbias_ptrs, dbias.to(DBIAS.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if DQ_IN_REGISTERS:
        z = a * C + c  # R == 1
        dq_ptrs = DQ + ((split * Z + z) * H + h) * NQ * D + rows[:, None] * D + dims[None, :]
        tl.store(dq_ptrs, dq_acc, mask=q_mask)


# ----------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------


#: CUDA's largest grid: 2^31 - 1 blocks along axis 0, 65,535 along axes 1 and 2
MAX_GRID = (2**31 - 1, 65535, 65535)


def launch_grid(*sizes: int) -> tuple[int, ...]:
    """A kernel's launch grid, checked against :data:`MAX_GRID`. Every attention kernel puts its
    batch x head index on axis 0: the template pointwise attention batches N_res^2 pairs (4 heads x
    256^2 = 262,144 at the MLPerf crop), far past the cap of the other axes."""
    for axis, (size, cap) in enumerate(zip(sizes, MAX_GRID)):
        if size > cap:
            raise ValueError(f"attention launch grid {sizes}: axis {axis} has {size} blocks, CUDA allows {cap}")
    return tuple(sizes)


def _strides(t: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    """Strides of ``t`` with 0 for size-1 (broadcast) dims; zeros when ``t`` is None."""
    if t is None:
        return (0,) * ndim
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))


def canonical_bias(
    bias: torch.Tensor, batch: tuple[int, ...], tail: tuple[int, int, int]
) -> tuple[torch.Tensor, int, int]:
    """Map a bias broadcastable to ``batch + tail`` onto ``([A, C, Hb, NQb, NKb], R, C)``.

    The batch dims are classified as *full* (the bias varies along them) or *shared* (the bias
    has size 1 there). If the non-trivial dims read ``full* shared* full*``, the bias is shared
    over the middle block of ``R`` members and its gradient is reduced inside the kernel;
    otherwise the bias is expanded over the batch (``R = 1``) and autograd reduces.
    """
    if bias.dim() > len(batch) + 3:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to {batch + tail}")
    bias = bias.reshape((1,) * (len(batch) + 3 - bias.dim()) + tuple(bias.shape))
    bias_batch, bias_tail = tuple(bias.shape[: len(batch)]), tuple(bias.shape[len(batch) :])
    kinds = []
    for n, nb in zip(batch, bias_batch):
        if n == 1:
            continue
        if nb not in (1, n):
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to {batch + tail}")
        kinds.append((n, "full" if nb == n else "shared"))
    pattern = "".join("f" if k == "full" else "s" for _, k in kinds)
    lead = len(pattern) - len(pattern.lstrip("f"))
    body = pattern[lead:]
    n_shared = len(body) - len(body.lstrip("s"))
    if "s" in body[n_shared:]:  # shared dims in two separate places: give up the in-kernel sum
        bias = bias.expand(tuple(batch) + bias_tail)
        return bias.reshape((math.prod(batch), 1) + bias_tail), 1, 1
    sizes = [n for n, _ in kinds]
    A = math.prod(sizes[:lead])
    R = math.prod(sizes[lead : lead + n_shared])
    C = math.prod(sizes[lead + n_shared :])
    return bias.reshape((A, C) + bias_tail), R, C


def _dot_precision(dtype: torch.dtype) -> str:
    """Operand precision of ``tl.dot``: fp64, and fp32 unless PyTorch allows TF32 matmuls
    (``torch.backends.cuda.matmul.allow_tf32``, set by tf32 training): exact (``"ieee"``, CUDA
    cores); fp32 under ``allow_tf32``: ``"tf32"`` (tensor cores, like PyTorch's own matmuls);
    fp16/bf16: tensor cores (the argument is irrelevant). The CPU interpreter multiplies exactly."""
    if dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "tf32"


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _mask_by_key(mask_offset: torch.Tensor | None) -> bool:
    """The mask offset ``[Z, Hm, NQm, NKm]`` is one row of keys (broadcast over the queries): it is
    then loaded as a vector, not as a tile of addresses."""
    return mask_offset is not None and mask_offset.shape[2] == 1


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


# ----------------------------------------------------------------------------------------------
# Launchers (canonical layout)
# ----------------------------------------------------------------------------------------------

# Candidate launch configs per program for tensor-core dots (fp16/bf16, fp32 under allow_tf32):
# autotune.Tuner's list, the first is the default (launched where the launch-config table has no
# entry, and the table's "untimed defaults"); a dict may map a compute capability to its own list. Checked ahead of time for sm_90 and sm_80 at every MLPerf
# call site by ``scalefold aot-check`` (bench/RESULTS.md): each compiles and fits
# shared memory, the defaults do not spill registers -- with Triton 3.9 (here) and 3.6 (the lent
# H100/H200 image), both checked. The dQ/dbias kernel holds the most tiles (S, P, dP, dS, the dbias
# accumulator): BLOCK_N 64 spilled there, so its default is 64 x 32 on 8 warps; the forward's 64 x 64
# spilled 16 B with TF32 on sm_80 (head size 8) and its 64 x 32 with 3 stages 4 B in bf16/fp16 on
# sm_80 under Triton 3.6, so it is 64 x 32 with 2 stages.
ATTENTION_CONFIGS = {
    "attention_fwd": [
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    ],
    "attention_bwd_dkdv": [
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    ],
    "attention_bwd_dq": [
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    ],
}
# Exact fp32/fp64 dots run on CUDA cores with a whole K extent of each operand tile in every
# thread's registers: 64 x 64 tiles spilled kilobytes; 32 x 32 ones do not, except in the dQ/dbias
# kernel at head size 8 (32-132 B). Under Triton 3.6 (the lent H100/H200 image) 32 x 32 also spilled
# 8 B in the forward (sm_90) and the dK/dV kernel (sm_80), and the dQ/dbias kernel's 16 x 32 8 B
# (sm_80, head size 32); so the defaults are 16 x 32 (forward, dK/dV) and 16 x 16 (dQ/dbias), which
# spill with neither version.
ATTENTION_EXACT_CONFIGS = {
    "attention_fwd": [
        {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
    ],
    "attention_bwd_dkdv": [
        {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
    ],
    "attention_bwd_dq": [
        {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
    ],
}
# Interpreter mode (CPU): few, big programs -- each program instance costs milliseconds.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 1, "num_stages": 1}


def _launch(name: str, shape: dict, q: torch.Tensor, launch) -> dict:
    """Launch program ``name`` with its config for this shape class (the launch-config table's, or
    timed with ``SCALEFOLD_AUTOTUNE=1``): separate tuners (and candidates) for exact dots, and the
    dtype label ``tf32`` for fp32 tensors with TF32 dots."""
    precision = _dot_precision(q.dtype)
    if precision == "ieee":
        tuner = autotune.get_tuner(f"{name}_exact", ATTENTION_EXACT_CONFIGS[name], INTERPRETER_CONFIG)
    else:
        tuner = autotune.get_tuner(name, ATTENTION_CONFIGS[name], INTERPRETER_CONFIG)
    label = "tf32" if q.dtype == torch.float32 and precision == "tf32" else None
    return tuner.run(autotune.make_key(shape, q, label), launch)


def output_layout(q: torch.Tensor) -> torch.Tensor:
    """An empty ``[Z, H, NQ, D]`` output like ``q``, stored ``[Z, NQ, H, D]`` (strides ``(NQ H D, D, H D, 1)``):
    the model's heads are ``[*, N, H * D]`` viewed as ``[*, H, N, D]``, and it moves the output back the same
    way (``o.transpose(-2, -3).reshape(..., H * D)``), which is then a view instead of a copy."""
    Z, H, NQ, D = q.shape
    return q.new_empty((Z, NQ, H, D)).transpose(1, 2)


def _shape_class(q: torch.Tensor, k: torch.Tensor, has_bias: bool, R: int) -> dict:
    """Sizes bucketed to powers of two, the head size, a bias, and a bias shared over R > 1 members."""
    Z, H, NQ, D = q.shape
    return dict(NQ=autotune.size_class(NQ), NK=autotune.size_class(k.shape[2]), D=D, bias=has_bias, shared=R > 1)


def attention_forward(
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
    """Forward on the canonical layout; returns ``(o [Z,H,NQ,D], row_max [Z,H,NQ], row_logsum)``, ``o``
    stored head-interleaved (:func:`output_layout`)."""
    Z, H, NQ, D = q.shape
    NK = k.shape[2]
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = output_layout(q)
    row_max = torch.empty((Z, H, NQ), dtype=acc_torch, device=q.device)
    row_logsum = torch.empty_like(row_max)

    def launch(cfg: dict) -> None:
        grid = launch_grid(Z * H, triton.cdiv(NQ, cfg["BLOCK_M"]))
        _attn_fwd[grid](
            q, k, v, bias, mask_offset, gate, o, row_max, row_logsum,
            *q.stride(), *k.stride(), *v.stride(), *_strides(bias, 5), *_strides(mask_offset, 4),
            *_strides(gate, 4), *o.stride(),
            H, NQ, NK, D, R, C, scale,
            HAS_BIAS=bias is not None, HAS_MASK=mask_offset is not None, MASK_BY_KEY=_mask_by_key(mask_offset),
            HAS_GATE=gate is not None,
            ACC_DTYPE=_acc_dtype(q.dtype), DOT_PRECISION=_dot_precision(q.dtype),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=_block_d(D),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip

    _launch("attention_fwd", dict(_shape_class(q, k, bias is not None, R), gate=gate is not None), q, launch)
    return o, row_max, row_logsum


def attention_backward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward on the canonical layout; returns ``(dq, dk, dv, dbias, dgate)`` (None where absent).

    ``dbias`` has the shape of ``bias`` (its broadcast head/query/key dims summed in PyTorch); ``dq`` and
    ``dgate`` have the layouts of ``q`` and ``gate`` (``torch.empty_like``): the gradients of the model's
    transposed head views then reshape back to ``[*, N, H * D]`` without a copy (``dk``, ``dv`` contiguous).
    Three steps: :func:`_backward_preprocess` (delta, dO_attn, dgate), :func:`_backward_dkdv`,
    :func:`_backward_dq_dbias`.
    """
    need_dbias = need_dbias and bias is not None
    do_attn, delta, dgate = _backward_preprocess(do, q, gate, o)
    common = dict(HAS_BIAS=bias is not None, HAS_MASK=mask_offset is not None,
                  MASK_BY_KEY=_mask_by_key(mask_offset), ACC_DTYPE=_acc_dtype(q.dtype),
                  DOT_PRECISION=_dot_precision(q.dtype), BLOCK_D=_block_d(q.shape[3]))  # fmt: skip
    strides = (*q.stride(), *k.stride(), *v.stride(), *_strides(bias, 5), *_strides(mask_offset, 4))
    saved = (q, k, v, bias, mask_offset, do_attn, row_max, row_logsum, delta)
    dk, dv = _backward_dkdv(saved, strides, common, scale, R, C)
    dq, dbias = _backward_dq_dbias(saved, strides, common, scale, R, C, need_dbias)
    return dq, dk, dv, dbias, dgate


def _backward_preprocess(
    do: torch.Tensor, q: torch.Tensor, gate: torch.Tensor | None, o: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward step 1: ``(dO_attn, delta, dgate)`` (``dgate`` None without a gate)."""
    Z, H, NQ, D = q.shape
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    do_attn = torch.empty((Z, H, NQ, D), dtype=q.dtype, device=q.device)  # fed to tl.dot like q
    delta = torch.empty((Z, H, NQ), dtype=acc_torch, device=q.device)
    dgate = torch.empty_like(gate) if gate is not None else None
    pre_block = 32
    _attn_bwd_preprocess[launch_grid(Z * H, triton.cdiv(NQ, pre_block))](
        o, do, gate, do_attn, dgate, delta, *o.stride(), *do.stride(), *_strides(gate, 4), *_strides(dgate, 4),
        H, NQ, D,
        HAS_GATE=gate is not None, ACC_DTYPE=_acc_dtype(q.dtype), BLOCK_M=pre_block, BLOCK_D=_block_d(D),
    )  # fmt: skip
    return do_attn, delta, dgate


def _backward_dkdv(saved: tuple, strides: tuple, common: dict, scale: float, R: int, C: int):
    """Backward step 2: ``(dk, dv)``. ``saved``: q, k, v, bias, mask offset, dO_attn, row max,
    row log-sum, delta."""
    q, k, v, bias = saved[:4]
    Z, H, NQ, D = q.shape
    NK = k.shape[2]
    dk = torch.empty((Z, H, NK, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((Z, H, NK, D), dtype=v.dtype, device=q.device)

    def launch_dkdv(cfg: dict) -> None:
        _attn_bwd_dkdv[launch_grid(Z * H, triton.cdiv(NK, cfg["BLOCK_N"]))](
            *saved, dk, dv, *strides,
            H, NQ, NK, D, R, C, scale, **common, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip

    _launch("attention_bwd_dkdv", _shape_class(q, k, bias is not None, R), q, launch_dkdv)
    return dk, dv


def _backward_dq_dbias(saved: tuple, strides: tuple, common: dict, scale: float, R: int, C: int, need_dbias: bool):
    """Backward step 3: ``(dq, dbias)``, dbias reduced over the R members sharing the bias (None
    unless ``need_dbias``)."""
    q, k, v, bias = saved[:4]
    Z, H, NQ, D = q.shape
    NK = k.shape[2]
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    A = Z // (R * C)
    full_bias_shape = (A, C, H, NQ, NK)
    dbias_full = None
    if need_dbias:
        dtype = bias.dtype if tuple(bias.shape) == full_bias_shape else acc_torch
        dbias_full = torch.empty(full_bias_shape, dtype=dtype, device=q.device)
    dq_in_registers = R == 1
    state = {}

    def launch_dq(cfg: dict) -> None:
        n_blocks = triton.cdiv(NK, cfg["BLOCK_N"])
        splits = 1 if dq_in_registers else min(cfg.get("SPLITS", 1), n_blocks)
        split_blocks = triton.cdiv(n_blocks, splits)
        splits = triton.cdiv(n_blocks, split_blocks)
        alloc = torch.empty if dq_in_registers else torch.zeros
        dq_buf = alloc((splits, Z, H, NQ, D), dtype=acc_torch, device=q.device)
        _attn_bwd_dq_dbias[launch_grid(A * C * H, splits, triton.cdiv(NQ, cfg["BLOCK_M"]))](
            *saved, dq_buf, dbias_full, *strides,
            H, NQ, NK, D, R, C, scale, split_blocks, **common,
            NEED_DBIAS=need_dbias, DQ_IN_REGISTERS=dq_in_registers,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
        state["dq_buf"] = dq_buf

    _launch("attention_bwd_dq", _shape_class(q, k, bias is not None, R), q, launch_dq)
    dq_buf = state["dq_buf"]
    # scaled and cast in one kernel, into q's layout (the same values as scaling in place, then casting)
    dq = torch.mul(dq_buf[0] if dq_buf.shape[0] == 1 else dq_buf.sum(0), scale, out=torch.empty_like(q))

    dbias = None
    if need_dbias:
        reduce_dims = tuple(i for i in range(2, 5) if bias.shape[i] == 1 and full_bias_shape[i] != 1)
        dbias = dbias_full.sum(reduce_dims, keepdim=True) if reduce_dims else dbias_full
        dbias = dbias.to(bias.dtype)
    return dq, dbias
