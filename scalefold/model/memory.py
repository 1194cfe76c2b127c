"""Memory savers shared by the blocks and stacks: chunking and activation checkpointing.

Both trade compute for memory and leave the numbers unchanged:

* :func:`chunked` (Supplementary 1.11.8, inference) runs a module over slices of a batch-like axis
  (MSA rows, residues) one after the other instead of all at once;
* :func:`run_block` recomputes a block's activations in backward (training) when
  :func:`use_checkpointing` says it applies.

Activation checkpointing is a *policy* (:func:`parse_checkpointing`): ``on`` (every block of the
template-pair, extra-MSA and Evoformer stacks recomputes), ``off`` (none), ``N`` (the first ``N``
blocks of the step in forward order recompute: the template-pair blocks, then the extra-MSA blocks,
then Evoformer blocks; the rest keep their activations), or ``auto`` (the fewest that fit the
device's memory: resolved to an ``N`` by :mod:`scalefold.perf.recompute` before the model is built).
Why a prefix in forward order: the blocks recomputed first in forward are backpropagated last, when
the kept blocks' activations are already freed, so a recomputation does not add to the peak of the kept
activations; and the first blocks cost little to recompute for what they free. At MLPerf shapes (bf16,
crop 256, DAP 1; ``scalefold estimate-memory`` / ``estimate-step``) a template-pair block keeps 1.5 GiB
for 0.10 TFLOP of recomputation, an extra-MSA block 1.6 GiB for 0.29 TFLOP, an Evoformer block 1.3 GiB
for 0.21 TFLOP: the extra-MSA blocks free about as much per recomputed FLOP as Evoformer blocks (0.15
TFLOP per step more than the best order, 0.25 %, where ``auto`` recomputes all four).
:func:`checkpointed_blocks` turns a policy into ``{stack: blocks that recompute}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from scalefold.config.recompute import Policy, parse_checkpointing
from scalefold.model.dropout import MaskTape


def chunked(
    fn: Callable[..., torch.Tensor],
    chunk_size: int | None,
    inputs: Sequence[torch.Tensor | None],
    dims: Sequence[int],
    out_dim: int,
) -> torch.Tensor:
    """Apply ``fn(*inputs)`` in slices of ``chunk_size`` along a batch-like axis.

    ``dims[i]`` names that axis in ``inputs[i]``; an input of size 1 there (broadcast) or ``None``
    is passed whole to every call. Outputs are concatenated along ``out_dim``. With
    ``chunk_size=None`` this is just ``fn(*inputs)``.
    """
    if chunk_size is None:
        return fn(*inputs)
    n = max(t.shape[d] for t, d in zip(inputs, dims) if t is not None)
    outputs = []
    for start in range(0, n, chunk_size):
        length = min(chunk_size, n - start)
        sliced = [t if t is None or t.shape[d] == 1 else t.narrow(d, start, length) for t, d in zip(inputs, dims)]
        outputs.append(fn(*sliced))
    return torch.cat(outputs, dim=out_dim)


#: The stacks whose blocks activation checkpointing recomputes, in the order the forward runs them.
CHECKPOINT_STACKS = ("template_pair_stack", "extra_msa_stack", "evoformer_stack")
def checkpointed_blocks(policy: object, stacks: Sequence[tuple[str, int]]) -> dict[str, int]:
    """``{stack name: number of its leading blocks that recompute}`` under ``policy`` for ``stacks``
    (``(name, number of blocks)`` in forward order): all for ``on``, none for ``off``, the first ``N``
    blocks in forward order for ``N`` (``N`` larger than the blocks there are is refused, naming them).
    ``auto`` must be resolved first (:func:`scalefold.perf.recompute.resolve_policy`)."""
    policy = parse_checkpointing(policy)
    total = sum(n for _, n in stacks)
    if policy == "auto":
        raise ValueError("activation checkpointing 'auto' must be resolved against the device memory before the "
                         "model is built (scalefold.perf.recompute.resolve_policy)")  # fmt: skip
    if policy is True or policy is False:
        return {name: n if policy else 0 for name, n in stacks}
    if policy > total:
        sizes = ", ".join(f"{name} {n}" for name, n in stacks)
        raise ValueError(f"activation checkpointing {policy}: the model has {total} blocks ({sizes}); "
                         f"N must be 0 .. {total}")  # fmt: skip
    plan, left = {}, policy
    for name, n in stacks:
        plan[name] = min(n, left)
        left -= plan[name]
    return plan


def blocks_to_recompute(requested: bool | int, num_blocks: int) -> int:
    """A stack's ``gradient_checkpointing`` argument as a number of leading blocks: ``True`` all,
    ``False`` none, an int that many (at most ``num_blocks``)."""
    if requested is True or requested is False:
        return num_blocks if requested else 0
    return max(0, min(int(requested), num_blocks))


def stack_request(plan: bool | Mapping[str, int], stack: str) -> bool | int:
    """What to hand ``stack``'s forward as ``gradient_checkpointing`` from a model-level request: a bool
    (every block or none) or a plan from :func:`checkpointed_blocks` (its count for this stack)."""
    if isinstance(plan, Mapping):
        return int(plan.get(stack, 0))
    return bool(plan)


def use_checkpointing(module: nn.Module, requested: bool) -> bool:
    """Activation checkpointing applies only when requested, in training, with grad enabled."""
    return requested and module.training and torch.is_grad_enabled()


def run_block(block: nn.Module, with_checkpoint: bool, *args: torch.Tensor, **kwargs):
    """Run ``block(*args, **kwargs)``, recomputing its activations in backward if asked.

    Non-reentrant ``torch.utils.checkpoint`` without the RNG state (no generator state read or set: a
    CUDA graph can capture it); the recomputation takes the dropout masks its forward drew from the
    block's :class:`~scalefold.model.dropout.MaskTape`, so its activations and gradients are the forward's.
    """
    if with_checkpoint:
        tape = MaskTape()

        def taped(*a: torch.Tensor, **k):  # noqa: ANN003
            with tape.run():
                return block(*a, **k)

        return checkpoint(taped, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
    return block(*args, **kwargs)


__all__ = [
    "CHECKPOINT_STACKS", "Policy", "blocks_to_recompute", "checkpointed_blocks", "chunked", "parse_checkpointing",
    "run_block", "stack_request", "use_checkpointing",
]  # fmt: skip
