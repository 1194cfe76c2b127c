"""A Linear layer and its ReLU in one kernel: cuBLASLt's bias + ReLU epilogue (``torch._addmm_activation``).

The Evoformer's transitions widen to 4x their channels and apply a ReLU there: eagerly the ReLU is a
kernel of its own that reads and writes the widest activation of the block (a quarter of a transition's
bytes, about 38 GB of a step at MLPerf shapes, forward, recycling and recomputation). The epilogue applies
it as the product is written. ``torch._addmm_activation`` has no autograd formula, so
:class:`_LinearReLU` supplies the one eager autograd runs (ReLU's ``threshold_backward`` on the saved
output, then the product's two matrix gradients and the bias sum): the same kernels in backward.

The values are the reference's: the epilogue applies the ReLU to the product before it is rounded to the
output dtype, and ReLU commutes with rounding (it keeps the sign and zeroes the rest), so the output is
bit for bit ``relu(linear(x))`` for the same product (tests/kernels/test_fused_linear.py).

:func:`projections`: several Linear layers of one input (an attention's queries, keys, values and gate) as one
product with the weights concatenated.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class _LinearReLU(torch.autograd.Function):
    """``relu(x @ w.T + b)`` for 2-D ``x``: one product with the ReLU epilogue; eager's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch._addmm_activation(b, x, w.t(), use_gelu=False)
        ctx.save_for_backward(x, w, out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, out = ctx.saved_tensors
        g = torch.ops.aten.threshold_backward(grad, out, 0)
        gx = g.mm(w) if ctx.needs_input_grad[0] else None
        gw = g.t().mm(x) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu(F.linear(x, weight, bias))`` in one product kernel, for ``x`` ``[*, c_in]``. Under autocast the
    operands are cast as autocast casts a linear's (to its dtype), and the product runs outside it."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x, weight, bias = (t if t.dtype == dtype or not t.is_floating_point() else t.to(dtype) for t in (x, weight, bias))
    lead = x.shape[:-1]
    with torch.autocast(device_type=device, enabled=False):
        out = _LinearReLU.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*lead, out.shape[-1])


def linear_relu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch path: ``torch.relu(F.linear(x, weight, bias))``."""
    return torch.relu(F.linear(x, weight, bias))


def _autocast_dtype(device: str) -> torch.dtype | None:
    """Autocast's dtype on ``device`` where it is on, else None (a device autocast does not know, e.g. ``meta``
    under the ahead-of-time check's launch capture: off)."""
    try:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except RuntimeError:
        return None


class _Projections(torch.autograd.Function):
    """``x @ weight.T`` plus the biases on their column spans (zeros elsewhere), for 2-D ``x``; backward: the
    input's and the weight's gradient one product each, each bias's gradient the sum of its own columns only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, spans: tuple, *biases: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.spans = spans
        if not biases:
            return x.mm(weight.t())
        full = weight.new_zeros(weight.shape[0])
        for (start, stop), bias in zip(spans, biases):
            full[start:stop] = bias
        return torch.addmm(full, x, weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gx = grad.mm(weight) if ctx.needs_input_grad[0] else None
        gw = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return (gx, gw, None, *(grad[:, start:stop].sum(0) for start, stop in ctx.spans))


def projections(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """``[F.linear(x, w, b) for w, b in layers]`` as one product: the weights concatenated (and cast once where
    autocast would cast them), the output split into views. Under autocast the input is cast once (not once per
    layer); in backward the outputs' gradients are concatenated (``split``'s backward) and the input's gradient
    is one product accumulated in fp32 (not one product per layer, cast back and summed in the input's dtype);
    a bias's gradient sums its own columns only."""
    device = x.device.type
    autocast = _autocast_dtype(device)
    dtype = autocast or x.dtype
    sizes = [w.shape[0] for w, _ in layers]
    weight = torch.cat([w for w, _ in layers])
    weight = weight if weight.dtype == dtype else weight.to(dtype)
    spans, biases, start = [], [], 0
    for size, (_, b) in zip(sizes, layers):
        if b is not None:
            spans.append((start, start + size))
            biases.append(b if b.dtype == dtype else b.to(dtype))
        start += size
    lead = x.shape[:-1]
    x2 = (x if x.dtype == dtype else x.to(dtype)).reshape(-1, x.shape[-1])
    with torch.autocast(device_type=device, enabled=False) if autocast else contextlib.nullcontext():
        out = _Projections.apply(x2, weight, tuple(spans), *biases)
    return list(out.view(*lead, out.shape[-1]).split(sizes, dim=-1))


__all__ = ["linear_relu", "linear_relu_reference", "projections"]
