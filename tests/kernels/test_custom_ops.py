"""The kernels are registered custom ops: fake-tensor/autograd registration and torch.compile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from scalefold.kernels import reference, triton_ops  # noqa: E402


def test_attention_ops_pass_opcheck(device):
    """``scalefold::attention_fwd`` passes torch.library.opcheck (schema, fake impl, autograd registration)."""
    q = torch.randn(2, 2, 5, 8, requires_grad=True, device=device)
    k, v, g = (torch.randn(2, 2, 5, 8, requires_grad=True, device=device) for _ in range(3))
    bias = torch.randn(1, 1, 2, 5, 5, requires_grad=True, device=device)
    offset = torch.zeros(2, 1, 1, 5, device=device)
    torch.library.opcheck(
        torch.ops.scalefold.attention_fwd.default, (q, k, v, bias, offset, g, 0.35, 2, 1),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip


def test_layer_norm_and_adam_ops_pass_opcheck(device):
    """``layer_norm_fwd`` and the in-place ``adam_swa_`` ops have consistent schemas and fake impls."""
    x = torch.randn(10, 24, requires_grad=True, device=device)
    w, b = torch.randn(24, requires_grad=True, device=device), torch.randn(24, requires_grad=True, device=device)
    torch.library.opcheck(
        torch.ops.scalefold.layer_norm_fwd.default, (x, w, b, 1e-5),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip
    flat = [torch.randn(100, device=device) for _ in range(4)] + [torch.rand(100, device=device)]
    param, grad, m, swa, v = flat
    scalars = (
        torch.tensor(0.5, device=device),
        torch.tensor(-1e-3, dtype=torch.float64, device=device),
        torch.tensor(0.1, dtype=torch.float64, device=device),
    )
    torch.library.opcheck(
        torch.ops.scalefold.adam_swa_.default, (param, grad, m, v, swa, None, *scalars, 0.9, 0.999, 1e-6, 0.9, False),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


def test_attention_under_torch_compile(device):
    """A compiled function calling the Triton attention op (one graph, the op opaque) gives the
    reference's output and gradients (aot_eager on CPU: the op's fake impl and autograd are traced)."""

    def block(q, k, v, bias, g):
        return triton_ops.attention(q * 2.0, k, v, bias=bias, gate=g).sum(-1)

    inputs = [torch.randn(1, 2, 2, 5, 8, requires_grad=True, device=device) for _ in range(3)]
    bias = torch.randn(1, 1, 2, 5, 5, requires_grad=True, device=device)
    g = torch.randn(1, 2, 2, 5, 8, requires_grad=True, device=device)
    leaves = inputs + [bias, g]
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(*inputs, bias, g)
    grads = torch.autograd.grad(out.sum(), leaves)
    ref = reference.attention(inputs[0] * 2.0, *inputs[1:], bias=bias, gate=g).sum(-1)
    ref_grads = torch.autograd.grad(ref.sum(), leaves)
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_layer_norm_under_inductor(device):
    """torch.compile with the default (inductor) backend on CPU: the surrounding ops are generated,
    the LayerNorm custom op stays an opaque call, forward and gradients equal the reference (~8 s)."""

    def block(x, w, b):
        return triton_ops.layer_norm(x * 2.0, w, b).relu()

    x, w, b = (
        torch.randn(10, 32, requires_grad=True, device=device),
        torch.randn(32, requires_grad=True, device=device),
        torch.randn(32, requires_grad=True, device=device),
    )
    y = torch.compile(block, fullgraph=True)(x, w, b)
    grads = torch.autograd.grad(y.sum(), [x, w, b])
    y_ref = reference.layer_norm(x * 2.0, w, b).relu()
    ref_grads = torch.autograd.grad(y_ref.sum(), [x, w, b])
    assert torch.allclose(y, y_ref, atol=1e-5)
    for a, r in zip(grads, ref_grads):
        assert torch.allclose(a, r, atol=1e-4)
