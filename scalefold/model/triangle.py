"""Triangle updates of the pair representation (Supplementary 1.6.5 and 1.6.6).

* :class:`TriangleMultiplicationOutgoing` -- Alg. 11, ``x_ij = sum_k a_ik * b_jk``;
* :class:`TriangleMultiplicationIncoming` -- Alg. 12, ``x_ij = sum_k a_ki * b_kj``;
* :class:`TriangleAttentionStartingNode`  -- Alg. 13, row ``i`` attends over ``j`` with bias ``b_jk``;
* :class:`TriangleAttentionEndingNode`    -- Alg. 14, the same on the transposed pair.

Inputs are ``z`` ``[*, N_res, N_res, c_z]`` and a 0/1 pair mask that broadcasts to
``[*, N_res, N_res]`` (the template stack passes ``[*, 1, N_res, N_res]`` for ``[*, N_templ, ...]``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scalefold import kernels
from scalefold.model.memory import chunked
from scalefold.model.parallel import Plane, gather_cols_async, gather_rows, gather_rows_async
from scalefold.model.primitives import Attention, LayerNorm, Linear


def _pair_mask(mask: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor:
    return z.new_ones(z.shape[:-1]) if mask is None else mask.to(z.dtype)


class TriangleMultiplicativeUpdate(nn.Module):
    """Triangular multiplicative update (Supplementary Alg. 11 / 12).

    ``a = sigmoid(Linear_a_g(z)) * mask * Linear_a_p(z)`` (same for ``b``), combined over the
    third edge ``k``, then ``sigmoid(Linear_g(z)) * Linear_z(LayerNorm(x))``.
    """

    def __init__(self, c_z: int, c_hidden: int, outgoing: bool = True) -> None:
        super().__init__()
        self.outgoing = outgoing
        self.linear_a_p = Linear(c_z, c_hidden, bias=True, init="default")
        self.linear_a_g = Linear(c_z, c_hidden, bias=True, init="gating")
        self.linear_b_p = Linear(c_z, c_hidden, bias=True, init="default")
        self.linear_b_g = Linear(c_z, c_hidden, bias=True, init="gating")
        self.linear_g = Linear(c_z, c_z, bias=True, init="gating")
        self.linear_z = Linear(c_hidden, c_z, bias=True, init="final")
        self.layer_norm_in = LayerNorm(c_z)
        self.layer_norm_out = LayerNorm(c_hidden)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None, plane: Plane | None = None) -> torch.Tensor:
        """``z`` ``[*, N_res, N_res, c_z]``, ``mask`` ``[*, N_res, N_res]`` -> update like ``z``.

        Under DAP (``plane`` given) ``z`` and ``mask`` are row-sharded for the outgoing update
        (``b`` is all-gathered over ``j``) and column-sharded for the incoming one (``a`` is
        all-gathered over ``i``). Without DAP the whole update is one call of the kernels' dispatch
        point (:func:`scalefold.kernels.triangle_multiplication`: the PyTorch operators below, or the
        fused Triton kernels)."""
        if plane is None:
            # the linear layers' weights as their forward would apply them: the model's shared weight casts
            # under autocast (cast with the rest of the block's, so the fused kernels' own casts are no-ops)
            weights = self.weights(z.device.type)
            return kernels.triangle_multiplication(
                z, mask, weights, self.outgoing, self.layer_norm_in.eps, self.layer_norm_out.eps
            )
        mask = _pair_mask(mask, z).unsqueeze(-1)
        # mask: [*, N_res, N_res, 1]
        z = self.layer_norm_in(z)

        # The projection DAP gathers (b outgoing, a incoming) first: its all-gather overlaps the
        # other projection (Duality Async Operation; identity without DAP).
        if self.outgoing:
            b = gather_rows_async(self._project(z, mask, self.linear_b_g, self.linear_b_p), plane)
            a = self._project(z, mask, self.linear_a_g, self.linear_a_p)
            b = b.wait()
        else:
            a = gather_cols_async(self._project(z, mask, self.linear_a_g, self.linear_a_p), plane)
            b = self._project(z, mask, self.linear_b_g, self.linear_b_p)
            a = a.wait()
        # a, b: [*, N_res, N_res, C]

        x = self._combine(a, b)
        # x: [*, N_res, N_res, C]
        x = self.linear_z(self.layer_norm_out(x))
        # x: [*, N_res, N_res, c_z]
        return kernels.sigmoid_gate(x, self.linear_g(z))

    def weights(self, device_type: str | None = None) -> kernels.reference.TrimulWeights:
        """The parameters in the order of :class:`scalefold.kernels.reference.TrimulWeights`; with
        ``device_type``, the linear layers' weights as their forward there would use them (the model's shared
        weight casts under autocast: :meth:`scalefold.model.primitives.Linear.params`; the layer norms' through
        their gradient slots' node, :meth:`scalefold.model.primitives.LayerNorm.params`)."""
        mods = (self.layer_norm_in, self.linear_a_p, self.linear_a_g, self.linear_b_p, self.linear_b_g,
                self.linear_g, self.layer_norm_out, self.linear_z)  # fmt: skip
        return kernels.reference.TrimulWeights(
            *(t for m in mods for t in m.params(device_type))
        )

    @staticmethod
    def _project(z: torch.Tensor, mask: torch.Tensor, gate: nn.Module, proj: nn.Module) -> torch.Tensor:
        return kernels.gated_projection(gate(z), mask, proj(z))

    def _combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Channel-wise matrix product over the shared edge ``k``: ``[*, i, j, C]``."""
        return kernels.reference.triangle_product(a, b, self.outgoing)


class TriangleMultiplicationOutgoing(TriangleMultiplicativeUpdate):
    """Triangular multiplicative update using "outgoing" edges (Supplementary Alg. 11)."""

    def __init__(self, c_z: int, c_hidden: int) -> None:
        super().__init__(c_z, c_hidden, outgoing=True)


class TriangleMultiplicationIncoming(TriangleMultiplicativeUpdate):
    """Triangular multiplicative update using "incoming" edges (Supplementary Alg. 12)."""

    def __init__(self, c_z: int, c_hidden: int) -> None:
        super().__init__(c_z, c_hidden, outgoing=False)


class TriangleAttention(nn.Module):
    """Triangular gated self-attention (Supplementary Alg. 13 / 14).

    Around the starting node, ``z_ij`` attends over ``z_ik`` (keys along the row) with the
    bias ``Linear(LayerNorm(z))_jk``; around the ending node the same runs on the transposed
    pair and mask. ``chunk_size`` splits the query rows.
    """

    def __init__(
        self,
        c_z: int,
        c_hidden: int,
        num_heads: int,
        starting: bool = True,
        inf: float = 1e9,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.starting = starting
        self.chunk_size = chunk_size
        self.layer_norm = LayerNorm(c_z)
        self.linear = Linear(c_z, num_heads, bias=False, init="normal")
        self.mha = Attention(c_z, c_z, c_z, c_hidden, num_heads, gating=True, inf=inf)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None, plane: Plane | None = None) -> torch.Tensor:
        """``z`` ``[*, N_res, N_res, c_z]``, ``mask`` ``[*, N_res, N_res]`` -> update like ``z``.

        Under DAP (``plane`` given) ``z`` and ``mask`` are row-sharded around the starting node and
        column-sharded around the ending node; the bias is all-gathered over its first axis."""
        mask = _pair_mask(mask, z)
        if plane is None and self.chunk_size is None and kernels.resolve_backend("auto", z) == "triton":
            return self._fused(z, mask)
        if not self.starting:
            z = z.transpose(-2, -3)
            mask = mask.transpose(-1, -2)

        z = self.layer_norm(z)
        # Row i is a batch of queries z_ij attending over keys z_ik.
        mask = mask[..., :, None, None, :]
        # mask: [*, N_i, 1, 1, N_k]
        if plane is None and self.chunk_size is None:  # the bias projected with the queries, keys, values, gate
            q, k, v, gate, bias = self.mha.project(z, extra=self.linear)
            z = self.mha.attend(q, k, v, gate, mask, bias.movedim(-1, -3).unsqueeze(-4))
            return z if self.starting else z.transpose(-2, -3)
        bias = gather_rows(self.linear(z), plane).movedim(-1, -3).unsqueeze(-4)
        # bias: [*, 1, H, N_j, N_k] (shared by every row i)

        z = chunked(
            lambda z_, mask_: self.mha(z_, z_, mask=mask_, bias=bias),
            self.chunk_size,
            [z, mask],
            dims=[-3, -4],
            out_dim=-3,
        )
        # z: [*, N_i, N_j, c_z]

        if not self.starting:
            z = z.transpose(-2, -3)
        return z


    def _fused(self, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The fast path (no DAP, no chunking): the LayerNorm and the projections (pair bias, queries, keys, values,
        gate: one product) in ``z``'s own layout; around the ending node the heads and the bias are then the
        transposed views (the attention kernel reads any strides), so the transposed pair is never copied."""
        q, k, v, gate, bias = self.mha.project(self.layer_norm(z), extra=self.linear)
        if not self.starting:
            q, k, v, gate = (t.transpose(-2, -4) for t in (q, k, v, gate))  # [*, j, H, i, C]: row j over the i
            bias, mask = bias.transpose(-2, -3), mask.transpose(-1, -2)
        z = self.mha.attend(q, k, v, gate, mask[..., :, None, None, :], bias.movedim(-1, -3).unsqueeze(-4))
        return z if self.starting else z.transpose(-2, -3)


class TriangleAttentionStartingNode(TriangleAttention):
    """Triangular gated self-attention around the starting node (Supplementary Alg. 13)."""

    def __init__(
        self, c_z: int, c_hidden: int, num_heads: int, inf: float = 1e9, chunk_size: int | None = None
    ) -> None:
        super().__init__(c_z, c_hidden, num_heads, starting=True, inf=inf, chunk_size=chunk_size)


class TriangleAttentionEndingNode(TriangleAttention):
    """Triangular gated self-attention around the ending node (Supplementary Alg. 14)."""

    def __init__(
        self, c_z: int, c_hidden: int, num_heads: int, inf: float = 1e9, chunk_size: int | None = None
    ) -> None:
        super().__init__(c_z, c_hidden, num_heads, starting=False, inf=inf, chunk_size=chunk_size)


__all__ = [
    "TriangleMultiplicativeUpdate",
    "TriangleMultiplicationOutgoing",
    "TriangleMultiplicationIncoming",
    "TriangleAttention",
    "TriangleAttentionStartingNode",
    "TriangleAttentionEndingNode",
]
