"""The extra-MSA stack (Supplementary 1.7.2, Alg. 18).

Like an Evoformer block, but the many unclustered MSA rows ``e`` ``[*, N_extra, N_res, c_e]``
use *global* column attention (Alg. 19) and only the pair representation leaves the stack.
Block order (the shared :class:`~scalefold.model.evoformer.MSABlock`): row attention with pair bias
(row-wise dropout), global column attention, then the
:class:`~scalefold.model.evoformer.EvoformerBlockCore` (MSA transition, outer product mean,
triangle updates, pair transition).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scalefold.model.config import ExtraMSAStackConfig
from scalefold.model.evoformer import MSABlock
from scalefold.model.memory import run_block
from scalefold.model.msa_attention import MSAColumnGlobalAttention
from scalefold.model.parallel import ParallelStack


class ExtraMSABlock(MSABlock):
    """One extra-MSA block (Supplementary Alg. 18, one iteration): an Evoformer block whose column
    attention is the global one (Alg. 19); ``m`` is the extra MSA ``[*, N_extra, N_res, c_e]``."""

    def __init__(self, cfg: ExtraMSAStackConfig) -> None:
        def column_attention() -> nn.Module:
            return MSAColumnGlobalAttention(
                cfg.c_e, cfg.c_hidden_msa_att, cfg.num_heads_msa, inf=cfg.inf, eps=cfg.eps,
                chunk_size=cfg.chunk_size_msa_att,
            )  # fmt: skip

        super().__init__(cfg, cfg.c_e, column_attention)


class ExtraMSAStack(ParallelStack):
    """``num_blocks`` extra-MSA blocks; returns only the updated pair representation.

    Built from its config: ``ExtraMSAStack(config.extra_msa_stack_config)``.
    ``checkpointing`` recomputes block activations in backward (training with grad only; True every
    block, an int the first that many).
    """

    def __init__(self, cfg: ExtraMSAStackConfig, checkpointing: bool | int = False) -> None:
        super().__init__((ExtraMSABlock(cfg) for _ in range(cfg.num_blocks)), checkpointing)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        gradient_checkpointing: bool | int | None = None,
    ) -> torch.Tensor:
        """Returns the updated ``z`` ``[*, N_res, N_res, c_z]``.

        ``gradient_checkpointing`` (the reference's forward argument) overrides the constructor's
        ``checkpointing`` when given.
        """
        recompute = self.checkpointed(gradient_checkpointing)
        dap, m, z = self.enter(m, z, n_seq=m.shape[-3])
        for i, block in enumerate(self.blocks):
            m, z = run_block(block, i < recompute, m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)
        if dap is not None:
            z = dap.pair.gather_rows(z, grad="split")
        return z


__all__ = ["ExtraMSABlock", "ExtraMSAStack"]
