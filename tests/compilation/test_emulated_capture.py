"""The CPU emulation of a CUDA-graph capture (scalefold.compilation.emulated_capture) keeps a capture's
rules: a replay runs no Python (values baked in, host state unmoved, tensors at their addresses, static
outputs overwritten) and every operation a stream capture refuses raises inside the captured region,
naming the line that made it (each rule planted in tests/compilation/test_capture_rules.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scalefold.compilation.emulated_capture import CaptureRefused, EmulatedGraphBackend, record

pytestmark = pytest.mark.usefixtures("one_thread")
T = torch.tensor([0.0, 2.0, 3.0])


def _item():
    return T * (T.sum().item())


def _python_table():
    return T + torch.tensor([1.0, 2.0, 3.0])


def _get_rng_state():
    return T * torch.get_rng_state().float().sum()


def _manual_seed():
    torch.manual_seed(0)
    return T * 2


def test_the_refusals_are_undone_after_a_capture():
    with pytest.raises(CaptureRefused):
        record(_manual_seed)
    torch.manual_seed(1)  # the real function again
    assert torch.get_rng_state().numel() > 0


def test_a_survey_lists_every_refusal_and_goes_on():
    found = []
    record(lambda: _item() + _python_table() + _get_rng_state(), survey=found)
    assert [w.split("(")[0].strip() for w, _ in found] == [
        "a device-to-host read", "a host-to-device copy of Python data", "a random-number-generator state read or set"]  # fmt: skip


def test_reads_only_a_cpu_makes_and_scalar_assignments_are_let_through():
    """F.one_hot's range check reads back on the CPU only; ``t[i] = 1`` is a fill kernel on a device."""

    def fn(idx):
        x = torch.zeros(4)
        x[0] = 1
        return F.one_hot(idx, num_classes=4).float() + x

    idx = torch.tensor([1, 3])
    graph = record(fn, idx)
    idx.copy_(torch.tensor([2, 0]))
    assert torch.equal(graph.replay(), fn(idx))


def test_a_replay_runs_no_python_bakes_python_values_and_reads_tensors_at_their_addresses():
    weight = torch.ones(3)
    lr = torch.tensor(0.5)
    calls = []
    scale = [2.0]

    def step(x):
        calls.append(1)  # host state: moves only while capturing
        weight.sub_(lr * x)  # a constant held by reference, updated in place
        return (x * scale[0]).sum()  # a Python value: baked in at capture

    x = torch.ones(3)
    graph = record(step, x)
    assert len(calls) == 1 and torch.equal(weight, torch.full((3,), 0.5))
    out = graph.output
    scale[0], lr.fill_(0.25), x.fill_(2.0)
    assert graph.replay() is out and float(out) == 12.0  # 2 * 3 * the capture's scale 2
    assert len(calls) == 1 and torch.equal(weight, torch.zeros(3))  # 0.5 - 0.25 * 2


def test_static_outputs_are_overwritten_by_the_next_replay():
    x = torch.ones(2)
    graph = record(lambda a: a * 2, x)
    first = graph.replay()
    kept = first.clone()
    x.fill_(5.0)
    second = graph.replay()
    assert second is first and torch.equal(first, torch.full((2,), 10.0)) and torch.equal(kept, torch.full((2,), 2.0))


def test_dropout_draws_new_masks_from_the_generator_at_each_replay():
    x = torch.ones(1000)
    graph = record(lambda a: F.dropout(a, 0.5, True), x)
    masks = []
    for seed in (3, 4, 3):
        torch.manual_seed(seed)
        replayed = graph.replay().clone()
        torch.manual_seed(seed)
        assert torch.equal(replayed, F.dropout(x, 0.5, True))
        masks.append(replayed)
    assert not torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])


def test_a_training_step_with_backward_and_in_place_update_replays_bit_identically():
    """The probe's step: forward, backward into static gradient buffers, an in-place update; the replay
    equals eager over steps with new inputs, seeds and learning rates."""

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1))

    models = make(), make()
    grads = [[torch.zeros_like(p) for p in m.parameters()] for m in models]
    for m, gs in zip(models, grads):
        for p, g in zip(m.parameters(), gs):
            p.grad = g
    lrs = [torch.tensor(0.1), torch.tensor(0.1)]
    xs = [torch.randn(4, 8), None]
    xs[1] = xs[0].clone()

    def step(k):
        for g in grads[k]:
            g.zero_()
        loss = models[k](xs[k]).square().mean()
        loss.backward()
        with torch.no_grad():
            for p, g in zip(models[k].parameters(), grads[k]):
                p.sub_(lrs[k] * g)
        return loss.detach()

    backend = EmulatedGraphBackend(warmup_iters=0)
    replay = backend.capture(lambda: step(0), ())
    with torch.no_grad():
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            p.copy_(q)
    for i in range(3):
        x = torch.randn(4, 8)
        for k in (0, 1):
            xs[k].copy_(x)
            lrs[k].fill_(0.05 * (i + 1))
        torch.manual_seed(10 + i)
        a = replay().clone()
        torch.manual_seed(10 + i)
        b = step(1)
        assert torch.equal(a, b)
        assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
