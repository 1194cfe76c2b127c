"""The Linear + ReLU with cuBLASLt's epilogue against the two eager kernels (``kernels.linear_relu``)."""

from __future__ import annotations

import pytest
import torch

from scalefold import kernels
from scalefold.kernels import fused_linear
from scalefold.model.transitions import PairTransition
from scalefold.perf.flops import MM, OpCounter


def _grads(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_equals_the_two_eager_kernels(dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 7, 8, dtype=dtype), torch.randn(12, 8, dtype=dtype), torch.randn(12, dtype=dtype)
    out, grads = _grads(fused_linear.linear_relu, x, w, b)
    ref, ref_grads = _grads(fused_linear.linear_relu_reference, x, w, b)
    assert out.shape == (2, 5, 7, 12) and (out == 0).any() and (out > 0).any()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # ReLU commutes with the product's rounding
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-6)


def test_under_autocast_the_operands_are_cast_as_a_linear():
    torch.manual_seed(1)
    x, w, b = torch.randn(6, 8), torch.randn(4, 8), torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear.linear_relu(x, w, b)
        ref = fused_linear.linear_relu_reference(x, w, b)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_the_transition_launches_one_kernel_less_on_the_fast_path(monkeypatch):
    torch.manual_seed(2)
    t = PairTransition(c_z=8, n=4)
    z = torch.randn(1, 5, 5, 8)

    flops: dict[str, int] = {}

    def count(path: str) -> tuple[dict, torch.Tensor]:
        monkeypatch.setenv("SCALEFOLD_KERNELS", path)
        with OpCounter({"": t}) as counter:
            out = t(z)
        flops[path] = sum(sum(v[i] for i in MM) for v in counter.counts.values())
        return {op: k for (_, op), k in counter.ops.items()}, out

    torch_ops, ref = count("torch")
    with torch.no_grad():
        assert torch.equal(kernels.linear_relu(z, t.linear_1.weight, t.linear_1.bias, backend="torch"),
                           torch.relu(t.linear_1(z)))  # fmt: skip
    fast_ops, out = count("triton")
    assert torch_ops.get("relu") == 1 and "relu" not in fast_ops and fast_ops.get("_addmm_activation") == 1
    assert sum(fast_ops.values()) == sum(torch_ops.values()) - 1
    assert flops["triton"] == flops["torch"] == 2 * 25 * 8 * 32 + 2 * 25 * 32 * 8  # the epilogue's product is addmm's
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def _layers(dtype):
    """Four layers of one input (queries, keys, values without bias; a gate with one), as an attention has."""
    return [(torch.randn(12, 8, dtype=dtype), None), (torch.randn(12, 8, dtype=dtype), None),
            (torch.randn(12, 8, dtype=dtype), None), (torch.randn(12, 8, dtype=dtype), torch.randn(12, dtype=dtype))]  # fmt: skip


def test_projections_one_product_equals_the_layers():
    """``kernels.projections``: the fast path's one product (weights concatenated, zeros for the missing biases)
    gives the layers' outputs and every gradient (input, weights, the bias) to rounding (fp64); the PyTorch path
    is the layers one by one, bit for bit."""
    torch.manual_seed(3)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    layers = _layers(torch.float64)
    leaves = [x] + [t for w, b in layers for t in (w, b) if t is not None]
    results = {}
    for backend in ("torch", "triton"):
        inputs = [t.detach().clone().requires_grad_(True) for t in leaves]
        it = iter(inputs[1:])
        pairs = [(next(it), next(it) if b is not None else None) for _, b in layers]
        outs = kernels.projections(inputs[0], pairs, backend=backend)
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o) * (i + 1)).sum() for i, o in enumerate(outs))
        loss.backward()
        results[backend] = ([o.detach() for o in outs], [t.grad for t in inputs])
    (outs, grads), (ref, ref_grads) = results["triton"], results["torch"]
    for i, (w, b) in enumerate(layers):
        assert torch.equal(ref[i], torch.nn.functional.linear(x, w, b))
    assert [o.shape for o in outs] == [o.shape for o in ref]
    for a, r in zip(outs + grads, ref + ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_projections_under_autocast_cast_the_input_once():
    """Under bf16 autocast the one product casts the input once (the layers one by one: once each), and the
    input's gradient is one product (one by one: a product per layer, then sums)."""
    torch.manual_seed(4)
    x = torch.randn(3, 8, requires_grad=True)
    layers = _layers(torch.float32)
    ops = {}
    for backend in ("torch", "triton"):
        with OpCounter({}) as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs = kernels.projections(x, layers, backend=backend)
            sum(o.sum() for o in outs).backward()
        ops[backend] = {}
        for (category, op), k in counter.ops.items():  # an autograd.Function's forward runs without grad
            key = ("backward" if category == "backward" else "forward", op)
            ops[backend][key] = ops[backend].get(key, 0) + k
    fused, ref = ops["triton"], ops["torch"]
    assert fused[("forward", "addmm")] == 1 and ("forward", "mm") not in fused and ref[("forward", "mm")] == 3
    assert fused[("forward", "_to_copy")] <= ref[("forward", "_to_copy")] - 3  # x cast once, not four times
    assert fused[("backward", "mm")] == 1 and ref[("backward", "mm")] == 4  # x's gradient (weights need none)
    assert ("backward", "add") not in fused and ref[("backward", "add")] == 3
    assert fused[("backward", "sum")] == 1  # the gate's bias: its own 12 columns
