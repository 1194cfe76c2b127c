"""Attention over the MSA representation: row-wise with pair bias, column-wise, column-wise global.

* :class:`MSARowAttentionWithPairBias` -- Supplementary Alg. 7;
* :class:`MSAColumnAttention`          -- Alg. 8;
* :class:`MSAColumnGlobalAttention`    -- Alg. 19 (extra-MSA stack), built on :class:`GlobalAttention`.

All softmax attention runs through :class:`scalefold.model.primitives.Attention` or
:func:`scalefold.kernels.attention`. Masks are 0/1 (1 = valid); masked keys get the reference's
finite ``(mask - 1) * inf`` logit offset.

``chunk_size`` (inference memory saving, Supplementary 1.11.8) splits the leading batch-like axis
(MSA rows for row attention, residues for column attention) into slices processed one after the
other; results are identical to the unchunked computation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from scalefold import kernels
from scalefold.model.memory import chunked
from scalefold.model.parallel import Plane, gather_rows
from scalefold.model.primitives import Attention, LayerNorm, Linear


def _valid(mask: torch.Tensor | None, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The mask in ``x``'s dtype, or all-ones of ``shape`` when absent."""
    if mask is None:
        return x.new_ones(shape)
    return mask.to(x.dtype)


class MSARowAttentionWithPairBias(nn.Module):
    """MSA row-wise gated self-attention with pair bias (Supplementary Alg. 7).

    Each MSA row attends over residues; the logits get a per-head bias projected from the
    (layer-normed) pair representation.
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden: int,
        num_heads: int,
        inf: float = 1e9,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.layer_norm_m = LayerNorm(c_m)
        self.layer_norm_z = LayerNorm(c_z)
        self.linear_z = Linear(c_z, num_heads, bias=False, init="normal")
        self.mha = Attention(c_m, c_m, c_m, c_hidden, num_heads, gating=True, inf=inf)

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None, pair_plane: Plane | None = None
    ) -> torch.Tensor:
        """``m`` ``[*, N_seq, N_res, c_m]``, ``z`` ``[*, N_res, N_res, c_z]``, ``mask``
        ``[*, N_seq, N_res]``. Returns the MSA update ``[*, N_seq, N_res, c_m]``.

        Under DAP (``pair_plane`` given) ``m``, ``mask`` and ``z`` are row-sharded; the bias is
        all-gathered over ``i`` (its backward reduce-scatters)."""
        mask = _valid(mask, m, m.shape[:-1])
        mask = mask[..., :, None, None, :]
        # mask: [*, N_seq, 1, 1, N_res]

        bias = gather_rows(self.linear_z(self.layer_norm_z(z)), pair_plane)
        # bias: [*, N_res, N_res, H]
        bias = bias.movedim(-1, -3).unsqueeze(-4)
        # bias: [*, 1, H, N_res, N_res]

        m = self.layer_norm_m(m)
        return chunked(
            lambda m_, mask_: self.mha(m_, m_, mask=mask_, bias=bias),
            self.chunk_size,
            [m, mask],
            dims=[-3, -4],
            out_dim=-3,
        )
        # [*, N_seq, N_res, c_m]


class MSAColumnAttention(nn.Module):
    """MSA column-wise gated self-attention (Supplementary Alg. 8): each residue column attends
    over the sequences of the MSA."""

    def __init__(
        self,
        c_m: int,
        c_hidden: int,
        num_heads: int,
        inf: float = 1e9,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.layer_norm_m = LayerNorm(c_m)
        self.mha = Attention(c_m, c_m, c_m, c_hidden, num_heads, gating=True, inf=inf)

    def forward(self, m: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``m`` ``[*, N_seq, N_res, c_m]``, ``mask`` ``[*, N_seq, N_res]``.
        Returns the MSA update ``[*, N_seq, N_res, c_m]``."""
        mask = _valid(mask, m, m.shape[:-1])
        m = m.transpose(-2, -3)
        # m: [*, N_res, N_seq, c_m]
        mask = mask.transpose(-1, -2)[..., :, None, None, :]
        # mask: [*, N_res, 1, 1, N_seq]

        m = self.layer_norm_m(m)
        m = chunked(
            lambda m_, mask_: self.mha(m_, m_, mask=mask_),
            self.chunk_size,
            [m, mask],
            dims=[-3, -4],
            out_dim=-3,
        )
        # m: [*, N_res, N_seq, c_m]
        return m.transpose(-2, -3)


