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


def test_cuda_fp32_cast_is_in_the_autograd_graph():
    """CUDA autocast casts a softmax's bf16 input to fp32 above autograd: the cast is a node of the graph, and
    backward holds the fp32 gradient of the softmax before casting it back to bf16. Cast at the dispatch level
    only (the rule before), backward ran the softmax's gradient straight into bf16: the fp32 gradient, the
    largest transient of the MLPerf step's peak, was never counted."""
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 256, dtype=torch.bfloat16)
    tracker = StorageTracker(cuda_autocast=True)
    tracker.phase("forward")
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p = torch.softmax(x, dim=-1)
            y = p @ w
        assert p.dtype == torch.float32
        assert p.grad_fn.next_functions[0][0].name() == "ToCopyBackward0"  # the cast, recorded
        tracker.phase("backward")
        before = tracker.current
        y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16
    fp32_grad = 64 * 256 * 4
    assert tracker.phase_peaks["backward"] - before >= fp32_grad  # the fp32 gradient was live in backward
