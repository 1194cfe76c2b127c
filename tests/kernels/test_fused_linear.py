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
