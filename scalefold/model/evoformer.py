"""The Evoformer (Supplementary 1.6, Alg. 6): block, its MSA/pair "core", and the stack.

One block updates the MSA representation ``m`` ``[*, N_seq, N_res, c_m]`` and the pair
representation ``z`` ``[*, N_res, N_res, c_z]``:

1. MSA row attention with pair bias (Alg. 7), row-wise dropout;
2. MSA column attention (Alg. 8);
3. (core) MSA transition (Alg. 9), outer product mean (Alg. 10);
4. (core) triangle multiplication outgoing / incoming (Alg. 11, 12), row-wise dropout;
5. (core) triangle attention starting node (Alg. 13, row-wise dropout) / ending node
   (Alg. 14, column-wise dropout);
6. (core) pair transition (Alg. 15).

Every step is a residual update ``x = x + dropout(f(x))``. Steps 3-6 form
:class:`EvoformerBlockCore`, shared with the extra-MSA block (Alg. 18). Under Dynamic Axial
Parallelism the layout switches go between the row-wise and column-wise steps (after 1, after
the outer product mean, and between the pair updates); they are not part of this module.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from scalefold.model.dropout import DropoutColumnwise, DropoutRowwise
from scalefold.model.msa_attention import MSAColumnAttention, MSARowAttentionWithPairBias
from scalefold.model.outer_product_mean import OuterProductMean
from scalefold.model.primitives import Linear
from scalefold.model.transitions import MSATransition, PairTransition
from scalefold.model.triangle import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)


def use_checkpointing(module: nn.Module, requested: bool) -> bool:
    """Activation checkpointing applies only when requested, in training, with grad enabled."""
    return requested and module.training and torch.is_grad_enabled()


def run_block(block: nn.Module, with_checkpoint: bool, *args: torch.Tensor, **kwargs: torch.Tensor):
    """Run ``block(*args, **kwargs)``, recomputing its activations in backward if asked.

    Non-reentrant ``torch.utils.checkpoint`` (RNG state preserved, so dropout masks are redrawn
    identically in the recomputation).
    """
    if with_checkpoint:
        return checkpoint(block, *args, use_reentrant=False, **kwargs)
    return block(*args, **kwargs)


class EvoformerBlockCore(nn.Module):
    """MSA transition, outer product mean and the pair stack of one Evoformer / extra-MSA block
    (Supplementary Alg. 6 lines 4-11, Alg. 18 lines 5-12)."""

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_opm: int,
        c_hidden_tri_mul: int,
        c_hidden_tri_att: int,
        num_heads_tri: int,
        transition_n: int,
        pair_dropout: float,
        inf: float = 1e9,
        eps_opm: float = 1e-3,
        chunk_size_opm: int | None = None,
        chunk_size_tri_att: int | None = None,
    ) -> None:
        super().__init__()
        self.msa_transition = MSATransition(c_m, transition_n)
        self.outer_product_mean = OuterProductMean(c_m, c_z, c_hidden_opm, eps=eps_opm, chunk_size=chunk_size_opm)
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z, c_hidden_tri_mul)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z, c_hidden_tri_mul)
        self.tri_att_start = TriangleAttentionStartingNode(
            c_z, c_hidden_tri_att, num_heads_tri, inf=inf, chunk_size=chunk_size_tri_att
        )
        self.tri_att_end = TriangleAttentionEndingNode(
            c_z, c_hidden_tri_att, num_heads_tri, inf=inf, chunk_size=chunk_size_tri_att
        )
        self.pair_transition = PairTransition(c_z, transition_n)
        self.pair_dropout_rowwise = DropoutRowwise(pair_dropout)
        self.pair_dropout_columnwise = DropoutColumnwise(pair_dropout)

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, pair_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = m + self.msa_transition(m, mask=msa_mask)
        z = z + self.outer_product_mean(m, mask=msa_mask)
        z = z + self.pair_dropout_rowwise(self.tri_mul_out(z, mask=pair_mask))
        z = z + self.pair_dropout_rowwise(self.tri_mul_in(z, mask=pair_mask))
        z = z + self.pair_dropout_rowwise(self.tri_att_start(z, mask=pair_mask))
        z = z + self.pair_dropout_columnwise(self.tri_att_end(z, mask=pair_mask))
        z = z + self.pair_transition(z, mask=pair_mask)
        return m, z


class EvoformerBlock(nn.Module):
    """One Evoformer block (Supplementary Alg. 6)."""

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_tri_mul: int,
        c_hidden_tri_att: int,
        num_heads_msa: int,
        num_heads_tri: int,
        transition_n: int,
        msa_dropout: float,
        pair_dropout: float,
        inf: float = 1e9,
        eps_opm: float = 1e-3,
        chunk_size_msa_att: int | None = None,
        chunk_size_opm: int | None = None,
        chunk_size_tri_att: int | None = None,
    ) -> None:
        super().__init__()
        self.msa_att_row = MSARowAttentionWithPairBias(
            c_m, c_z, c_hidden_msa_att, num_heads_msa, inf=inf, chunk_size=chunk_size_msa_att
        )
        self.msa_att_col = MSAColumnAttention(
            c_m, c_hidden_msa_att, num_heads_msa, inf=inf, chunk_size=chunk_size_msa_att
        )
        self.msa_dropout_rowwise = DropoutRowwise(msa_dropout)
        self.core = EvoformerBlockCore(
            c_m=c_m,
            c_z=c_z,
            c_hidden_opm=c_hidden_opm,
            c_hidden_tri_mul=c_hidden_tri_mul,
            c_hidden_tri_att=c_hidden_tri_att,
            num_heads_tri=num_heads_tri,
            transition_n=transition_n,
            pair_dropout=pair_dropout,
            inf=inf,
            eps_opm=eps_opm,
            chunk_size_opm=chunk_size_opm,
            chunk_size_tri_att=chunk_size_tri_att,
        )

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, pair_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``m`` ``[*, N_seq, N_res, c_m]``, ``z`` ``[*, N_res, N_res, c_z]``, ``msa_mask``
        ``[*, N_seq, N_res]``, ``pair_mask`` ``[*, N_res, N_res]`` -> updated ``(m, z)``."""
        m = m + self.msa_dropout_rowwise(self.msa_att_row(m, z, mask=msa_mask))
        m = m + self.msa_att_col(m, mask=msa_mask)
        return self.core(m, z, msa_mask=msa_mask, pair_mask=pair_mask)


