"""The reference attention's memory: no more than two logits-sized tensors live at once (the CPU allocator's
own bookkeeping, via the memory model's tracker on real tensors). A name bound to the logits in
``reference.attention`` kept a third alive through the softmax -- 1 GiB at the MLPerf step's peak."""

from __future__ import annotations

import torch

from scalefold.kernels import reference
from scalefold.perf.memory import StorageTracker


def test_attention_holds_at_most_two_logits_tensors():
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 96, 8
    q, k, v, g = (torch.randn(b, h, n, d) for _ in range(4))
    bias = torch.randn(1, h, n, n)
    mask = (torch.rand(b, 1, 1, n) > 0.1).float()
    logits = b * h * n * n * 4
    small = 4 * b * h * n * d * 4  # q scaled, o, the gate's product: activation-sized, far below the logits
    with torch.no_grad(), StorageTracker() as tracker:
        out = reference.attention(q, k, v, bias=bias, mask=mask, gate=g)
    assert out.shape == (b, h, n, d)
    assert 2 * logits <= tracker.peak <= 2 * logits + small, tracker.peak / logits
