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
:class:`EvoformerBlockCore`, shared with the extra-MSA block (Alg. 18).

Dynamic Axial Parallelism (applied from outside, see :mod:`scalefold.model.parallel`): a stack
whose DAP group is set scatters ``(m, z)`` by rows on entry and gathers them on exit; inside a
block the named calls ``row_to_col`` / ``col_to_row`` switch the sharded axis between the row-wise and column-wise steps
(after 1, after the outer product mean, between the pair updates), and the modules all-gather
their pair biases / projections. With ``dap=None`` every such call is the identity.

Parallel Evoformer (HelixFold, ``parallel=True``): the outer product mean moves to the end of the
block, so the MSA branch (1-3 without OPM) and the pair branch (4-6) are independent; Branch
Parallelism (a BP pair set on the stack) runs them on two ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from scalefold.model.config import EvoformerStackConfig, ExtraMSAStackConfig
from scalefold.model.dropout import DropoutColumnwise, DropoutRowwise, drawing_from
from scalefold.model.memory import run_block
from scalefold.model.msa_attention import MSAColumnAttention, MSARowAttentionWithPairBias
from scalefold.model.outer_product_mean import OuterProductMean
from scalefold.model.parallel import (
    COLS,
    MSA_BRANCH,
    PAIR_BRANCH,
    ROWS,
    Axial,
    Branches,
    ParallelStack,
    Plane,
    BranchGenerators,
    branch_generator,
    col_to_row,
    col_to_row_async,
    mask_cols,
    mask_rows,
    row_to_col,
    split_planes,
)
from scalefold.model.primitives import Linear
from scalefold.model.transitions import MSATransition, PairTransition
from scalefold.model.triangle import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)


