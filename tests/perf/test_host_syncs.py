"""Host reads counted inside the training step (scalefold.perf.host_syncs): none with the default options
on the CPU, a planted ``.item()`` counted, the step's results read once after it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scalefold.config.training import TrainConfig
from scalefold.perf.host_syncs import HostSyncCounter, count_host_syncs
from scalefold.train.step import TrainingStep

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def step():
    s = TrainingStep.build(TrainConfig.from_preset("tiny", env={}))
    s.run(0)  # lazy initialisation and SWA's first update, as the benchmark's first step
    return s


def test_each_kind_of_host_read_is_counted():
    t = torch.tensor([0.0, 2.0, 3.0])
    cases = {
        "item": lambda: t[1].item(), "float": lambda: float(t[1]), "bool": lambda: bool(t[1] > 0),
        "tolist": lambda: t.tolist(), "numpy": lambda: t.numpy(), "nonzero": lambda: t.nonzero(),
        "mask_index": lambda: t[t > 1],
    }  # fmt: skip
    for name, fn in cases.items():
        _, report = count_host_syncs(fn)
        assert report.count >= 1, name
    _, report = count_host_syncs(lambda: (t * 2 + 1).sum().sqrt())  # device work only
    assert report.count == 0 and report.cpu_only == []


def test_reads_only_a_cpu_makes_are_reported_apart():
    """F.one_hot's class-range check reads back on the CPU only (CUDA skips it): reported, not counted."""
    _, report = count_host_syncs(lambda: F.one_hot(torch.tensor([1, 2]), num_classes=4))
    assert report.count == 0 and len(report.cpu_only) >= 1


def test_the_default_step_makes_no_host_read_and_reads_its_results_once(step):
    for n in range(step.num_ensembles):
        with HostSyncCounter() as counter:
            step.run(n, read=False)
        assert counter.count == 0, counter.report.by_place()
        with HostSyncCounter() as counter:
            outcome = step.finish()
        assert counter.count == 1 and counter.report.events[0].kind == "tolist"
        assert not outcome.skipped and outcome.grad_norm > 0 and "fape" in outcome.terms


def test_a_planted_item_inside_the_step_is_counted_where_it_is(step, monkeypatch):
    real = step.loss_fn

    class Planted(torch.nn.Module):
        def forward(self, outputs, batch):
            loss, terms = real(outputs, batch)
            if loss.item() > 1e30:  # a host read inside the step
                raise AssertionError
            return loss, terms

    monkeypatch.setattr(step, "loss_fn", Planted())
    with HostSyncCounter() as counter:
        step.run(0, read=False)
    step.finish()
    assert counter.count == 1, counter.report.by_place()
    (event,) = counter.report.events
    assert event.kind == "item" and "scalefold/train/step.py" in event.where


def test_bench_steps_json_field(step):
    from scalefold.perf.step_bench import step_host_syncs

    out = step_host_syncs(TrainConfig.from_preset("tiny", env={}))
    assert out["host_syncs_per_step"] == 0 and out["cpu_only_reads_per_step"] > 0 and "host_syncs_where" not in out
