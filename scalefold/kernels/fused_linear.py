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


def projections(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """``[F.linear(x, w, b) for w, b in layers]`` as one product: the weights (and biases, zeros where a layer
    has none) concatenated, the output split into views. Under autocast the input is cast once (not once per
    layer); in backward the outputs' gradients are concatenated (``split``'s backward) and the input's gradient is
    one product accumulated in fp32 (not one product per layer, cast back and summed in the input's dtype)."""
    weight = torch.cat([w for w, _ in layers])
    bias = None
    if any(b is not None for _, b in layers):
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in layers])
    return list(F.linear(x, weight, bias).split([w.shape[0] for w, _ in layers], dim=-1))


__all__ = ["linear_relu", "linear_relu_reference", "projections"]
