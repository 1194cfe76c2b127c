"""The template pair stack and template pointwise attention (Supplementary 1.7.1, Alg. 16, 17).

Each template's pair features ``t`` ``[*, N_templ, N_res, N_res, c_t]`` go through a small
pair stack (Alg. 16) -- in the reference's order: triangle attention starting node, ending node,
triangle multiplication outgoing, incoming, pair transition -- followed by a final LayerNorm.
The templates are then merged into the pair representation by attention of each ``z_ij`` over
the ``N_templ`` template entries at ``(i, j)`` (Alg. 17).

The template stack masks with the *pair* mask ``[*, N_res, N_res]`` (shared by all templates,
as in the reference); ``template_mask`` ``[*, N_templ]`` is used only by the pointwise
attention. All templates are processed at once (the reference loops over them: identical
results; with dropout active, each template still gets its own masks, drawn in one call).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scalefold.model.config import TemplatePairStackConfig, TemplatePointwiseAttentionConfig
from scalefold.model.dropout import DropoutColumnwise, DropoutRowwise
from scalefold.model.memory import chunked, run_block
from scalefold.model.parallel import COLS, ROWS, ParallelStack, Plane, col_to_row, mask_cols, mask_rows, row_to_col
from scalefold.model.primitives import Attention, LayerNorm
from scalefold.model.transitions import PairTransition
from scalefold.model.triangle import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)


class TemplatePairBlock(nn.Module):
    """One block of the template pair stack (Supplementary Alg. 16, one iteration)."""

    def __init__(self, cfg: TemplatePairStackConfig) -> None:
        super().__init__()
        c_t, chunk_size = cfg.c_t, cfg.chunk_size_tri_att
        self.tri_att_start = TriangleAttentionStartingNode(
            c_t, cfg.c_hidden_tri_att, cfg.num_heads_tri, inf=cfg.inf, chunk_size=chunk_size
        )
        self.tri_att_end = TriangleAttentionEndingNode(
            c_t, cfg.c_hidden_tri_att, cfg.num_heads_tri, inf=cfg.inf, chunk_size=chunk_size
        )
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_t, cfg.c_hidden_tri_mul)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_t, cfg.c_hidden_tri_mul)
        self.pair_transition = PairTransition(c_t, cfg.pair_transition_n)
        self.dropout_rowwise = DropoutRowwise(cfg.dropout_rate)
        self.dropout_columnwise = DropoutColumnwise(cfg.dropout_rate)

    def forward(self, t: torch.Tensor, mask: torch.Tensor, pair: Plane | None = None) -> torch.Tensor:
        """``t`` ``[*, N_templ, N_res, N_res, c_t]``, ``mask`` ``[*, N_res, N_res]`` (pair mask)
        -> updated ``t``. Under DAP (``pair``, a pair plane) ``t`` is row-sharded in and out."""
        mask = mask.unsqueeze(-3)
        # mask: [*, 1, N_res, N_res], shared by all templates
        rows, cols = mask_rows(mask, pair), mask_cols(mask, pair)
        t = self.dropout_rowwise.add(t, self.tri_att_start(t, mask=rows, plane=pair), pair, ROWS)
        t = row_to_col(t, pair)
        t = self.dropout_columnwise.add(t, self.tri_att_end(t, mask=cols, plane=pair), pair, COLS)
        t = col_to_row(t, pair)
        t = self.dropout_rowwise.add(t, self.tri_mul_out(t, mask=rows, plane=pair), pair, ROWS)
        t = row_to_col(t, pair)
        t = self.dropout_rowwise.add(t, self.tri_mul_in(t, mask=cols, plane=pair), pair, COLS)
        t = t + self.pair_transition(t, mask=cols)
        return col_to_row(t, pair)


class TemplatePairStack(ParallelStack):
    """``num_blocks`` template pair blocks and a final LayerNorm (Supplementary Alg. 16).

    Built from its config: ``TemplatePairStack(config.template_pair_stack_config)``.
    ``checkpointing`` recomputes block activations in backward (training with grad only; True every
    block, an int the first that many).
    """

    def __init__(self, cfg: TemplatePairStackConfig, checkpointing: bool | int = False) -> None:
        super().__init__((TemplatePairBlock(cfg) for _ in range(cfg.num_blocks)), checkpointing)
        self.layer_norm = LayerNorm(cfg.c_t)

    def forward(self, t: torch.Tensor, mask: torch.Tensor, gradient_checkpointing: bool | int | None = None) -> torch.Tensor:
        """``t`` ``[*, N_templ, N_res, N_res, c_t]``, ``mask`` ``[*, N_res, N_res]`` (pair mask)
        -> ``t`` of the same shape. ``gradient_checkpointing`` (the reference's forward argument)
        overrides the constructor's ``checkpointing`` when given."""
        recompute = self.checkpointed(gradient_checkpointing)
        dap, _, t = self.enter(None, t, n_seq=None)
        pair = None if dap is None else dap.pair
        for i, block in enumerate(self.blocks):
            t = run_block(block, i < recompute, t, mask=mask, pair=pair)
        if pair is not None:
            t = pair.gather_rows(t, grad="split")
        return self.layer_norm(t)


class TemplatePointwiseAttention(nn.Module):
    """Template pointwise attention (Supplementary Alg. 17): ``z_ij`` (query) attends over the
    templates' ``t_ij`` (keys/values); ungated; masked by ``template_mask``.

    ``chunk_size`` splits the first residue axis.
    """

    def __init__(self, cfg: TemplatePointwiseAttentionConfig) -> None:
        super().__init__()
        self.chunk_size = cfg.chunk_size
        self.mha = Attention(cfg.c_z, cfg.c_t, cfg.c_t, cfg.c_hidden, cfg.num_heads, gating=False, inf=cfg.inf)

    def forward(self, t: torch.Tensor, z: torch.Tensor, template_mask: torch.Tensor) -> torch.Tensor:
        """``t`` ``[*, N_templ, N_res, N_res, c_t]``, ``z`` ``[*, N_res, N_res, c_z]``,
        ``template_mask`` ``[*, N_templ]``. Returns the pair update ``[*, N_res, N_res, c_z]``
        (the caller zeroes it when a sample has no valid template, as the reference does)."""
        t = t.movedim(-4, -2)
        # t: [*, N_res, N_res, N_templ, c_t]
        z = z.unsqueeze(-2)
        # z: [*, N_res, N_res, 1, c_z]
        mask = template_mask.to(z.dtype)[..., None, None, None, None, :]
        # mask: [*, 1, 1, 1, 1, N_templ]
        z = chunked(
            lambda z_, t_: self.mha(z_, t_, mask=mask),
            self.chunk_size,
            [z, t],
            dims=[-4, -4],
            out_dim=-4,
        )
        # z: [*, N_res, N_res, 1, c_z]
        return z.squeeze(-2)


__all__ = ["TemplatePairBlock", "TemplatePairStack", "TemplatePointwiseAttention"]