class EvoformerStack(nn.Module):
    """``num_blocks`` Evoformer blocks, then the single representation
    ``s = Linear(m[first row])`` (Supplementary Alg. 2 line 17 / Alg. 6).

    Built from the reference config dict: ``EvoformerStack(**cfg["evoformer_stack_config"])``.
    ``checkpointing`` recomputes each block's activations in backward (training with grad only).
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_tri_mul: int,
        c_hidden_tri_att: int,
        c_s: int,
        num_heads_msa: int,
        num_heads_tri: int,
        num_blocks: int,
        transition_n: int,
        msa_dropout: float,
        pair_dropout: float,
        inf: float = 1e9,
        eps_opm: float = 1e-3,
        chunk_size_msa_att: int | None = None,
        chunk_size_opm: int | None = None,
        chunk_size_tri_att: int | None = None,
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.blocks = nn.ModuleList(
            EvoformerBlock(
                c_m=c_m,
                c_z=c_z,
                c_hidden_msa_att=c_hidden_msa_att,
                c_hidden_opm=c_hidden_opm,
                c_hidden_tri_mul=c_hidden_tri_mul,
                c_hidden_tri_att=c_hidden_tri_att,
                num_heads_msa=num_heads_msa,
                num_heads_tri=num_heads_tri,
                transition_n=transition_n,
                msa_dropout=msa_dropout,
                pair_dropout=pair_dropout,
                inf=inf,
                eps_opm=eps_opm,
                chunk_size_msa_att=chunk_size_msa_att,
                chunk_size_opm=chunk_size_opm,
                chunk_size_tri_att=chunk_size_tri_att,
            )
            for _ in range(num_blocks)
        )
        self.linear = Linear(c_m, c_s, bias=True, init="default")

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        gradient_checkpointing: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(m, z, s)`` with ``s`` ``[*, N_res, c_s]``.

        ``gradient_checkpointing`` (the reference's forward argument) overrides the constructor's
        ``checkpointing`` when given.
        """
        requested = self.checkpointing if gradient_checkpointing is None else gradient_checkpointing
        with_checkpoint = use_checkpointing(self, requested)
        for block in self.blocks:
            m, z = run_block(block, with_checkpoint, m, z, msa_mask=msa_mask, pair_mask=pair_mask)
        s = self.linear(m[..., 0, :, :])
        # s: [*, N_res, c_s]
        return m, z, s


__all__ = [
    "EvoformerBlockCore",
    "EvoformerBlock",
    "EvoformerStack",
    "run_block",
    "use_checkpointing",
]
