"""Branch Parallelism (HelixFold) for the Parallel Evoformer.

In a Parallel Evoformer block the MSA branch (row attention, column attention, MSA transition)
and the pair branch (triangle updates, pair transition) both read the block's input and are
independent; the outer product mean runs after both. BP runs the MSA branch on one rank of a BP
pair and the pair branch on the other:

* :meth:`Branches.enter` -- identity forward; backward all-reduces (sums) the input gradients over
  the pair (each rank holds only its branch's part);
* :meth:`Branches.share` -- the owner's branch output is broadcast to the peer; backward keeps the
  owner's gradient (the consumers after the exchange are replicated, so the peer's is identical).

Dropout masks: each branch draws from its own generator (:class:`BranchGenerators`, :func:`branch_generator`, one per branch
and device, shared by the stack's blocks), so the serial Parallel Evoformer and BP draw the same masks
whichever rank runs which branch. A training step seeds them with the forward seed **before** the step
(:meth:`BranchGenerators.seed`, beside ``torch.manual_seed``; every rank of a BP pair and DAP group gets
the same seed): inside it nothing touches a generator's state on the host, so the whole step can be
captured, the generators registered with the graph (a replay advances them as eager does). Unseeded
(a model called directly, in a test) each block reseeds them from two draws of the global stream, as
before: eager only (a capture refuses the host read).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
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


def _device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


class BranchGenerators:
    """The dropout generators of the Parallel Evoformer's two branches on each device (created on first use).

    :meth:`seed` (the step's forward seed, on the host before the step) makes them *step-seeded*: a block then
    draws from them with no host action (graph-safe). Until then a block reseeds them itself from the global
    stream (:func:`branch_seeds`), eager only."""

    def __init__(self) -> None:
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self.step_seeded = False

    def get(self, device: torch.device, branch: int) -> torch.Generator:
        key = (_device_name(device), branch)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=key[0])
        return self._generators[key]

    def seed(self, seed: int, device: torch.device) -> None:
        """Both branches' generators on ``device`` (and the CPU) from the step's forward seed."""
        for dev in {torch.device("cpu"), torch.device(device)}:
            for branch in (MSA_BRANCH, PAIR_BRANCH):
                self.get(dev, branch).manual_seed(random.Random(f"branch:{seed}:{branch}").randrange(2**63 - 1))
        self.step_seeded = True

    def generators(self, device: torch.device | None = None) -> list[torch.Generator]:
        """Every generator made so far (on ``device`` only, if given): what a capture registers."""
        name = None if device is None else _device_name(device)
        return [g for (dev, _), g in sorted(self._generators.items()) if name is None or dev == name]

    def block_seeds(self, training: bool) -> tuple[int, int] | None:
        """A block's reseeding seeds: ``None`` when step-seeded (or not training), else two global draws."""
        return None if self.step_seeded else branch_seeds(training)


def branch_generator(generators: BranchGenerators, seeds: tuple[int, int] | None, branch: int,
                     device: torch.device) -> torch.Generator:  # fmt: skip
    """The generator a branch's dropout draws from (``scalefold.model.dropout.drawing_from``); ``seeds``
    (unseeded, eager): reseeded first. The global generators are not touched."""
    generator = generators.get(device, branch)
    if seeds is not None:
        generator.manual_seed(seeds[branch])
    return generator


def seed_forward(seed: int, device: torch.device, branch_generators: Sequence[BranchGenerators] = ()) -> None:
    """A step's forward seed (on the host, before the step): the global generators and every branch's."""
    torch.manual_seed(seed)
    for generators in branch_generators:
        generators.seed(seed, device)


def model_branch_generators(model: torch.nn.Module) -> list[BranchGenerators]:
    """The :class:`BranchGenerators` of ``model``'s Parallel Evoformer stacks (none without one)."""
    found: dict[int, BranchGenerators] = {}
    for module in model.modules():
        generators = getattr(module, "branch_generators", None)
        if isinstance(generators, BranchGenerators):
            found[id(generators)] = generators
    return list(found.values())


__all__ = ["MSA_BRANCH", "PAIR_BRANCH", "BranchGenerators", "Branches", "branch_generator", "branch_seeds",
           "model_branch_generators", "seed_forward"]
