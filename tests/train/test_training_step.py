"""The training step as one object (scalefold.train.step.TrainingStep): the skip, the agreement and the
learning rate on the device; the loader's batch sliced, broadcast and seeded inside ``train``."""

from __future__ import annotations

import math

import pytest
import torch

from scalefold.config.training import TrainConfig
from scalefold.distributed.agreement import agree_on_device, allreduce_step_stats, read_agreement
from scalefold.train.step import TrainingStep

pytestmark = pytest.mark.usefixtures("one_thread")


def _masters(step):
    return [g.master.clone() for g in step.opt.groups] + [step.opt.step_count.clone()]


def test_a_non_finite_step_is_skipped_on_the_device_and_reported_once():
    step = TrainingStep.build(TrainConfig.from_preset("tiny", env={}))
    step.run(0)  # one applied step
    before = _masters(step)
    real = step.loss_fn
    step.loss_fn = lambda outputs, batch: (lambda loss, terms: (loss * float("inf"), terms))(*real(outputs, batch))
    step.run(0, read=False)
    outcome = step.finish()
    assert outcome.skipped and not math.isfinite(outcome.mean_loss)
    assert step.opt.num_steps == 1 and step.opt.capturable
    for a, b in zip(before, _masters(step)):
        assert torch.equal(a, b)


def test_the_learning_rate_is_the_tensor_the_step_reads():
    step = TrainingStep.build(TrainConfig.from_preset("tiny", env={}))
    step.opt.lr.fill_(0.0)  # what the schedule writes; nothing re-reads it on the host
    before = _masters(step)
    step.run(0)
    after = _masters(step)
    assert all(torch.equal(a, b) for a, b in zip(before[:-1], after[:-1]))  # lr 0: weights unchanged
    assert float(after[-1]) == float(before[-1]) + 1  # but the step was applied
    step.opt.lr.fill_(1e-3)
    step.run(0)
    assert not torch.equal(after[0], step.opt.groups[0].master)


def test_the_device_agreement_equals_the_host_one():
    for loss, stop, count, finite in [(1.25, False, 3, True), (float("nan"), True, 0, True), (2.0, False, 0, False)]:
        t = torch.tensor(loss, dtype=torch.float32)
        host = allreduce_step_stats(t, stop, None, 1, count)
        agreed = agree_on_device(t, torch.tensor(finite), torch.tensor([float(stop), float(count)], dtype=torch.float64),
                                 None, 1)  # fmt: skip
        got = read_agreement(agreed.stats.tolist(), 1)
        assert got[1:] == host[1:] and (got[0] == host[0] or (got[0] != got[0] and host[0] != host[0]))
        assert bool(agreed.apply) == (finite and host[0] == host[0])


def test_train_slices_broadcasts_and_seeds_the_loader_batch():
    """``train`` on the loader's ``[..., R]`` batch equals ``compute`` on the hand-made slice with the same
    seed; the broadcast hook sees the slice on the device."""
    cfg = TrainConfig.from_preset("tiny", env={})
    a, b = TrainingStep.build(cfg), TrainingStep.build(cfg)
    seen = []
    a.broadcast = lambda batch: seen.append(batch) or batch
    a.dtype = torch.float32
    out_a = a.train(dict(a.batch), 1, seed=7, stop=True, count=2).read(1)
    torch.manual_seed(7)
    b.set_flags(True, 2)
    out_b = b.compute(b.sliced(1)).read(1)
    assert out_a == out_b and out_a.stop and out_a.count == 2
    assert seen and seen[0]["aatype"].shape[-1] == 2
