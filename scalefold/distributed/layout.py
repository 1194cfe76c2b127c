"""The rank layout: world = DP x BP x DAP training ranks + evaluation ranks.

Training rank ``r`` (``0 <= r < dp * bp * dap``) has

    dap_rank = r % dap,   bp_rank = (r // dap) % bp,   dp_rank = r // (dap * bp)

so the ranks of a DAP group are consecutive (one node, the most communication), the two ranks of
a BP pair are ``dap`` apart, and the last ``num_eval_ranks`` ranks of the world evaluate.
Invalid layouts are rejected by :meth:`ParallelLayout.validate` with a message naming the fix;
valid but slow ones (a DAP group spanning nodes) are named by :meth:`ParallelLayout.warnings`.

This is the one place the layout's rules and derived sizes live (the training and evaluation ranks,
``dp``, ``dap * bp``); :class:`~scalefold.distributed.context.ParallelContext` adds the process
groups, built from it once at start-up (:func:`~scalefold.distributed.runtime.init_distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from scalefold.errors import UserError

BP_SIZES = (1, 2)


class LayoutError(UserError, ValueError):
    """An invalid DP x BP x DAP (+ eval) rank layout (raised before any work starts)."""

    label = "invalid parallel layout"


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    dap: int = 1
    bp: int = 1
    num_eval_ranks: int = 0

    @property
    def num_train_ranks(self) -> int:
        return self.world_size - self.num_eval_ranks

    @property
    def model_parallel(self) -> int:
        """Ranks sharing one sample (a DAP group times a BP pair): ``dap * bp``."""
        return self.dap * self.bp

    @property
    def dp(self) -> int:
        return self.num_train_ranks // self.model_parallel

    @property
    def main_train_rank(self) -> int:
        return 0

    @property
    def main_eval_rank(self) -> int:
        """The rank that logs evaluation results (first evaluation rank, or training rank 0 if synchronous)."""
        return self.num_train_ranks if self.num_eval_ranks else 0

    @property
    def log_ranks(self) -> tuple[int, ...]:
        """Ranks that write the MLPerf log."""
        return tuple(sorted({self.main_train_rank, self.main_eval_rank}))

    def train_ranks(self) -> list[int]:
        return list(range(self.num_train_ranks))

    def validate(self, parallel_evoformer: bool = False, crop_size: int | None = None) -> ParallelLayout:
        """Raise ``ValueError`` on an invalid layout; returns ``self``."""
        if self.dap < 1:
            raise LayoutError(f"--dap must be >= 1, got {self.dap}")
        if self.bp not in BP_SIZES:
            raise LayoutError(f"--bp must be 1 or 2 (the MSA and the pair branch), got {self.bp}")
        if self.bp > 1 and not parallel_evoformer:
            raise LayoutError("--bp 2 needs --parallel-evoformer (only its two branches are independent)")
        if not 0 <= self.num_eval_ranks < self.world_size:
            raise LayoutError(f"{self.num_eval_ranks} evaluation ranks leave no training rank in a world of {self.world_size}")
        group = self.model_parallel
        if self.num_train_ranks % group:
            raise LayoutError(
                f"{self.num_train_ranks} training ranks (world {self.world_size} - {self.num_eval_ranks} eval) "
                f"are not divisible by bp x dap = {self.bp} x {self.dap} = {group}"
            )
        if crop_size is not None and crop_size % self.dap:
            raise LayoutError(f"--dap {self.dap} does not divide the crop size {crop_size}")
        return self

    # -- rank arithmetic -------------------------------------------------------------------------

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, bp_rank, dap_rank)`` of training rank ``rank``."""
        if not 0 <= rank < self.num_train_ranks:
            raise ValueError(f"rank {rank} is not a training rank (0..{self.num_train_ranks - 1})")
        return rank // self.model_parallel, (rank // self.dap) % self.bp, rank % self.dap

    def rank_of(self, dp_rank: int, bp_rank: int, dap_rank: int) -> int:
        return (dp_rank * self.bp + bp_rank) * self.dap + dap_rank

    def dap_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(d, b, a) for a in range(self.dap)] for d in range(self.dp) for b in range(self.bp)
        ]

    def bp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, b, a) for b in range(self.bp)] for d in range(self.dp) for a in range(self.dap)]

    def model_groups(self) -> list[list[int]]:
        """The DAP x BP ranks of each data-parallel replica (one sample, one loader)."""
        return [[self.rank_of(d, b, a) for b in range(self.bp) for a in range(self.dap)] for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, b, a) for d in range(self.dp)] for b in range(self.bp) for a in range(self.dap)]

    def eval_ranks(self) -> list[int]:
        return list(range(self.num_train_ranks, self.world_size))

    def cross_node_dap_groups(self, ranks_per_node: int | None) -> list[list[int]]:
        """DAP groups whose ranks sit on more than one node when every node runs
        ``ranks_per_node`` consecutive ranks (DAP moves the most bytes: keep it inside a node,
        i.e. ``dap`` dividing the ranks per node). Empty when unknown (``None``) or all intra-node."""
        if not ranks_per_node or ranks_per_node < 1 or self.dap == 1:
            return []
        return [g for g in self.dap_groups() if g[0] // ranks_per_node != g[-1] // ranks_per_node]

    def warnings(self, ranks_per_node: int | None = None) -> list[str]:
        """Valid but slow layouts, one message each (printed at start-up)."""
        spanning = self.cross_node_dap_groups(ranks_per_node)
        if not spanning:
            return []
        return [
            f"{len(spanning)} of {len(self.dap_groups())} DAP groups span two nodes (e.g. ranks {spanning[0]} with "
            f"{ranks_per_node} ranks per node): DAP's all_to_all/all_gather then cross the network every block; "
            f"use a --dap that divides the ranks per node"
        ]

    def describe(self, ranks_per_node: int | None = None) -> str:
        """One line for the start-up log (plus any :meth:`warnings`)."""
        line = (
            f"world {self.world_size} = dp {self.dp} x bp {self.bp} x dap {self.dap} training ranks"
            f" + {self.num_eval_ranks} eval; dap groups {self.dap_groups()[:4]}{' ...' if self.dp * self.bp > 4 else ''}"
        )
        return "; ".join([line] + [f"WARNING: {w}" for w in self.warnings(ranks_per_node)])


__all__ = ["BP_SIZES", "LayoutError", "ParallelLayout"]
