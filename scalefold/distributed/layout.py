"""The rank layout: world = DP x BP x DAP training ranks + evaluation ranks.

Training rank ``r`` (``0 <= r < dp * bp * dap``) has

    dap_rank = r % dap,   bp_rank = (r // dap) % bp,   dp_rank = r // (dap * bp)

so the ranks of a DAP group are consecutive (one node, the most communication), the two ranks of
a BP pair are ``dap`` apart, and the last ``num_eval_ranks`` ranks of the world evaluate.
Invalid layouts are rejected by :meth:`ParallelLayout.validate` with a message naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

BP_SIZES = (1, 2)


class LayoutError(ValueError):
    """An invalid DP x BP x DAP (+ eval) rank layout (raised before any work starts)."""


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
    def dp(self) -> int:
        return self.num_train_ranks // (self.dap * self.bp)

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
        group = self.dap * self.bp
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
        return rank // (self.dap * self.bp), (rank // self.dap) % self.bp, rank % self.dap

    def rank_of(self, dp_rank: int, bp_rank: int, dap_rank: int) -> int:
        return (dp_rank * self.bp + bp_rank) * self.dap + dap_rank

    def dap_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(d, b, a) for a in range(self.dap)] for d in range(self.dp) for b in range(self.bp)
        ]

    def bp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, b, a) for b in range(self.bp)] for d in range(self.dp) for a in range(self.dap)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, b, a) for d in range(self.dp)] for b in range(self.bp) for a in range(self.dap)]

    def eval_ranks(self) -> list[int]:
        return list(range(self.num_train_ranks, self.world_size))

    def describe(self) -> str:
        """One line for the start-up log."""
        return (
            f"world {self.world_size} = dp {self.dp} x bp {self.bp} x dap {self.dap} training ranks"
            f" + {self.num_eval_ranks} eval; dap groups {self.dap_groups()[:4]}{' ...' if self.dp * self.bp > 4 else ''}"
        )


__all__ = ["BP_SIZES", "LayoutError", "ParallelLayout"]
