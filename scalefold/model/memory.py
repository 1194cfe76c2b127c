"""Memory savers shared by the blocks and stacks: chunking and activation checkpointing.

Both trade compute for memory and leave the numbers unchanged:

* :func:`chunked` (Supplementary 1.11.8, inference) runs a module over slices of a batch-like axis
  (MSA rows, residues) one after the other instead of all at once;
* :func:`run_block` recomputes a block's activations in backward (training) when
  :func:`use_checkpointing` says it applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


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


def use_checkpointing(module: nn.Module, requested: bool) -> bool:
    """Activation checkpointing applies only when requested, in training, with grad enabled."""
    return requested and module.training and torch.is_grad_enabled()


def run_block(block: nn.Module, with_checkpoint: bool, *args: torch.Tensor, **kwargs):
    """Run ``block(*args, **kwargs)``, recomputing its activations in backward if asked.

    Non-reentrant ``torch.utils.checkpoint`` (RNG state preserved, so dropout masks are redrawn
    identically in the recomputation).
    """
    if with_checkpoint:
        return checkpoint(block, *args, use_reentrant=False, **kwargs)
    return block(*args, **kwargs)


__all__ = ["chunked", "run_block", "use_checkpointing"]
