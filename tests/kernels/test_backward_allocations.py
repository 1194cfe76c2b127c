"""The Triton operators' backward allocates nothing autograd does not need: their auxiliary outputs (softmax
statistics, LayerNorm statistics, the triangle multiplication's saved planes) get no gradient, and autograd
must not materialise one as a ``zeros`` tensor before calling the backward formula (a launch and a full
write per auxiliary output, every call: 42 per Evoformer block at the MLPerf shapes). Operators are
counted with a ``TorchDispatchMode`` while the backward runs; the gradients still match the reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from scalefold.kernels import reference, triton_ops  # noqa: E402
from scalefold.model.triangle import TriangleMultiplicationOutgoing  # noqa: E402

#: operators that fill a fresh or existing tensor with a constant
FILLS = frozenset({"zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like", "new_full"})


class _OpLog(TorchDispatchMode):
    """Counts the operators dispatched (by overload packet name); a custom op's own inner operators are not
    seen (the mode is off while it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(out: torch.Tensor, leaves: list[torch.Tensor], dout: torch.Tensor) -> tuple[Counter, tuple]:
    with _OpLog() as log:
        grads = torch.autograd.grad(out, leaves, dout)
    return log.ops, grads


def _assert_close(grads, ref_grads, tol: float) -> None:
    for i, (a, r) in enumerate(zip(grads, ref_grads)):
        assert a.shape == r.shape, i
        assert (a - r).abs().max().item() <= tol * max(1.0, r.abs().max().item()), i


def test_attention_backward_fills_nothing(device):
    """The attention op's backward with the main output used alone: no ``zeros`` for the two statistics;
    the gradients of q, k, v, bias and gate are the reference's."""
    q, k, v, g = (torch.randn(2, 2, 2, 6, 8, device=device, requires_grad=True) for _ in range(4))
    bias = torch.randn(2, 1, 2, 6, 6, device=device, requires_grad=True)
    mask = torch.rand(2, 2, 1, 1, 6, device=device) > 0.2
    leaves = [q, k, v, bias, g]
    dout = torch.randn(2, 2, 2, 6, 8, device=device)
    ops, grads = _backward_ops(triton_ops.attention(q, k, v, bias=bias, mask=mask, gate=g), leaves, dout)
    assert ops["attention_bwd"] == 1
    assert not FILLS & set(ops), ops
    _, ref_grads = _backward_ops(reference.attention(q, k, v, bias=bias, mask=mask, gate=g), leaves, dout)
    _assert_close(grads, ref_grads, 1e-4)


def test_layer_norm_backward_fills_nothing(device):
    """The LayerNorm op's backward: no ``zeros`` for the mean and the reciprocal standard deviation."""
    x = torch.randn(3, 5, 16, device=device, requires_grad=True)
    w, b = torch.randn(16, device=device, requires_grad=True), torch.randn(16, device=device, requires_grad=True)
    dout = torch.randn(3, 5, 16, device=device)
    ops, grads = _backward_ops(triton_ops.layer_norm(x, w, b), [x, w, b], dout)
    assert ops["layer_norm_bwd"] == 1
    assert not FILLS & set(ops), ops
    _, ref_grads = _backward_ops(reference.layer_norm(x, w, b), [x, w, b], dout)
    _assert_close(grads, ref_grads, 1e-4)


def test_trimul_backward_fills_nothing(device):
    """The fused triangle multiplication's backward: no ``zeros`` for its nine saved planes and statistics
    (fp32: the interpreter's fp32 dots; the gradients within the fp32 tolerance of the kernel tests)."""
    module = TriangleMultiplicationOutgoing(16, 8).to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    w = module.weights()
    z = torch.randn(1, 5, 5, 16, device=device, requires_grad=True)
    mask = (torch.rand(1, 5, 5, device=device) > 0.25).float()
    leaves = [z, *w]
    dout = torch.randn(1, 5, 5, 16, device=device)
    ops, grads = _backward_ops(triton_ops.triangle_multiplication(z, mask, w, True), leaves, dout)
    assert ops["trimul_bwd"] == 1
    assert not FILLS & set(ops), ops
    _, ref_grads = _backward_ops(reference.triangle_multiplication(z, mask, w, True), leaves, dout)
    _assert_close(grads, ref_grads, 2e-4)


def test_auxiliary_outputs_are_not_differentiable(device):
    """The statistics an op returns beside its output carry no gradient (nothing downstream can ask one)."""
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w, b = torch.ones(16, device=device), torch.zeros(16, device=device)
    y, mean, rstd = torch.ops.scalefold.layer_norm_fwd(x, w, b, 1e-5)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad


def test_attention_module_moves_heads_without_copies(device, monkeypatch):
    """The model's attention (``[*, N, H * D]`` projections viewed as ``[*, H, N, D]`` heads) on the Triton
    kernels copies nothing: the output is stored head-interleaved, so ``o.transpose(-2, -3).reshape(...)`` is a
    view, and the backward writes dq and dgate in the heads' layouts, so their gradients reshape back
    to ``[*, N, H * D]`` as views (dk, dv stay contiguous: one copy each); the bias-free call's gradients match the
    PyTorch path's."""
    from scalefold.model.primitives import Attention

    module = Attention(16, 16, 16, 8, 2).to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 3, 7, 16, device=device, requires_grad=True)
    mask = (torch.rand(2, 3, 1, 1, 7, device=device) > 0.2).float()
    dout = torch.randn(2, 3, 7, 16, device=device)
    leaves = [x, *module.parameters()]
    monkeypatch.setenv("SCALEFOLD_KERNELS", "triton")
    with _OpLog() as forward:
        y = module(x, x, mask=mask)
    assert forward.ops["attention_fwd"] == 1
    ops, grads = _backward_ops(y, leaves, dout)
    assert ops["attention_bwd"] == 1
    assert not {"clone", "contiguous"} & set(forward.ops), forward.ops
    assert ops["clone"] == 2, ops  # dk and dv (contiguous): dq and dgate reshape as views
    monkeypatch.setenv("SCALEFOLD_KERNELS", "torch")
    _, ref_grads = _backward_ops(module(x, x, mask=mask), leaves, dout)
    _assert_close(grads, ref_grads, 1e-4)
