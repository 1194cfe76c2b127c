"""Small numerical helpers shared by the AlphaFold2 losses (supplement section 1.9).

Every loss returns one value per sample (shape ``[*]``, usually ``[B]``); the reductions here keep
the reference's operation order (sum over the last axis, divide, sum again), which is what
keeps the float64 results equal to the MLPerf reference to ~1e-14.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

Dims = Union[int, Sequence[int]]
_TABLES: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def device_table(name: str, device: torch.device, dtype: torch.dtype, build: Callable[[], Any]) -> torch.Tensor:
    """The constant table ``build()`` (host data: a list, a NumPy array, a CPU tensor) on ``device`` in
    ``dtype``, built once per (name, device, dtype) and reused: a host-to-device copy of Python data inside
    the step is what a CUDA-graph capture refuses (:mod:`scalefold.compilation.capture_rules`), and one per
    step and table is wasted time. Built outside inference mode and grad (usable by any later step); a
    table built under a fake-tensor mode (the memory model's step) is returned, not kept; under
    ``torch.compile`` the table is a constant of the compiled graph."""
    if torch.compiler.is_compiling():  # a constant of the compiled graph (built once, with it)
        return torch.as_tensor(build(), dtype=dtype, device=device)
    key = (name, torch.device(device), dtype)
    table = _TABLES.get(key)
    if table is None:
        with torch.inference_mode(False), torch.no_grad():
            table = torch.as_tensor(build(), dtype=dtype, device=device)
        if not is_fake(table):
            _TABLES[key] = table
    return table


def softmax_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``-sum(targets * log_softmax(logits))`` over the last axis.

    Args:
        logits:  [*, C] unnormalised log-probabilities.
        targets: [*, C] target distribution (usually one-hot).
    Returns:
        [*] cross entropy.
    """
    if logits.shape != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} differ")
    return -torch.sum(targets * torch.log_softmax(logits, dim=-1), dim=-1)


def one_hot_cross_entropy(logits: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Softmax cross entropy against integer class labels ``classes`` ([*]) for ``logits`` [*, C]."""
    targets = F.one_hot(classes, num_classes=logits.shape[-1]).to(logits.dtype)
    return softmax_cross_entropy(logits, targets)


def sigmoid_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Element-wise binary cross entropy with logits (no reduction)."""
    if logits.shape != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} differ")
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="none")


def masked_mean(mask: torch.Tensor, value: torch.Tensor, dim: Dims, eps: float = 1e-4) -> torch.Tensor:
    """``sum(mask * value) / (eps + sum(mask))`` over ``dim``; ``mask`` broadcasts to ``value``."""
    mask = mask.expand(*value.shape)
    return torch.sum(mask * value, dim=dim) / (eps + torch.sum(mask, dim=dim))


def resolution_filter(resolution: torch.Tensor, min_resolution: float, max_resolution: float) -> torch.Tensor:
    """Boolean ``[*]``: the structure's resolution lies in ``[min_resolution, max_resolution]``.

    Supplement 1.9.6 / 1.9.10: the pLDDT and experimentally-resolved losses are only applied to
    high-resolution X-ray / cryo-EM structures.
    """
    return (resolution >= min_resolution) & (resolution <= max_resolution)
