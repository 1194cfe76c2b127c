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

Dynamic Axial Parallelism (``scalefold.distributed``): a stack whose ``dap_group`` is set scatters
``(m, z)`` by rows on entry and gathers them on exit; inside a block the named calls
``row_to_col`` / ``col_to_row`` switch the sharded axis between the row-wise and column-wise steps
(after 1, after the outer product mean, between the pair updates), and the modules all-gather
their pair biases / projections. With ``dap=None`` every such call is the identity.

Parallel Evoformer (HelixFold, ``parallel=True``): the outer product mean moves to the end of the
block, so the MSA branch (1-3 without OPM) and the pair branch (4-6) are independent; Branch
Parallelism (``branch`` set on the stack) runs them on two ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from scalefold.distributed.axial import (
    COLS,
    ROWS,
    Axial,
    col_to_row,
    col_to_row_async,
    mask_cols,
    mask_rows,
    planes,
    row_to_col,
)
from scalefold.distributed.branch_parallel import MSA_BRANCH, PAIR_BRANCH, branch_rng, branch_seeds
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


def split_planes(dap: Axial | None):
    """``(msa_plane, pair_plane)`` of a stack call, ``(None, None)`` without DAP."""
    return (None, None) if dap is None else dap


def enter_stack(dap_group, m: torch.Tensor | None, z: torch.Tensor, n_seq: int | None):
    """Scatter a stack's inputs by rows under DAP; returns ``(dap, m, z)`` (``dap=None`` when off)."""
    if dap_group is None:
        return None, m, z
    dap = planes(dap_group, n_seq, z.shape[-2])
    if m is not None:
        m = dap.msa.scatter_rows(m)
    return dap, m, dap.pair.scatter_rows(z)


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

    def pair_stack(self, z: torch.Tensor, pair_mask: torch.Tensor, pair=None) -> torch.Tensor:
        """Triangle updates and pair transition (Alg. 6 lines 6-11); ``z`` row-sharded in and out."""
        rows, cols = mask_rows(pair_mask, pair), mask_cols(pair_mask, pair)
        z = z + self.pair_dropout_rowwise(self.tri_mul_out(z, mask=rows, plane=pair), pair, ROWS)
        z = row_to_col(z, pair)
        z = z + self.pair_dropout_rowwise(self.tri_mul_in(z, mask=cols, plane=pair), pair, COLS)
        z = col_to_row(z, pair)
        z = z + self.pair_dropout_rowwise(self.tri_att_start(z, mask=rows, plane=pair), pair, ROWS)
        z = row_to_col(z, pair)
        z = z + self.pair_dropout_columnwise(self.tri_att_end(z, mask=cols, plane=pair), pair, COLS)
        z = z + self.pair_transition(z, mask=cols)
        return col_to_row(z, pair)


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
        parallel: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
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
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        dap: Axial | None = None,
        branch=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``m`` ``[*, N_seq, N_res, c_m]``, ``z`` ``[*, N_res, N_res, c_z]``, ``msa_mask``
        ``[*, N_seq, N_res]``, ``pair_mask`` ``[*, N_res, N_res]`` -> updated ``(m, z)``.

        Under DAP (``dap``) ``m`` and ``z`` are row-sharded in and out; ``branch`` (a
        :class:`scalefold.distributed.branch_parallel.Branches`) needs ``parallel=True``."""
        if self.parallel:
            return self._forward_parallel(m, z, msa_mask, pair_mask, dap, branch)
        if branch is not None:
            raise ValueError("Branch Parallelism needs the Parallel Evoformer (parallel=True)")
        m = self._msa_attention(m, z, msa_mask, dap)
        return self.core(m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)

    def _msa_attention(self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, dap: Axial | None):
        """Row attention with pair bias, then column attention; ``m`` leaves column-sharded."""
        msa, pair = split_planes(dap)
        row_update = self.msa_att_row(m, z, mask=mask_rows(msa_mask, msa), pair_plane=pair)
        m = m + self.msa_dropout_rowwise(row_update, msa, ROWS)
        m = row_to_col(m, msa)
        return m + self.msa_att_col(m, mask=mask_cols(msa_mask, msa))

    def _forward_parallel(self, m, z, msa_mask, pair_mask, dap, branch):
        msa, pair = split_planes(dap)
        seeds = branch_seeds(self.training)
        if branch is not None:
            m, z = branch.enter(m, z)
        m_new = z_new = None
        if branch is None or branch.runs_msa:
            with branch_rng(seeds, MSA_BRANCH, m.device):
                m_new = self._msa_attention(m, z, msa_mask, dap)
                m_new = m_new + self.core.msa_transition(m_new, mask=mask_cols(msa_mask, msa))
        if branch is None or branch.runs_pair:
            with branch_rng(seeds, PAIR_BRANCH, z.device):
                z_new = self.core.pair_stack(z, pair_mask, pair)
        if branch is not None:
            m_shape = m.shape if msa is None else m.shape[:-3] + (msa.rows, msa.padded(msa.cols) // msa.size, m.shape[-1])
            m_new = branch.share(m_new, MSA_BRANCH, m_shape, like=m)
            z_new = branch.share(z_new, PAIR_BRANCH, z.shape, like=z)
        z_new = z_new + self.core.outer_product_mean(m_new, mask=msa_mask, msa_plane=msa)
        return col_to_row(m_new, msa), z_new


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
        parallel: bool = False,
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.dap_group = None  # set by scalefold.distributed (ParallelContext.wrap)
        self.branch = None
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
                parallel=parallel,
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
        dap, m, z = enter_stack(self.dap_group, m, z, n_seq=m.shape[-3])
        for block in self.blocks:
            m, z = run_block(
                block, with_checkpoint, m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap, branch=self.branch
            )
        if dap is not None:
            m, z = dap.msa.gather_rows(m, grad="split"), dap.pair.gather_rows(z, grad="split")
        s = self.linear(m[..., 0, :, :])
        # s: [*, N_res, c_s]
        return m, z, s


__all__ = [
    "EvoformerBlockCore",
    "EvoformerBlock",
    "EvoformerStack",
    "enter_stack",
    "run_block",
    "split_planes",
    "use_checkpointing",
]
