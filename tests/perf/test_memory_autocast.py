"""The memory model's CUDA autocast rule (softmax and friends in fp32 under bf16 autocast) applies in the
forward and in activation checkpointing's recomputation: inside ``__torch_dispatch__`` autocast always
reads as off, so before :class:`~scalefold.perf.memory.AutocastProbe` the rule never fired and attention
probabilities were predicted in bf16 (half their size on a GPU)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from scalefold.perf.memory import StorageTracker


def test_cuda_autocast_rule_fires_in_the_forward_and_the_recomputation():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Softmax(dim=-1), nn.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    tracker = StorageTracker(cuda_autocast=True)
    tracker.phase("forward")
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            probs = block[1](block[0](x))
            y = checkpoint(block, x, use_reentrant=False)
        assert probs.dtype == torch.float32  # CUDA autocast runs softmax in fp32 (CPU autocast would not)
        tracker.phase("backward")
        y.float().sum().backward()  # the recomputation must see the same rule, or checkpoint's check fails
    assert x.grad is not None and torch.isfinite(x.grad).all()
    plain = StorageTracker(cuda_autocast=False)  # the CPU target keeps CPU autocast's rules
    with plain, torch.autocast("cpu", dtype=torch.bfloat16):
        assert block[1](block[0](x)).dtype == torch.bfloat16
