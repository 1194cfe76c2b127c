"""Position-wise two-layer MLPs of the Evoformer: MSA transition (Supplementary Alg. 9) and pair
transition (Alg. 15).

``x -> Linear(n*c -> c)(relu(Linear(c -> n*c)(LayerNorm(x))))``. As in AlphaFold2 and the MLPerf
reference, the mask is accepted but not applied (padded positions never reach valid ones through
a position-wise op).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scalefold.model.primitives import LayerNorm, Linear, LinearReLU


class Transition(nn.Module):
    """LayerNorm, widening ReLU layer (``n`` x channels), projection back (final init)."""

    def __init__(self, c: int, n: int) -> None:
        super().__init__()
        self.layer_norm = LayerNorm(c)
        self.linear_1 = LinearReLU(c, n * c, bias=True, init="relu")
        self.linear_2 = Linear(n * c, c, bias=True, init="final")

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[*, c]`` -> update ``[*, c]``; ``mask`` is ignored (reference semantics)."""
        x = self.layer_norm(x)
        x = self.linear_1(x)  # with its ReLU (in the product's epilogue on the fast path)
        # x: [*, n * c]
        return self.linear_2(x)


class MSATransition(Transition):
    """MSA transition (Supplementary Alg. 9) on ``[*, N_seq, N_res, c_m]``."""

    def __init__(self, c_m: int, n: int = 4) -> None:
        super().__init__(c_m, n)


class PairTransition(Transition):
    """Pair transition (Supplementary Alg. 15) on ``[*, N_res, N_res, c_z]``."""

    def __init__(self, c_z: int, n: int = 4) -> None:
        super().__init__(c_z, n)


__all__ = ["Transition", "MSATransition", "PairTransition"]