class EvoformerBlockCore(nn.Module):
    """MSA transition, outer product mean and the pair stack of one Evoformer / extra-MSA block
    (Supplementary Alg. 6 lines 4-11, Alg. 18 lines 5-12)."""

    def __init__(self, cfg: EvoformerStackConfig | ExtraMSAStackConfig, c_m: int) -> None:
        """``cfg``: the stack's config; ``c_m``: the MSA channels (``c_e`` in the extra-MSA stack)."""
        super().__init__()
        c_z, inf, chunk_size_tri_att = cfg.c_z, cfg.inf, cfg.chunk_size_tri_att
        self.msa_transition = MSATransition(c_m, cfg.transition_n)
        self.outer_product_mean = OuterProductMean(
            c_m, c_z, cfg.c_hidden_opm, eps=cfg.eps_opm, chunk_size=cfg.chunk_size_opm
        )
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z, cfg.c_hidden_tri_mul)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z, cfg.c_hidden_tri_mul)
        self.tri_att_start = TriangleAttentionStartingNode(
            c_z, cfg.c_hidden_tri_att, cfg.num_heads_tri, inf=inf, chunk_size=chunk_size_tri_att
        )
        self.tri_att_end = TriangleAttentionEndingNode(
            c_z, cfg.c_hidden_tri_att, cfg.num_heads_tri, inf=inf, chunk_size=chunk_size_tri_att
        )
        self.pair_transition = PairTransition(c_z, cfg.transition_n)
        self.pair_dropout_rowwise = DropoutRowwise(cfg.pair_dropout)
        self.pair_dropout_columnwise = DropoutColumnwise(cfg.pair_dropout)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        dap: Axial | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Under DAP ``m`` comes column-sharded, ``z`` row-sharded; both leave row-sharded.
        ``msa_mask`` / ``pair_mask`` are always the whole (replicated) masks."""
        msa, pair = split_planes(dap)
        m = m + self.msa_transition(m, mask=mask_cols(msa_mask, msa))
        z = z + self.outer_product_mean(m, mask=msa_mask, msa_plane=msa)
        m = col_to_row_async(m, msa)  # overlapped with the pair stack (forward and backward)
        z = self.pair_stack(z, pair_mask, pair)
        return m.wait(), z

    def pair_stack(self, z: torch.Tensor, pair_mask: torch.Tensor, pair: Plane | None = None) -> torch.Tensor:
        """Triangle updates and pair transition (Alg. 6 lines 6-11); ``z`` row-sharded in and out."""
        rows, cols = mask_rows(pair_mask, pair), mask_cols(pair_mask, pair)
        z = self.pair_dropout_rowwise.add(z, self.tri_mul_out(z, mask=rows, plane=pair), pair, ROWS)
        z = row_to_col(z, pair)
        z = self.pair_dropout_rowwise.add(z, self.tri_mul_in(z, mask=cols, plane=pair), pair, COLS)
        z = col_to_row(z, pair)
        z = self.pair_dropout_rowwise.add(z, self.tri_att_start(z, mask=rows, plane=pair), pair, ROWS)
        z = row_to_col(z, pair)
        z = self.pair_dropout_columnwise.add(z, self.tri_att_end(z, mask=cols, plane=pair), pair, COLS)
        z = z + self.pair_transition(z, mask=cols)
        return col_to_row(z, pair)


# The submodules of each branch of a Parallel Evoformer block (all but the outer product mean).
MSA_BRANCH_MODULES = ("msa_att_row", "msa_att_col", "msa_dropout_rowwise", "core.msa_transition")
PAIR_BRANCH_MODULES = (
    "core.tri_mul_out",
    "core.tri_mul_in",
    "core.tri_att_start",
    "core.tri_att_end",
    "core.pair_transition",
)


class MSABlock(nn.Module):
    """What an Evoformer and an extra-MSA block share: MSA row attention with pair bias (row-wise
    dropout), a column attention (Alg. 8, or the global one of Alg. 19), then the core.

    ``column_attention`` builds the column attention (called between the row attention and the
    rest, so parameters are initialised in the reference's order)."""

    def __init__(
        self, cfg: EvoformerStackConfig | ExtraMSAStackConfig, c_m: int, column_attention: Callable[[], nn.Module]
    ) -> None:
        super().__init__()
        self.msa_att_row = MSARowAttentionWithPairBias(
            c_m, cfg.c_z, cfg.c_hidden_msa_att, cfg.num_heads_msa, inf=cfg.inf, chunk_size=cfg.chunk_size_msa_att
        )
        self.msa_att_col = column_attention()
        self.msa_dropout_rowwise = DropoutRowwise(cfg.msa_dropout)
        self.core = EvoformerBlockCore(cfg, c_m=c_m)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        dap: Axial | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``m`` ``[*, N_seq, N_res, c_m]``, ``z`` ``[*, N_res, N_res, c_z]``, ``msa_mask``
        ``[*, N_seq, N_res]``, ``pair_mask`` ``[*, N_res, N_res]`` -> updated ``(m, z)``.
        Under DAP (``dap``) ``m`` and ``z`` are row-sharded in and out; the column attention runs
        in the column-sharded layout."""
        m = self._msa_attention(m, z, msa_mask, dap)
        return self.core(m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)

    def _msa_attention(self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, dap: Axial | None):
        """Row attention with pair bias, then column attention; ``m`` leaves column-sharded."""
        msa, pair = split_planes(dap)
        row_update = self.msa_att_row(m, z, mask=mask_rows(msa_mask, msa), pair_plane=pair)
        m = self.msa_dropout_rowwise.add(m, row_update, msa, ROWS)
        m = row_to_col(m, msa)
        return m + self.msa_att_col(m, mask=mask_cols(msa_mask, msa))


class EvoformerBlock(MSABlock):
    """One Evoformer block (Supplementary Alg. 6)."""

    def __init__(self, cfg: EvoformerStackConfig, parallel: bool = False) -> None:
        """``cfg``: the stack's config (its block sizes); ``parallel``: a Parallel Evoformer block."""

        def column_attention() -> nn.Module:
            return MSAColumnAttention(
                cfg.c_m, cfg.c_hidden_msa_att, cfg.num_heads_msa, inf=cfg.inf, chunk_size=cfg.chunk_size_msa_att
            )

        super().__init__(cfg, cfg.c_m, column_attention)
        self.parallel = parallel
        # the branches' dropout generators (a stack's blocks share its one): scalefold.distributed.branch_parallel
        self.branch_generators = BranchGenerators() if parallel else None

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        dap: Axial | None = None,
        branch: Branches | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``m`` ``[*, N_seq, N_res, c_m]``, ``z`` ``[*, N_res, N_res, c_z]``, ``msa_mask``
        ``[*, N_seq, N_res]``, ``pair_mask`` ``[*, N_res, N_res]`` -> updated ``(m, z)``.

        Under DAP (``dap``) ``m`` and ``z`` are row-sharded in and out; ``branch`` (this rank's side
        of a BP pair) needs ``parallel=True``."""
        if self.parallel:
            return self._forward_parallel(m, z, msa_mask, pair_mask, dap, branch)
        if branch is not None:
            raise ValueError("Branch Parallelism needs the Parallel Evoformer (parallel=True)")
        return super().forward(m, z, msa_mask, pair_mask, dap)

    def branch_parameters(self) -> list[nn.Parameter]:
        """Parameters of the MSA and the pair branch (one rank of a BP pair updates each)."""
        if not self.parallel:
            return []
        names = MSA_BRANCH_MODULES + PAIR_BRANCH_MODULES
        return [p for name in names for p in self.get_submodule(name).parameters()]

    def _forward_parallel(self, m, z, msa_mask, pair_mask, dap, branch):
        msa, pair = split_planes(dap)
        generators = self.branch_generators
        seeds = generators.block_seeds(self.training)
        if branch is not None:
            m, z = branch.enter(m, z)
        m_new = z_new = None
        if branch is None or branch.runs_msa:
            with drawing_from(branch_generator(generators, seeds, MSA_BRANCH, m.device)):
                m_new = self._msa_attention(m, z, msa_mask, dap)
                m_new = m_new + self.core.msa_transition(m_new, mask=mask_cols(msa_mask, msa))
        if branch is None or branch.runs_pair:
            with drawing_from(branch_generator(generators, seeds, PAIR_BRANCH, z.device)):
                z_new = self.core.pair_stack(z, pair_mask, pair)
        if branch is not None:
            m_shape = m.shape if msa is None else m.shape[:-3] + (msa.rows, msa.padded(msa.cols) // msa.size, m.shape[-1])
            m_new = branch.share(m_new, MSA_BRANCH, m_shape, like=m)
            z_new = branch.share(z_new, PAIR_BRANCH, z.shape, like=z)
        z_new = z_new + self.core.outer_product_mean(m_new, mask=msa_mask, msa_plane=msa)
        return col_to_row(m_new, msa), z_new


class EvoformerStack(ParallelStack):
    """``num_blocks`` Evoformer blocks, then the single representation
    ``s = Linear(m[first row])`` (Supplementary Alg. 2 line 17 / Alg. 6).

    Built from its config: ``EvoformerStack(config.evoformer_stack_config)``.
    ``checkpointing`` recomputes block activations in backward (training with grad only; True every
    block, an int the first that many);
    ``parallel`` builds Parallel Evoformer blocks (the stack Branch Parallelism splits).
    """

    def __init__(self, cfg: EvoformerStackConfig, checkpointing: bool | int = False, parallel: bool = False) -> None:
        super().__init__((EvoformerBlock(cfg, parallel) for _ in range(cfg.num_blocks)), checkpointing)
        self.branch_parallel = parallel
        self.branch_generators = BranchGenerators() if parallel else None  # one stream per branch for the stack
        for block in self.blocks:
            block.branch_generators = self.branch_generators
        self.linear = Linear(cfg.c_m, cfg.c_s, bias=True, init="default")

    def branch_parameters(self) -> list[nn.Parameter]:
        return [p for block in self.blocks for p in block.branch_parameters()]

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        gradient_checkpointing: bool | int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(m, z, s)`` with ``s`` ``[*, N_res, c_s]``.

        ``gradient_checkpointing`` (the reference's forward argument) overrides the constructor's
        ``checkpointing`` when given.
        """
        recompute = self.checkpointed(gradient_checkpointing)
        dap, m, z = self.enter(m, z, n_seq=m.shape[-3])
        for i, block in enumerate(self.blocks):
            m, z = run_block(
                block, i < recompute, m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap, branch=self.branch
            )
        if dap is not None:
            m, z = dap.msa.gather_rows(m, grad="split"), dap.pair.gather_rows(z, grad="split")
        s = self.linear(m[..., 0, :, :])
        # s: [*, N_res, c_s]
        return m, z, s


__all__ = ["EvoformerBlockCore", "MSABlock", "EvoformerBlock", "EvoformerStack", "MSA_BRANCH_MODULES", "PAIR_BRANCH_MODULES"]
