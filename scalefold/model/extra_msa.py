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

from scalefold.model.config import ExtraMSAStackConfig
from scalefold.model.dropout import DropoutRowwise
from scalefold.model.evoformer import EvoformerBlockCore
from scalefold.model.memory import run_block
from scalefold.model.msa_attention import MSAColumnGlobalAttention, MSARowAttentionWithPairBias
from scalefold.model.parallel import ROWS, Axial, ParallelStack, mask_cols, mask_rows, row_to_col, split_planes


class ExtraMSABlock(nn.Module):
    """One extra-MSA block (Supplementary Alg. 18, one iteration)."""

    def __init__(self, cfg: ExtraMSAStackConfig) -> None:
        super().__init__()
        c_e, inf, chunk_size = cfg.c_e, cfg.inf, cfg.chunk_size_msa_att
        self.msa_att_row = MSARowAttentionWithPairBias(
            c_e, cfg.c_z, cfg.c_hidden_msa_att, cfg.num_heads_msa, inf=inf, chunk_size=chunk_size
        )
        self.msa_att_col = MSAColumnGlobalAttention(
            c_e, cfg.c_hidden_msa_att, cfg.num_heads_msa, inf=inf, eps=cfg.eps, chunk_size=chunk_size
        )
        self.msa_dropout_rowwise = DropoutRowwise(cfg.msa_dropout)
        self.core = EvoformerBlockCore(cfg, c_m=c_e)

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


class ExtraMSAStack(ParallelStack):
    """``num_blocks`` extra-MSA blocks; returns only the updated pair representation.

    Built from its config: ``ExtraMSAStack(config.extra_msa_stack_config)``.
    ``checkpointing`` recomputes each block's activations in backward (training with grad only).
    """

    def __init__(self, cfg: ExtraMSAStackConfig, checkpointing: bool = False) -> None:
        super().__init__((ExtraMSABlock(cfg) for _ in range(cfg.num_blocks)), checkpointing)

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
        with_checkpoint = self.with_checkpoint(gradient_checkpointing)
        dap, m, z = self.enter(m, z, n_seq=m.shape[-3])
        for block in self.blocks:
            m, z = run_block(block, with_checkpoint, m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)
        if dap is not None:
            z = dap.pair.gather_rows(z, grad="split")
        return z


__all__ = ["ExtraMSABlock", "ExtraMSAStack"]
