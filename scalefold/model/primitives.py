"""Shared primitives: ``Linear`` with AlphaFold2's initialisers, ``LayerNorm`` and gated ``Attention``.

Supplementary section 1.11.4 (parameter initialisation). These three classes are the single
dispatch points through which the fused kernels (``scalefold.kernels``) enter the model: every
module uses them, none calls ``F.layer_norm`` or a softmax-attention of its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from scalefold import kernels

# std of a unit normal truncated to [-2, 2]; dividing by it makes the truncated init have the
# requested variance (as in AlphaFold2 / Haiku's VarianceScaling).
TRUNCATED_NORMAL_STDDEV_FACTOR = 0.87962566103423978

INITS = ("default", "relu", "glorot", "gating", "normal", "final")


def _trunc_normal_(weight: torch.Tensor, scale: float) -> None:
    fan_in = weight.shape[1]
    std = math.sqrt(scale / max(1, fan_in)) / TRUNCATED_NORMAL_STDDEV_FACTOR
    with torch.no_grad():
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


class Linear(nn.Linear):
    """``nn.Linear`` with AlphaFold2's initialisation schemes.

    ``init``:
      * ``default`` -- LeCun (fan-in) truncated normal;
      * ``relu``    -- He truncated normal;
      * ``glorot``  -- Glorot (fan-average) uniform;
      * ``gating``  -- weight 0, bias 1;
      * ``normal``  -- normal with std 1/sqrt(fan_in);
      * ``final``   -- weight 0, bias 0.
    Biases start at zero unless ``init == "gating"``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init: str = "default") -> None:
        super().__init__(in_features, out_features, bias=bias)
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; expected one of {INITS}")
        self.init = init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init = getattr(self, "init", None)
        if init is None:  # called from nn.Linear.__init__ before self.init exists
            return
        with torch.no_grad():
            if init == "default":
                _trunc_normal_(self.weight, 1.0)
            elif init == "relu":
                _trunc_normal_(self.weight, 2.0)
            elif init == "glorot":
                nn.init.xavier_uniform_(self.weight, gain=1.0)
            elif init == "normal":
                nn.init.kaiming_normal_(self.weight, nonlinearity="linear")
            else:  # gating / final
                self.weight.zero_()
            if self.bias is not None:
                self.bias.fill_(1.0 if init == "gating" else 0.0)


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension, dispatched through :func:`scalefold.kernels.layer_norm`."""

    def __init__(self, in_channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.normalized_shape = (in_channels,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(in_channels))
        self.bias = nn.Parameter(torch.zeros(in_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class Attention(nn.Module):
    """Multi-head attention with optional sigmoid gating (Supplementary Alg. 7, 8, 13, 14).

    Parameters ``linear_q/k/v`` (no bias, Glorot), ``linear_o`` (final init) and, when gated,
    ``linear_g`` (gating init) -- the reference model's names. The attention itself runs through
    :func:`scalefold.kernels.attention`.
    """

    def __init__(
        self,
        c_q: int,
        c_k: int,
        c_v: int,
        c_hidden: int,
        num_heads: int,
        gating: bool = True,
        inf: float = 1e9,
    ) -> None:
        super().__init__()
        self.c_hidden = c_hidden
        self.num_heads = num_heads
        self.gating = gating
        self.inf = inf
        self.linear_q = Linear(c_q, c_hidden * num_heads, bias=False, init="glorot")
        self.linear_k = Linear(c_k, c_hidden * num_heads, bias=False, init="glorot")
        self.linear_v = Linear(c_v, c_hidden * num_heads, bias=False, init="glorot")
        self.linear_o = Linear(c_hidden * num_heads, c_q, bias=True, init="final")
        self.linear_g = Linear(c_q, c_hidden * num_heads, bias=True, init="gating") if gating else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [*, N, H * C] -> [*, H, N, C]
        return x.view(x.shape[:-1] + (self.num_heads, self.c_hidden)).transpose(-2, -3)

    def forward(
        self,
        input_q: torch.Tensor,
        input_kv: torch.Tensor,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_q`` ``[*, Q, c_q]``, ``input_kv`` ``[*, K, c_k]``; ``mask`` broadcastable to
        ``[*, H, Q, K]`` (1 = attend); ``bias`` broadcastable to ``[*, H, Q, K]``.
        Returns ``[*, Q, c_q]``."""
        q = self._heads(self.linear_q(input_q))
        k = self._heads(self.linear_k(input_kv))
        v = self._heads(self.linear_v(input_kv))
        gate = self._heads(self.linear_g(input_q)) if self.linear_g is not None else None
        o = kernels.attention(q, k, v, bias=bias, mask=mask, gate=gate, inf=self.inf)
        # o: [*, H, Q, C] -> [*, Q, H * C]
        o = o.transpose(-2, -3)
        o = o.reshape(o.shape[:-2] + (self.num_heads * self.c_hidden,))
        return self.linear_o(o)


__all__ = ["Linear", "LayerNorm", "Attention", "TRUNCATED_NORMAL_STDDEV_FACTOR"]
