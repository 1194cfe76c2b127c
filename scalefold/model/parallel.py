"""The model's one seam to model parallelism (``scalefold.distributed``): DAP and BP.

The model runs as it is on one rank; :func:`scalefold.distributed.parallelize.parallelize` applies
Dynamic Axial Parallelism and Branch Parallelism from outside, and needs only this of it:

* ``model.parallel_stacks()`` -- the stacks of blocks DAP shards (template pair, extra-MSA,
  Evoformer), each a :class:`ParallelStack`;
* on each stack, :meth:`ParallelStack.set_parallelism` (its DAP group, and the BP pair for the
  Parallel Evoformer) and the parameters whose gradients are partial over those groups
  (:meth:`~ParallelStack.sharded_parameters`, :meth:`~ParallelStack.branch_parameters`).

Inside a stack the blocks see DAP only as an :class:`Axial` (``None`` when off) handed down by the
stack, and through the named layout switches re-exported here, each the identity on ``None``.
Those switches are inherent to DAP (a row-wise step needs whole rows, a column-wise step whole
columns), so the blocks name them; everything else about the groups stays outside the model. No
other module of ``scalefold.model`` imports ``scalefold.distributed``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from scalefold.distributed.axial import (
    COLS,
    ROWS,
    Axial,
    Plane,
    col_to_row,
    col_to_row_async,
    gather_cols_async,
    gather_rows,
    gather_rows_async,
    mask_cols,
    mask_rows,
    planes,
    row_to_col,
)
from scalefold.distributed.branch_parallel import (
    MSA_BRANCH,
    PAIR_BRANCH,
    BranchGenerators,
    Branches,
    branch_generator,
    branch_seeds,
)
from scalefold.distributed.group import DAPGroup
from scalefold.model.memory import blocks_to_recompute, use_checkpointing


def split_planes(dap: Axial | None) -> tuple[Plane | None, Plane | None]:
    """``(msa_plane, pair_plane)`` of a stack call, ``(None, None)`` without DAP."""
    return (None, None) if dap is None else dap


def enter_stack(dap_group: DAPGroup | None, m: torch.Tensor | None, z: torch.Tensor, n_seq: int | None):
    """Scatter a stack's inputs by rows under DAP; returns ``(dap, m, z)`` (``dap=None`` when off)."""
    if dap_group is None:
        return None, m, z
    dap = planes(dap_group, n_seq, z.shape[-2])
    if m is not None:
        m = dap.msa.scatter_rows(m)
    return dap, m, dap.pair.scatter_rows(z)


class ParallelStack(nn.Module):
    """A stack of ``blocks`` that DAP shards: scatter by rows on entry, gather on exit.

    Subclasses build their blocks, call :meth:`enter` at the top of ``forward`` and gather the
    outputs they return. ``checkpointing`` recomputes the blocks' activations in backward
    (training with grad only): ``True`` every block, an int the first that many. ``branch_parallel`` is true for a stack of Parallel Evoformer
    blocks, the only stack Branch Parallelism splits.
    """

    branch_parallel: bool = False

    def __init__(self, blocks: Iterable[nn.Module], checkpointing: bool | int = False) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.dap_group: DAPGroup | None = None  # set from outside: set_parallelism
        self.branch: Branches | None = None
        self.blocks = nn.ModuleList(blocks)

    # -- what parallelize() uses -----------------------------------------------------------------

    def parallel_stacks(self) -> list[ParallelStack]:
        """A bare stack is its own (only) parallel stack."""
        return [self]

    def set_parallelism(self, dap_group: DAPGroup | None, branch: Branches | None = None) -> None:
        """Run the blocks sharded over ``dap_group`` (``None``: whole) and, for a stack of Parallel
        Evoformer blocks, one branch of each block on this rank of the BP pair ``branch``."""
        if branch is not None and not self.branch_parallel:
            raise ValueError(f"Branch Parallelism needs the Parallel Evoformer; {type(self).__name__} has none")
        self.dap_group, self.branch = dap_group, branch

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradient each DAP rank computes from its shard only: the blocks'."""
        return list(self.blocks.parameters())

    def branch_parameters(self) -> list[nn.Parameter]:
        """Parameters that only one rank of a BP pair updates (none outside a Parallel Evoformer)."""
        return []

    # -- what the subclasses' forward uses ---------------------------------------------------------

    def checkpointed(self, gradient_checkpointing: bool | int | None) -> int:
        """How many leading blocks recompute their activations in backward: ``gradient_checkpointing``
        (the reference's forward argument: ``True`` all, ``False`` none, an int that many) overrides the
        constructor's ``checkpointing`` when given; 0 outside grad-enabled training."""
        requested = self.checkpointing if gradient_checkpointing is None else gradient_checkpointing
        n = blocks_to_recompute(requested, len(self.blocks))
        return n if use_checkpointing(self, n > 0) else 0

    def enter(self, m: torch.Tensor | None, z: torch.Tensor, n_seq: int | None):
        """:func:`enter_stack` with this stack's DAP group: ``(dap, m, z)``."""
        return enter_stack(self.dap_group, m, z, n_seq)


__all__ = [
    "COLS",
    "ROWS",
    "MSA_BRANCH",
    "PAIR_BRANCH",
    "Axial",
    "Branches",
    "DAPGroup",
    "ParallelStack",
    "Plane",
    "BranchGenerators",
    "branch_generator",
    "branch_seeds",
    "col_to_row",
    "col_to_row_async",
    "enter_stack",
    "gather_cols_async",
    "gather_rows",
    "gather_rows_async",
    "mask_cols",
    "mask_rows",
    "row_to_col",
    "split_planes",
]
