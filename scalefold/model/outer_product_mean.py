"""Outer product mean (Supplementary Alg. 10): the MSA -> pair communication of every block."""

from __future__ import annotations

import torch
import torch.nn as nn

from scalefold import kernels
from scalefold.model.parallel import Plane, gather_cols_async, mask_cols
from scalefold.model.primitives import LayerNorm, Linear


class OuterProductMean(nn.Module):
    """Pair update from the mean over MSA rows of the outer product of two projections.

    ``z_ij = Linear(flatten(sum_s a_si (x) b_sj)) / (sum_s mask_si mask_sj + eps)``

    Note the reference order: ``linear_out`` (with its bias) is applied to the *sum*, and the
    result is then divided by the number of valid row pairs plus ``eps``.

    ``chunk_size`` splits the first residue axis ``i`` (the left projection), which is also the
    axis DAP shards; the right projection is used whole.
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden: int,
        eps: float = 1e-3,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.c_hidden = c_hidden
        self.eps = eps
        self.chunk_size = chunk_size
        self.layer_norm = LayerNorm(c_m)
        self.linear_1 = Linear(c_m, c_hidden, bias=True, init="default")
        self.linear_2 = Linear(c_m, c_hidden, bias=True, init="default")
        self.linear_out = Linear(c_hidden * c_hidden, c_z, bias=True, init="final")

    def forward(
        self, m: torch.Tensor, mask: torch.Tensor | None = None, msa_plane: Plane | None = None
    ) -> torch.Tensor:
        """``m`` ``[*, N_seq, N_res, c_m]``, ``mask`` ``[*, N_seq, N_res]``.
        Returns the pair update ``[*, N_res, N_res, c_z]``.

        Under DAP (``msa_plane`` given) ``m`` is column-sharded and ``mask`` is the whole MSA mask;
        the right projection is all-gathered over residues, so the update comes out row-sharded."""
        if mask is None:
            mask = m.new_ones(m.shape[:-2] + (m.shape[-3], msa_plane.cols if msa_plane else m.shape[-2]))
        mask_all = mask.to(m.dtype).unsqueeze(-1)
        mask = mask_cols(mask.to(m.dtype), msa_plane).unsqueeze(-1)
        # mask: [*, N_seq, N_res, 1]

        m = self.layer_norm(m)
        b = gather_cols_async(self.linear_2(m) * mask, msa_plane)  # overlaps the left projection
        a = self.linear_1(m) * mask
        b = b.wait()
        # a, b: [*, N_seq, N_res, C]
        weight, bias = self.linear_out.params(m.device.type)
        # the outer product, its projection and the mean (the fused kernel or the reference's operators)
        return kernels.outer_product_mean(a, b, mask, mask_all, weight, bias, self.eps, self.chunk_size)
        # [*, N_res, N_res, c_z]


__all__ = ["OuterProductMean"]
