"""Triton LayerNorm (multi-row forward, two-stage dW/dB backward) vs the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from scalefold.kernels import reference, triton_ops  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 checked on GPU only")
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _check(shape, dtype, device, w_dtype=torch.float32):
    x = torch.randn(*shape, dtype=dtype, device=device).mul_(3).add_(1).requires_grad_()
    C = shape[-1]
    w = torch.randn(C, dtype=w_dtype, device=device, requires_grad=True)
    b = torch.randn(C, dtype=w_dtype, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    y = triton_ops.layer_norm(x, w, b, 1e-5)
    grads = torch.autograd.grad(y, [x, w, b], dy)
    y_ref = reference.layer_norm(x, w, b, 1e-5)
    ref_grads = torch.autograd.grad(y_ref, [x, w, b], dy)
    assert y.dtype == x.dtype
    for name, a, r in zip(["y", "dx", "dw", "db"], (y,) + grads, (y_ref,) + ref_grads):
        assert a.dtype == r.dtype, name
        scale = max(1.0, r.abs().max().item())
        assert (a.double() - r.double()).abs().max().item() <= TOL[dtype] * scale, name


@pytest.mark.parametrize("C", [64, 96, 384])
def test_fp32_power_of_two_and_odd_hidden(C, device):
    """fp32, hidden 64/96 (non power of two)/384, rows not a multiple of the row block: y, dx, dW, dB."""
    _check((3, 50, C), torch.float32, device)


def test_fp64_to_rounding(device):
    """fp64 statistics and reductions agree with F.layer_norm to rounding (1e-12)."""
    _check((2, 70, 80), torch.float64, device, w_dtype=torch.float64)


def test_fp16_input_fp32_weights(device):
    """Low-precision activations with fp32 weights: statistics in fp32, output in the input dtype."""
    _check((130, 100), torch.float16, device)


def test_non_contiguous_input(device):
    """A transposed (non-contiguous) input is normalised over its last dimension."""
    x = torch.randn(16, 6, 32, device=device).transpose(0, 1)
    w, b = torch.randn(32, device=device), torch.randn(32, device=device)
    assert torch.allclose(triton_ops.layer_norm(x, w, b), reference.layer_norm(x, w, b), atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("C", [64, 128, 256])
def test_bf16_on_gpu(C):
    """bf16 at the model's hidden sizes (GPU only)."""
    _check((4096, C), torch.bfloat16, "cuda")
