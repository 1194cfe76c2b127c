"""Triton kernels: LayerNorm over the last dimension (hidden sizes 64-384+, millions of rows).

Forward: each program normalises ``ROWS`` rows held in registers; the statistics are taken in
fp32 (fp64 for fp64 inputs) in one pass over memory -- the row is loaded once, then
``mean = sum(x) / C`` and ``var = sum((x - mean)^2) / C`` are reduced from registers. ``mean``
and ``rstd`` are saved for the backward.

Backward, two stages and no atomics:

1. ``_ln_bwd_dx``: each program walks a contiguous range of rows, writes
   ``dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat))`` per row and accumulates its partial
   ``dW = sum dy*xhat`` and ``dB = sum dy`` in fp32 registers, stored once per program;
2. ``_ln_bwd_dwdb``: a column reduction over the per-program partials (fixed order, deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalefold.kernels import autotune


@triton.jit
def _ln_fwd(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    M,
    N,
    stride_x,
    stride_y,
    eps,
    ACC_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    io_mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=io_mask, other=0.0).to(ACC_DTYPE)
    # x: [ROWS, BLOCK_N]
    mean = tl.sum(x, 1) / N
    xc = tl.where(io_mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, 1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC_DTYPE)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(ACC_DTYPE)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=io_mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _ln_bwd_dx(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PART,
    DB_PART,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    ROWS_PER_PROGRAM,
    ACC_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC_DTYPE)
    dw = tl.zeros([BLOCK_N], ACC_DTYPE)
    db = tl.zeros([BLOCK_N], ACC_DTYPE)
    first = pid * ROWS_PER_PROGRAM
    for start in range(0, ROWS_PER_PROGRAM, ROWS):
        rows = first + start + tl.arange(0, ROWS)
        row_ok = rows < M
        io_mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=io_mask, other=0.0).to(ACC_DTYPE)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=io_mask, other=0.0).to(ACC_DTYPE)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(io_mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, 1) / N
        c2 = tl.sum(wdy, 1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=io_mask)
        dw += tl.sum(dy * xhat, 0)
        db += tl.sum(dy, 0)
    tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)
    tl.store(DB_PART + pid * N + cols, db, mask=col_ok)


@triton.jit
def _ln_bwd_dwdb(
    DW_PART,
    DB_PART,
    DW,
    DB,
    P,
    N,
    ACC_DTYPE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dw = tl.zeros([BLOCK_P, BLOCK_N], ACC_DTYPE)
    db = tl.zeros([BLOCK_P, BLOCK_N], ACC_DTYPE)
    for start in range(0, P, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts[:, None] < P) & col_ok[None, :]
        offs = parts[:, None].to(tl.int64) * N + cols[None, :]
        dw += tl.load(DW_PART + offs, mask=mask, other=0.0)
        db += tl.load(DB_PART + offs, mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(dw, 0).to(DW.dtype.element_ty), mask=col_ok)
    tl.store(DB + cols, tl.sum(db, 0).to(DB.dtype.element_ty), mask=col_ok)


# Candidate configs: rows per program (forward), rows per inner step and programs (backward).
LAYER_NORM_CONFIGS = [
    {"ROWS": 4, "num_warps": 4, "BWD_PROGRAMS": 1024},
    {"ROWS": 8, "num_warps": 4, "BWD_PROGRAMS": 1024},
    {"ROWS": 16, "num_warps": 8, "BWD_PROGRAMS": 512},
    {"ROWS": 32, "num_warps": 8, "BWD_PROGRAMS": 2048},
]
# Interpreter: few programs (each costs milliseconds), many rows each.
INTERPRETER_CONFIG = {"ROWS": 64, "num_warps": 1, "BWD_PROGRAMS": 2}
DWDB_BLOCK_P = 32
DWDB_BLOCK_N = 64


def _acc(dtype: torch.dtype):
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _launch(x: torch.Tensor, direction: str, launch) -> dict:
    """Launch with the config for this shape class: hidden size ``C`` and rows ``M`` bucketed to a
    power of two (the launch-config table's, or timed with ``SCALEFOLD_AUTOTUNE=1``)."""
    key = autotune.make_key(dict(C=x.shape[-1], M=autotune.size_class(x.shape[0])), x)
    return autotune.get_tuner(f"layer_norm_{direction}", LAYER_NORM_CONFIGS, INTERPRETER_CONFIG).run(key, launch)


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, C]`` (unit stride in C) -> ``(y [M, C], mean [M], rstd [M])``."""
    M, N = x.shape
    acc_tl, acc_torch = _acc(x.dtype)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = torch.empty(M, dtype=acc_torch, device=x.device)
    rstd = torch.empty(M, dtype=acc_torch, device=x.device)

    def launch(cfg: dict) -> None:
        _ln_fwd[(triton.cdiv(M, cfg["ROWS"]),)](
            x, weight, bias, y, mean, rstd, M, N, x.stride(0), y.stride(0), eps,
            ACC_DTYPE=acc_tl, ROWS=cfg["ROWS"], BLOCK_N=triton.next_power_of_2(N), num_warps=cfg["num_warps"],
        )  # fmt: skip

    _launch(x, "fwd", launch)
    return y, mean, rstd


def layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dx [M, C], dweight [C], dbias [C])``."""
    M, N = x.shape
    acc_tl, acc_torch = _acc(x.dtype)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dweight = torch.empty(N, dtype=weight.dtype, device=x.device)
    dbias = torch.empty(N, dtype=weight.dtype, device=x.device)
    block_n = triton.next_power_of_2(N)

    def launch(cfg: dict) -> None:
        rows_per_program = triton.cdiv(triton.cdiv(M, cfg["BWD_PROGRAMS"]), cfg["ROWS"]) * cfg["ROWS"]
        programs = max(1, triton.cdiv(M, rows_per_program))
        dw_part = torch.empty((programs, N), dtype=acc_torch, device=x.device)
        db_part = torch.empty((programs, N), dtype=acc_torch, device=x.device)
        _ln_bwd_dx[(programs,)](
            dy, x, weight, mean, rstd, dx, dw_part, db_part, M, N, dy.stride(0), x.stride(0), dx.stride(0),
            rows_per_program, ACC_DTYPE=acc_tl, ROWS=cfg["ROWS"], BLOCK_N=block_n, num_warps=cfg["num_warps"],
        )  # fmt: skip
        _ln_bwd_dwdb[(triton.cdiv(N, DWDB_BLOCK_N),)](
            dw_part, db_part, dweight, dbias, programs, N,
            ACC_DTYPE=acc_tl, BLOCK_P=DWDB_BLOCK_P, BLOCK_N=DWDB_BLOCK_N,
        )  # fmt: skip

    _launch(x, "bwd", launch)
    return dx, dweight, dbias