class GlobalAttention(nn.Module):
    """Global gated attention (Supplementary Alg. 19, lines 2-7).

    One query per column (the mask-weighted mean of its entries, split into ``num_heads``
    heads); a single key/value head shared by all query heads; the result is gated separately
    for every row. Parameters ``linear_q/k/v/g/o`` as in the reference.
    """

    def __init__(
        self,
        c_in: int,
        c_hidden: int,
        num_heads: int,
        inf: float = 1e9,
        eps: float = 1e-10,
    ) -> None:
        super().__init__()
        self.c_hidden = c_hidden
        self.num_heads = num_heads
        self.inf = inf
        self.eps = eps
        self.linear_q = Linear(c_in, c_hidden * num_heads, bias=False, init="glorot")
        self.linear_k = Linear(c_in, c_hidden, bias=False, init="glorot")
        self.linear_v = Linear(c_in, c_hidden, bias=False, init="glorot")
        self.linear_g = Linear(c_in, c_hidden * num_heads, bias=True, init="gating")
        self.linear_o = Linear(c_hidden * num_heads, c_in, bias=True, init="final")

    def forward(self, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``m`` ``[*, N_res, N_seq, c]`` (column-major MSA), ``mask`` ``[*, N_res, N_seq]``.
        Returns ``[*, N_res, N_seq, c]``."""
        H, C = self.num_heads, self.c_hidden
        mask = mask.to(m.dtype)

        q = torch.sum(m * mask.unsqueeze(-1), dim=-2) / torch.sum(mask, dim=-1).add(self.eps).unsqueeze(-1)
        # q: [*, N_res, c] (mean over the valid sequences)
        q = self.linear_q(q)
        q = q.view(q.shape[:-1] + (1, H, C))
        # q: [*, N_res, 1, H, C] -- the H query heads act as H queries of one attention head

        k = self.linear_k(m).unsqueeze(-3)
        v = self.linear_v(m).unsqueeze(-3)
        # k, v: [*, N_res, 1, N_seq, C] -- a single key/value head shared by all query heads

        o = kernels.attention(q, k, v, mask=mask[..., None, None, :], scale=math.sqrt(1.0 / C), inf=self.inf)
        # o: [*, N_res, 1, H, C], broadcast over the sequences below

        g = self.linear_g(m)
        g = g.view(g.shape[:-1] + (H, C))
        # g: [*, N_res, N_seq, H, C]
        o = kernels.sigmoid_gate(o, g)
        o = o.reshape(o.shape[:-2] + (H * C,))
        # o: [*, N_res, N_seq, H * C]
        return self.linear_o(o)


class MSAColumnGlobalAttention(nn.Module):
    """MSA global column-wise gated self-attention (Supplementary Alg. 19), used by the extra-MSA
    stack in place of Alg. 8 because the extra MSA has many rows."""

    def __init__(
        self,
        c_e: int,
        c_hidden: int,
        num_heads: int,
        inf: float = 1e9,
        eps: float = 1e-10,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.layer_norm_m = LayerNorm(c_e)
        self.global_attention = GlobalAttention(c_e, c_hidden, num_heads, inf=inf, eps=eps)

    def forward(self, m: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``m`` ``[*, N_extra, N_res, c_e]``, ``mask`` ``[*, N_extra, N_res]``.
        Returns the update ``[*, N_extra, N_res, c_e]``."""
        mask = _valid(mask, m, m.shape[:-1])
        m = m.transpose(-2, -3)
        # m: [*, N_res, N_extra, c_e]
        mask = mask.transpose(-1, -2)
        # mask: [*, N_res, N_extra]

        m = self.layer_norm_m(m)
        m = chunked(self.global_attention, self.chunk_size, [m, mask], dims=[-3, -2], out_dim=-3)
        return m.transpose(-2, -3)


__all__ = [
    "MSARowAttentionWithPairBias",
    "MSAColumnAttention",
    "GlobalAttention",
    "MSAColumnGlobalAttention",
]
