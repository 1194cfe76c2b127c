"""The reference attention's memory: no more than two logits-sized tensors live at once (the CPU allocator's
own bookkeeping, via the memory model's tracker on real tensors). A name bound to the logits in
``reference.attention`` kept a third alive through the softmax -- 1 GiB at the MLPerf step's peak; so did
passing them to ``masked_softmax`` as an argument whenever CPython does not inline the call (a PEP 523 frame
evaluator is installed, as torch.compile's is: the caller's stack holds the argument), which CI found."""

from __future__ import annotations

import pytest
import torch

from scalefold.kernels import reference
from scalefold.perf.memory import StorageTracker


def _peak_in_logits() -> float:
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 96, 8
    q, k, v, g = (torch.randn(b, h, n, d) for _ in range(4))
    bias = torch.randn(1, h, n, n)
    mask = (torch.rand(b, 1, 1, n) > 0.1).float()
    with torch.no_grad(), StorageTracker() as tracker:
        out = reference.attention(q, k, v, bias=bias, mask=mask, gate=g)
    assert out.shape == (b, h, n, d)
    return tracker.peak / (b * h * n * n * 4)


def test_attention_holds_at_most_two_logits_tensors():
    # two logits-sized tensors (an elementwise step's input and output) and the activation-sized rest
    # (scaled queries, the output, the gate's product: 1/3 of one logits tensor here)
    assert 2 <= _peak_in_logits() <= 2 + 1 / 3


def test_attention_holds_at_most_two_logits_tensors_under_a_frame_evaluator():
    eval_frame = pytest.importorskip("torch._C._dynamo.eval_frame")
    if not hasattr(eval_frame, "set_eval_frame"):
        pytest.skip("this torch has no set_eval_frame")
    prior = eval_frame.set_eval_frame(False)  # dynamo's run-only evaluator: compiles nothing, inlines no call
    try:
        ratio = _peak_in_logits()
    finally:
        eval_frame.set_eval_frame(prior)
    assert 2 <= ratio <= 2 + 1 / 3
