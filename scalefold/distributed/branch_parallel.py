"""Branch Parallelism (HelixFold) for the Parallel Evoformer.

In a Parallel Evoformer block the MSA branch (row attention, column attention, MSA transition)
and the pair branch (triangle updates, pair transition) both read the block's input and are
independent; the outer product mean runs after both. BP runs the MSA branch on one rank of a BP
pair and the pair branch on the other:

* :meth:`Branches.enter` -- identity forward; backward all-reduces (sums) the input gradients over
  the pair (each rank holds only its branch's part);
* :meth:`Branches.share` -- the owner's branch output is broadcast to the peer; backward keeps the
  owner's gradient (the consumers after the exchange are replicated, so the peer's is identical).

Dropout masks: each branch draws from its own generator seeded from one draw of the global
stream (:func:`branch_rng`), so the serial Parallel Evoformer and BP draw the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

MSA_BRANCH = 0
PAIR_BRANCH = 1


@dataclass(eq=False)
class Branches:
    """This rank's side of one BP pair: ``branch`` (``MSA_BRANCH``/``PAIR_BRANCH``), the pair's
    process group and the global ranks of the MSA-branch and pair-branch owners."""

    group: dist.ProcessGroup | None
    branch: int
    owners: tuple[int, int]

    @property
    def runs_msa(self) -> bool:
        return self.branch == MSA_BRANCH

    @property
    def runs_pair(self) -> bool:
        return self.branch == PAIR_BRANCH

    def enter(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Identity; backward sums the gradients of all ``xs`` over the pair in one all-reduce.

        One autograd node for all inputs: the two ranks run different branches, so separate
        nodes would reach their all-reduces in a rank-dependent order (a hang)."""
        return _SumGradOverBranches.apply(self, *xs)

    def share(self, x: torch.Tensor | None, branch: int, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """The output of ``branch`` (``x`` on its owner, ``None`` on the peer) on both ranks."""
        if x is None:
            x = like.new_empty(tuple(shape)).requires_grad_(like.requires_grad)
        return _Broadcast.apply(x, self, branch)


class _SumGradOverBranches(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bp: Branches, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bp = bp
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ctx.bp.group)
        out, offset = [], 0
        for g in grads:
            out.append(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return (None, *out)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bp: Branches, branch: int) -> torch.Tensor:
        ctx.owner = bp.branch == branch
        out = x.detach().contiguous().clone()
        dist.broadcast(out, src=bp.owners[branch], group=bp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.owner else None), None, None


def branch_seeds(active: bool) -> tuple[int, int] | None:
    """Two seeds drawn from the global generator (the same on both BP ranks), or ``None``."""
    if not active:
        return None
    s = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    return int(s[0]), int(s[1])


@contextlib.contextmanager
def branch_rng(seeds: tuple[int, int] | None, branch: int, device: torch.device) -> Iterator[None]:
    """Run a branch under its own seeded generator (CPU and ``device``), restoring the global one."""
    if seeds is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seeds[branch])
        yield


__all__ = ["MSA_BRANCH", "PAIR_BRANCH", "Branches", "branch_seeds", "branch_rng"]
