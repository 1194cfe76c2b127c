"""The one object that owns the run's process groups: :class:`ParallelContext`.

Built once per process at start-up (:func:`scalefold.distributed.runtime.init_distributed`, or
:func:`setup_model_parallel` where ``torch.distributed`` is already initialised) from a validated
:class:`~scalefold.distributed.layout.ParallelLayout`: the training ranks, the evaluation ranks (the
last ``num_eval_ranks``) and the gloo bridge between their first ranks, the DAP groups, the BP pairs
and the model groups (the DAP x BP ranks sharing one sample). Every size is the layout's; no other
module creates a group or recomputes one.

Usage (every rank, after ``torch.distributed`` is initialised)::

    ctx = setup_model_parallel(dap=2, bp=1, num_eval_ranks=0, parallel_evoformer=False)
    torch.manual_seed(seed + ctx.seed_offset)   # same dropout masks inside a DAP group / BP pair
    model = ctx.wrap(AlphaFold(config, parallel_evoformer=...))   # stacks sharded + grad factors
    batch = ctx.broadcast_batch(batch if ctx.is_loader_rank else None)
    loss.backward()
    ctx.sync_grads(model)   # or: DDP over ctx.train_group (+ GradClipper hook): same result
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from scalefold.distributed import grad_sync
from scalefold.distributed.branch_parallel import Branches
from scalefold.distributed.data import broadcast_batch
from scalefold.distributed.group import DAPGroup
from scalefold.distributed.layout import ParallelLayout


@dataclass(eq=False)
class ParallelContext:
    layout: ParallelLayout
    rank: int
    dap_group: DAPGroup | None = None  # None when dap == 1 or on eval ranks
    branch: Branches | None = None  # None when bp == 1 or on eval ranks
    train_group: dist.ProcessGroup | None = None  # the world without eval ranks; None: single process
    eval_group: dist.ProcessGroup | None = None  # the last num_eval_ranks ranks (None: synchronous evaluation)
    bridge_group: dist.ProcessGroup | None = None  # gloo, [main train rank, main eval rank]: the SWA weights
    dap_process_group: dist.ProcessGroup | None = None
    model_group: dist.ProcessGroup | None = None  # the DAP x BP ranks of one DP replica
    hooks: list = field(default_factory=list)
    ranks_per_node: int | None = None  # for the intra-node check of the DAP groups (None: unknown)

    def describe(self) -> str:
        """The layout line for the start-up log, with its warnings (a DAP group spanning nodes)."""
        return self.layout.describe(self.ranks_per_node)

    @property
    def is_train_rank(self) -> bool:
        return self.rank < self.layout.num_train_ranks

    @property
    def is_eval_rank(self) -> bool:
        return not self.is_train_rank

    @property
    def async_eval(self) -> bool:
        return self.layout.num_eval_ranks > 0

    @property
    def num_train_ranks(self) -> int:
        return self.layout.num_train_ranks

    @property
    def eval_ranks(self) -> list[int]:
        return self.layout.eval_ranks()

    @property
    def main_train_rank(self) -> int:
        return self.layout.main_train_rank

    @property
    def main_eval_rank(self) -> int:
        return self.layout.main_eval_rank

    @property
    def is_main_train_rank(self) -> bool:
        return self.rank == self.layout.main_train_rank

    @property
    def is_main_eval_rank(self) -> bool:
        return self.rank == self.layout.main_eval_rank

    @property
    def log_ranks(self) -> tuple[int, ...]:
        return self.layout.log_ranks

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.layout.coords(self.rank)

    @property
    def seed_offset(self) -> int:
        """Add to the seed: the data-parallel index (shared by a DAP group and a BP pair)."""
        return self.coords[0] if self.is_train_rank else 0

    @property
    def dp_rank(self) -> int:
        """Data-parallel index of this training rank (-1 on evaluation ranks)."""
        return self.coords[0] if self.is_train_rank else -1

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the global batch size (one sample per DAP group / BP pair)."""
        return self.layout.dp

    @property
    def is_loader_rank(self) -> bool:
        """One loader per DAP group and BP pair: the rank with bp_rank == dap_rank == 0."""
        return self.is_train_rank and self.coords[1:] == (0, 0)

    @property
    def loader_rank(self) -> int:
        dp_rank = self.coords[0]
        return self.layout.rank_of(dp_rank, 0, 0)

    def wrap(self, model: nn.Module, grad_hooks: bool = True) -> nn.Module:
        """Attach the DAP group / BP pair to the model's stacks; with ``grad_hooks`` scale each
        gradient by its DAP/BP factor (:func:`scalefold.distributed.parallelize.parallelize`)."""
        from scalefold.distributed.parallelize import parallelize

        hooks = parallelize(model, dap_group=self.dap_group, branch=self.branch, dap=self.layout.dap,
                            bp=self.layout.bp, grad_hooks=grad_hooks)  # fmt: skip
        self.hooks = hooks if grad_hooks else self.hooks
        return model

    def grad_scales(self, model: nn.Module) -> dict[nn.Parameter, float]:
        """``{param: factor}`` of ``model``'s DAP-sharded / branch-owned parameters (factor not 1): what a
        reduction applies itself when the model was wrapped without the factor hooks."""
        from scalefold.distributed.parallelize import parallel_stacks

        return grad_sync.grad_scales(parallel_stacks(model), self.layout.dap, self.layout.bp)

    def sync_grads(self, model: nn.Module) -> None:
        """Mean over all training ranks of the (scaled) gradients: the true DP-averaged gradient."""
        if not self.hooks and (self.layout.dap > 1 or self.layout.bp > 1):
            raise RuntimeError("sync_grads needs the gradient factors: wrap(model, grad_hooks=True)")
        grad_sync.all_reduce_mean(model.parameters(), group=self.train_group)

    def broadcast_batch(
        self, batch: Mapping[str, torch.Tensor] | None, device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """The loader rank's batch on every rank of its DAP group / BP pair (received tensors
        are allocated on ``device``, default the sender's device type)."""
        if self.layout.model_parallel == 1:
            return dict(batch)
        return broadcast_batch(batch, src=self.loader_rank, group=self.model_group, device=device)


def setup_model_parallel(
    dap: int = 1,
    bp: int = 1,
    num_eval_ranks: int = 0,
    parallel_evoformer: bool = False,
    crop_size: int | None = None,
    ranks_per_node: int | None = None,
) -> ParallelContext:
    """Validate the layout of the initialised world and build every group (:func:`build_parallel_context`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = ParallelLayout(world, dap=dap, bp=bp, num_eval_ranks=num_eval_ranks).validate(
        parallel_evoformer=parallel_evoformer, crop_size=crop_size
    )
    return build_parallel_context(layout, ranks_per_node)


def build_parallel_context(layout: ParallelLayout, ranks_per_node: int | None = None) -> ParallelContext:
    """The groups of a validated ``layout``: training, evaluation and bridge, then DAP, BP and model groups.

    ``ranks_per_node`` (the launcher's local world size; default ``$LOCAL_WORLD_SIZE`` when set)
    only serves the start-up warning about DAP groups spanning nodes (rank 0 prints it to stderr).
    Collective: every rank of the world (eval ranks included) must call it, in the same order.
    """
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    if ranks_per_node is None and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    ctx = ParallelContext(layout=layout, rank=rank, ranks_per_node=ranks_per_node)
    if rank == 0:
        for warning in layout.warnings(ranks_per_node):
            print(f"scalefold: WARNING: {warning}", file=sys.stderr, flush=True)
    if not distributed or layout.world_size == 1:
        return ctx
    # new_group is collective over the default group: the same calls in the same order on every rank
    eval_ranks = layout.eval_ranks()
    ctx.train_group = dist.new_group(layout.train_ranks()) if eval_ranks else dist.group.WORLD
    if eval_ranks:
        ctx.eval_group = dist.new_group(eval_ranks)
        ctx.bridge_group = dist.new_group([layout.main_train_rank, layout.main_eval_rank], backend="gloo")
    dap, bp = layout.dap, layout.bp
    for ranks in layout.dap_groups():
        group = dist.new_group(ranks) if dap > 1 else None
        if rank in ranks and dap > 1:
            ctx.dap_group = DAPGroup(group=group, size=dap, rank=ranks.index(rank))
            ctx.dap_process_group = group
    for ranks in layout.bp_groups():
        group = dist.new_group(ranks) if bp > 1 else None
        if rank in ranks and bp > 1:
            ctx.branch = Branches(group=group, branch=ranks.index(rank), owners=(ranks[0], ranks[1]))
    for ranks in layout.model_groups():
        group = dist.new_group(ranks) if layout.model_parallel > 1 else None
        if rank in ranks:
            ctx.model_group = group
    return ctx


__all__ = ["ParallelContext", "build_parallel_context", "setup_model_parallel"]
