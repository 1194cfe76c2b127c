"""The extra-MSA stack (Supplementary 1.7.2, Alg. 18).

Like an Evoformer block, but the many unclustered MSA rows ``e`` ``[*, N_extra, N_res, c_e]``
use *global* column attention (Alg. 19) and only the pair representation leaves the stack.
Block order: row attention with pair bias (row-wise dropout), global column attention, then the
shared :class:`~scalefold.model.evoformer.EvoformerBlockCore` (MSA transition, outer product
mean, triangle updates, pair transition).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scalefold.distributed.axial import ROWS, Axial, mask_cols, mask_rows, row_to_col
from scalefold.model.dropout import DropoutRowwise
from scalefold.model.evoformer import EvoformerBlockCore, enter_stack, run_block, split_planes, use_checkpointing
from scalefold.model.msa_attention import MSAColumnGlobalAttention, MSARowAttentionWithPairBias


class ExtraMSABlock(nn.Module):
    """One extra-MSA block (Supplementary Alg. 18, one iteration)."""

    def __init__(
        self,
        c_e: int,
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
        eps: float = 1e-8,
        eps_opm: float = 1e-3,
        chunk_size_msa_att: int | None = None,
        chunk_size_opm: int | None = None,
        chunk_size_tri_att: int | None = None,
    ) -> None:
        super().__init__()
        self.msa_att_row = MSARowAttentionWithPairBias(
            c_e, c_z, c_hidden_msa_att, num_heads_msa, inf=inf, chunk_size=chunk_size_msa_att
        )
        self.msa_att_col = MSAColumnGlobalAttention(
            c_e, c_hidden_msa_att, num_heads_msa, inf=inf, eps=eps, chunk_size=chunk_size_msa_att
        )
        self.msa_dropout_rowwise = DropoutRowwise(msa_dropout)
        self.core = EvoformerBlockCore(
            c_m=c_e,
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
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        dap: Axial | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``m`` ``[*, N_extra, N_res, c_e]``, ``z`` ``[*, N_res, N_res, c_z]``, ``msa_mask``
        ``[*, N_extra, N_res]``, ``pair_mask`` ``[*, N_res, N_res]`` -> updated ``(m, z)``.
        Under DAP (``dap``) ``m`` and ``z`` are row-sharded in and out; the global column
        attention runs in the column-sharded layout."""
        msa, pair = split_planes(dap)
        row_update = self.msa_att_row(m, z, mask=mask_rows(msa_mask, msa), pair_plane=pair)
        m = m + self.msa_dropout_rowwise(row_update, msa, ROWS)
        m = row_to_col(m, msa)
        m = m + self.msa_att_col(m, mask=mask_cols(msa_mask, msa))
        return self.core(m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)


class ExtraMSAStack(nn.Module):
    """``num_blocks`` extra-MSA blocks; returns only the updated pair representation.

    Built from the reference config dict: ``ExtraMSAStack(**cfg["extra_msa_stack_config"])``.
    ``checkpointing`` recomputes each block's activations in backward (training with grad only).
    """

    def __init__(
        self,
        c_e: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_tri_mul: int,
        c_hidden_tri_att: int,
        num_heads_msa: int,
        num_heads_tri: int,
        num_blocks: int,
        transition_n: int,
        msa_dropout: float,
        pair_dropout: float,
        inf: float = 1e9,
        eps: float = 1e-8,
        eps_opm: float = 1e-3,
        chunk_size_msa_att: int | None = None,
        chunk_size_opm: int | None = None,
        chunk_size_tri_att: int | None = None,
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.dap_group = None  # set by scalefold.distributed (ParallelContext.wrap)
        self.blocks = nn.ModuleList(
            ExtraMSABlock(
                c_e=c_e,
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
                eps=eps,
                eps_opm=eps_opm,
                chunk_size_msa_att=chunk_size_msa_att,
                chunk_size_opm=chunk_size_opm,
                chunk_size_tri_att=chunk_size_tri_att,
            )
            for _ in range(num_blocks)
        )

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        gradient_checkpointing: bool | None = None,
    ) -> torch.Tensor:
        """Returns the updated ``z`` ``[*, N_res, N_res, c_z]``.

        ``gradient_checkpointing`` (the reference's forward argument) overrides the constructor's
        ``checkpointing`` when given.
        """
        requested = self.checkpointing if gradient_checkpointing is None else gradient_checkpointing
        with_checkpoint = use_checkpointing(self, requested)
        dap, m, z = enter_stack(self.dap_group, m, z, n_seq=m.shape[-3])
        for block in self.blocks:
            m, z = run_block(block, with_checkpoint, m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)
        if dap is not None:
            z = dap.pair.gather_rows(z, grad="split")
        return z


__all__ = ["ExtraMSABlock", "ExtraMSAStack"]
