"""Triton gated attention with pair bias vs the PyTorch reference (``scalefold.kernels.reference``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from scalefold.kernels import FP64_DOT_TRITON, reference, triton_ops, triton_version  # noqa: E402

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 needs a GPU (interpreter bf16 dot is wrong)"
)
# Triton before 3.5 rejects tl.dot on fp64 operands (compiler and interpreter alike); the dispatch
# then runs fp64 attention through the reference (tests/kernels/test_triton_fallback.py)
requires_fp64_dot = pytest.mark.skipif(
    triton_version() < FP64_DOT_TRITON,
    reason="fp64 tl.dot needs Triton >= 3.5 (found {}.{})".format(*triton_version()),
)

TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def _inputs(batch, H, NQ, NK, D, dtype, device, bias_shape=None, gate=True, mask_shape=None, masked_rows=()):
    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()

    q, k, v = randn(*batch, H, NQ, D), randn(*batch, H, NK, D), randn(*batch, H, NK, D)
    g = randn(*batch, H, NQ, D) if gate else None
    bias = randn(*bias_shape) if bias_shape is not None else None
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(*mask_shape, device=device) > 0.3).to(dtype)
        mask[..., 0] = 1.0
        for idx in masked_rows:  # every key of this batch member masked
            mask[idx] = 0.0
    do = torch.randn(*batch, H, NQ, D, dtype=dtype, device=device)
    return q, k, v, bias, mask, g, do


def _compare(q, k, v, bias, mask, g, do, ref_dtype=None):
    """Forward and every gradient of the kernel vs the reference (in ``ref_dtype`` if given)."""
    leaves = [t for t in (q, k, v, bias, g) if t is not None]
    out = triton_ops.attention(q, k, v, bias=bias, mask=mask, gate=g)
    grads = torch.autograd.grad(out, leaves, do)
    if ref_dtype is not None:
        cast = [t.detach().to(ref_dtype).requires_grad_() if t is not None else None for t in (q, k, v, bias, g)]
        rq, rk, rv, rbias, rg = cast
        rmask, rdo = (mask.to(ref_dtype) if mask is not None else None), do.to(ref_dtype)
        rleaves = [t for t in cast if t is not None]
    else:
        rq, rk, rv, rbias, rg, rmask, rdo, rleaves = q, k, v, bias, g, mask, do, leaves
    ref = reference.attention(rq, rk, rv, bias=rbias, mask=rmask, gate=rg)
    ref_grads = torch.autograd.grad(ref, rleaves, rdo)
    tol = TOL[q.dtype]
    names = ["o", "dq", "dk", "dv"] + (["dbias"] if bias is not None else []) + (["dgate"] if g is not None else [])
    for name, a, b in zip(names, (out,) + grads, (ref,) + ref_grads):
        assert a.shape == b.shape and a.dtype == q.dtype, name
        assert torch.isfinite(a).all(), name
        scale = max(1.0, b.abs().max().item())
        assert (a.to(b.dtype) - b).abs().max().item() <= tol * scale, name


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float64, marks=requires_fp64_dot)])
def test_msa_row_attention_bias_shared_over_sequences(dtype, device):
    """MSA row attention: bias [B,1,H,N,N] shared by the S sequences (gradient reduced over S in the
    kernel), odd N, padding mask with one fully masked sequence, gate: o and dq/dk/dv/dbias/dgate
    equal the reference."""
    B, S, H, N, D = 1, 3, 2, 17, 16
    _compare(*_inputs((B, S), H, N, N, D, dtype, device, bias_shape=(B, 1, H, N, N),
                      mask_shape=(B, S, 1, 1, N), masked_rows=[(0, 1)]))  # fmt: skip


def test_triangle_attention_bias_shared_over_rows(device):
    """Triangle attention: batch [B, I], bias [B,1,H,J,K] shared over rows i, head dim 8, N=5."""
    B, N, H, D = 2, 5, 2, 8
    _compare(*_inputs((B, N), H, N, N, D, torch.float32, device, bias_shape=(B, 1, H, N, N),
                      mask_shape=(B, N, 1, 1, N), masked_rows=[(1, 2)]))  # fmt: skip


def test_column_attention_without_bias(device):
    """MSA column attention: no pair bias, gated, padding mask incl. a fully masked column."""
    _compare(*_inputs((2, 3), 2, 5, 5, 8, torch.float32, device, mask_shape=(2, 3, 1, 1, 5), masked_rows=[(0, 2)]))


def test_ungated_unshared_bias_and_rectangular(device):
    """No gate, a bias that is not shared (one per batch member), Nq != Nk, no mask."""
    _compare(*_inputs((2,), 2, 5, 7, 8, torch.float32, device, bias_shape=(2, 2, 5, 7), gate=False))


def test_multiple_blocks_per_row_and_column(device):
    """N larger than the block size (33 > 32 in the interpreter; ragged last block) in both axes."""
    _compare(*_inputs((1, 2), 1, 33, 40, 8, torch.float32, device, bias_shape=(1, 1, 1, 33, 40),
                      mask_shape=(1, 2, 1, 1, 40)))  # fmt: skip


def test_bias_shared_over_non_adjacent_axes_falls_back(device):
    """A bias broadcast over two separate batch axes (and over heads) is still differentiated correctly."""
    _compare(*_inputs((2, 2, 2), 2, 5, 5, 8, torch.float32, device, bias_shape=(1, 2, 1, 1, 5, 5)))


def test_fp16_against_fp32_reference(device):
    """fp16 inputs (scores and softmax statistics in fp32) agree with the fp32 reference."""
    _compare(*_inputs((1, 2), 2, 17, 17, 16, torch.float16, device, bias_shape=(1, 1, 2, 17, 17),
                      mask_shape=(1, 2, 1, 1, 17), masked_rows=[(0, 1)]), ref_dtype=torch.float32)  # fmt: skip


@requires_fp64_dot
def test_fully_masked_row_matches_reference_semantics(device):
    """A fully masked row behaves like the reference's finite -1e9 offset: in fp64 it is the softmax
    of the remaining score+bias terms, in fp32 the uniform average of v -- never NaN."""
    H, N, D = 1, 5, 8
    q, k, v, bias, _, _, _ = _inputs((1,), H, N, N, D, torch.float64, device, bias_shape=(1, H, N, N), gate=False)
    mask = torch.zeros(1, 1, 1, N, dtype=torch.float64, device=device)
    with torch.no_grad():
        out = triton_ops.attention(q, k, v, bias=bias, mask=mask)
        unmasked = reference.attention(q, k, v, bias=bias)
        assert torch.allclose(out, unmasked, atol=1e-6)
        out32 = triton_ops.attention(q.float(), k.float(), v.float(), bias=bias.float(), mask=mask.float())
        uniform = v.float().mean(-2, keepdim=True).expand_as(out32)
        assert torch.allclose(out32, uniform, atol=1e-6)


def test_bias_gradient_is_deterministic(device):
    """The bias gradient (reduced over the sharing axis without atomics) is bitwise reproducible."""
    q, k, v, bias, mask, g, do = _inputs((1, 4), 2, 9, 9, 8, torch.float32, device, bias_shape=(1, 1, 2, 9, 9))
    runs = [torch.autograd.grad(triton_ops.attention(q, k, v, bias=bias, gate=g), [bias], do)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@requires_cuda
@pytest.mark.parametrize("shape", [((1, 8), 4, 64, 32), ((1, 5), 2, 37, 16)])
def test_bf16_on_gpu(shape):
    """bf16 numerics (GPU only: the interpreter's bf16 dot is wrong) vs an fp32 reference."""
    batch, H, N, D = shape
    _compare(*_inputs(batch, H, N, N, D, torch.bfloat16, "cuda", bias_shape=(1, 1, H, N, N),
                      mask_shape=batch + (1, 1, N), masked_rows=[(0, 1)]), ref_dtype=torch.float32)  # fmt: skip


def test_launch_grids_fit_cuda_at_the_mlperf_template_shape():
    """The template pointwise attention batches every residue pair: 256^2 pairs x 4 heads at the MLPerf
    crop. That batch x head index lives on grid axis 0 (up to 2^31 - 1); axes 1 and 2 (row blocks, dQ
    splits) stay far below CUDA's 65,535 cap, and a grid past a cap is refused with a message instead
    of CUDA's bare "invalid argument"."""
    from scalefold.kernels.attention_triton import MAX_GRID, launch_grid

    pairs_x_heads = 256 * 256 * 4
    assert launch_grid(pairs_x_heads, 1) == (pairs_x_heads, 1)
    assert launch_grid(pairs_x_heads, 4, 1) == (pairs_x_heads, 4, 1)
    with pytest.raises(ValueError, match="axis 1 has 262144 blocks"):
        launch_grid(1, pairs_x_heads)  # the orientation the kernels had before
    assert MAX_GRID[1] == MAX_GRID[2] == 65535


def test_key_splits_of_the_dq_kernel(device, monkeypatch):
    """dQ accumulated over two key splits (one fp32 buffer per split, summed afterwards) with two
    bias groups (A = 2): each split's slice of the buffer is indexed by the number of batch members
    (A * R * C), not by the number of query blocks (2 here, so a wrong index mixes members)."""
    from scalefold.kernels import attention_triton, autotune

    monkeypatch.setattr(autotune, "_tuners", {})  # fresh tuners see the patched candidates
    monkeypatch.setattr(attention_triton, "INTERPRETER_CONFIG", dict(attention_triton.INTERPRETER_CONFIG, SPLITS=2))
    for table in (attention_triton.ATTENTION_CONFIGS, attention_triton.ATTENTION_EXACT_CONFIGS):
        split = [dict(c, SPLITS=2) for c in autotune.Tuner("dq", table["attention_bwd_dq"], {}).candidates()]
        monkeypatch.setitem(table, "attention_bwd_dq", split)
    _compare(*_inputs((2, 3), 2, 40, 40, 8, torch.float32, device, bias_shape=(2, 1, 2, 40, 40),
                      mask_shape=(2, 3, 1, 1, 40)))  # fmt: skip
