"""Whole-step CUDA graphs (``--cuda-graphs step``) on CPU with a fake graph backend.

The fake "graph" re-runs the captured function (the training step's ``compute``) on the static batch
buffers, so these tests check everything short of the capture itself: the static buffers and the copy
of the live batch into them, the replay bookkeeping, the warm-up that leaves no trace, the comparison
with eager, and the fallbacks on a failed or disagreeing capture.
"""

from __future__ import annotations

import json

import pytest
import torch

from scalefold.compilation.graphed_step import (
    WHOLE_STEP_DDP,
    CudaGraphsUnavailable,
    WholeStepGraphs,
    resolve_step_mode,
)
from scalefold.config.training import TrainConfig
from scalefold.train.step import TrainingStep


class FakeStepBackend:
    """CPU stand-in: one eager warm-up call (as the real backend's side-stream iterations), then a
    "capture" whose replay re-runs the function on the static arguments."""

    device_type = "cpu"

    def __init__(self, fail: bool = False, corrupt: bool = False) -> None:
        self.fail, self.corrupt, self.captures = fail, corrupt, 0

    def is_available(self) -> bool:
        return True

    def capture(self, fn, static_args):
        fn(*static_args)  # warm-up iteration
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        if self.corrupt:  # a graph reading the wrong memory: the loss doubled

            def replay():
                out = fn(*static_args)
                out.loss = out.loss * 2
                return out

            return replay
        return lambda: fn(*static_args)

    def capture_with_grad(self, module, example_args):  # pragma: no cover
        raise AssertionError("not used")


pytestmark = pytest.mark.usefixtures("one_thread")


def _step() -> TrainingStep:
    cfg = TrainConfig.from_preset("tiny", env={})
    return TrainingStep.build(cfg)  # model seeded as the run seeds it: two builds are the same step


def _state(step: TrainingStep) -> list[torch.Tensor]:
    opt = step.opt
    out = [opt.step_count.clone(), opt.swa_n_averaged.clone(), torch.get_rng_state()]
    for g in opt.groups:
        out += [t.clone() for t in (g.master, g.exp_avg, g.exp_avg_sq, g.swa)]
    return out


def test_resolve_step_mode():
    assert resolve_step_mode("step", "cuda") == (True, "--cuda-graphs step: the whole step, CUDA, one rank")
    assert resolve_step_mode("auto", "cuda")[0] is True
    assert resolve_step_mode("recycling", "cuda") == (False, "--cuda-graphs recycling")
    assert resolve_step_mode("off", "cuda")[0] is False
    assert resolve_step_mode("auto", "cpu")[0] is False
    assert resolve_step_mode("auto", "cuda", world_size=2) == (False, WHOLE_STEP_DDP)
    with pytest.raises(CudaGraphsUnavailable, match="needs a CUDA device"):
        resolve_step_mode("step", "cpu")
    with pytest.raises(CudaGraphsUnavailable, match="2 data-parallel ranks"):
        resolve_step_mode("step", "cuda", world_size=2)
    with pytest.raises(CudaGraphsUnavailable, match="--dap/--bp"):
        resolve_step_mode("step", "cuda", model_parallel=2)


def test_warm_up_captures_every_count_leaves_no_trace_and_replays_match_eager():
    """Warm-up captures counts 0 .. R-1 and restores weights, moments, counters and RNG; the first step
    (SWA's copy) runs eagerly, later ones replay with the live batch copied into the static buffers --
    losses, norms and weights bit-identical to a twin step run eagerly."""
    graphed, eager = _step(), _step()
    backend = FakeStepBackend()
    graphs = WholeStepGraphs(graphed, backend=backend, warn=pytest.fail)
    graphed.graphs = graphs
    before = _state(graphed)
    assert graphs.warm_up(graphed.batch) == list(range(graphed.num_ensembles))
    assert backend.captures == graphed.num_ensembles
    for a, b in zip(before, _state(graphed)):
        assert torch.equal(a, b)
    assert graphed.autocast_cache and not graphed.opt._pending

    for i, n in enumerate([1, 0, 1]):
        live = {k: v[..., : n + 1].clone() + 0 for k, v in eager.batch.items()}  # new addresses each step
        results = []
        for step in (graphed, eager):
            out = step.train(live, n, seed=100 + i, stop=i == 2, count=i)
            got = out.read(1)
            step.settle(got)
            results.append(got)
        assert results[0] == results[1]
        assert results[0].stop == (i == 2) and results[0].count == i
        for a, b in zip(_state(graphed), _state(eager)):
            assert torch.equal(a, b)
    assert graphs.stats.eager_swa_copy == 1 and graphs.stats.graphed == 2 and graphs.stats.eager_miss == 0
    assert "2 step(s) graphed" in graphs.summary()


def test_uncaptured_shapes_run_eagerly_said_once():
    step = _step()
    lines = []
    graphs = WholeStepGraphs(step, backend=FakeStepBackend(), warn=lines.append)
    assert graphs.warm_up(step.batch, counts=[0]) == [0]
    step.opt._n_averaged_host = 1  # past SWA's first update
    other = {k: v[..., :1] for k, v in step.batch.items()}
    other["seq_length"] = other["seq_length"].to(torch.int32)  # another dtype: another key
    assert graphs(other, 0) is None and graphs(other, 0) is None
    assert graphs.stats.eager_miss == 2 and len(lines) == 1 and "no whole-step graph" in lines[0]


@pytest.mark.parametrize("fault, why", [("fail", "capture failed"), ("corrupt", "loss: relative error")])
def test_a_failed_or_disagreeing_capture_turns_whole_step_graphs_off_in_one_line(fault, why):
    step = _step()
    lines = []
    graphs = WholeStepGraphs(step, backend=FakeStepBackend(**{fault: True}), warn=lines.append)
    before = _state(step)
    assert graphs.warm_up(step.batch) == []
    assert not graphs.active and len(lines) == 1 and why in lines[0] and "off for this run" in lines[0]
    for a, b in zip(before, _state(step)):
        assert torch.equal(a, b)
    assert graphs(step.sliced(0), 0) is None and graphs.stats.eager_off == 1


def test_cuda_graphs_step_on_a_cpu_is_refused_in_one_line(tmp_path, capsys):
    from scalefold.cli import main

    out = tmp_path / "run"
    rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(tmp_path / "s.h5"), "--cuda-graphs", "step"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and len(err) == 1 and "--cuda-graphs step needs a CUDA device" in err[0], err
    assert not (out / "mlperf.log").exists()


def test_the_trainer_replays_whole_step_graphs_with_the_same_numbers(tmp_path, monkeypatch):
    """A run whose whole step is captured before run_start (fake backend) writes the metrics of a run
    with graphs off, bit for bit; the graphs were replayed for every step after the first."""
    from scalefold.cli import main
    from scalefold.compilation import graphed_step
    from scalefold.train import trainer as loop

    store = tmp_path / "store.h5"
    common = ["train", "--preset", "tiny", "--max-steps", "3", "--eval-every", "0", "--checkpoint-every", "0",
              "--store", str(store), "--no-progress"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "off"), "--cuda-graphs", "off"]) == 0
    created = []

    def fake_setup(*args, **kwargs):
        created.append(graphed_step.setup_step_graphs(*args, **{**kwargs, "backend": FakeStepBackend()}))
        return created[-1]

    monkeypatch.setattr(loop, "setup_step_graphs", fake_setup)
    monkeypatch.setattr(loop, "resolve_graph_mode", lambda *a, **k: (True, "fake backend"))
    monkeypatch.setattr(loop, "resolve_step_mode", lambda *a, **k: (True, "fake backend"))
    monkeypatch.setattr(graphed_step, "resolve_step_mode", lambda *a, **k: (True, "fake backend"))
    assert main([*common, "--out", str(tmp_path / "step"), "--cuda-graphs", "step"]) == 0

    def metrics(path):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("time_")} for x in path.read_text().splitlines()]

    off, step = (metrics(tmp_path / m / "metrics.jsonl") for m in ("off", "step"))
    assert len(off) == 3 and off == step
    (graphs,) = created
    assert graphs.stats.graphed == 2 and graphs.stats.eager_swa_copy == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_real_whole_step_graphs_match_eager(precision):
    """On a GPU: the tiny step captured whole (every recycling count) and replayed gives the eager step's
    losses, norms and weights within rounding, for a few steps."""
    cfg = TrainConfig.from_preset("tiny", overrides={"precision": precision}, env={})
    graphed, eager = TrainingStep.build(cfg, "cuda"), TrainingStep.build(cfg, "cuda")
    graphs = graphed.use_whole_step_graphs(log=print)
    assert graphs.active, graphs.reason  # e.g. a host sync in the step, or a capture failure
    tol = dict(rtol=2e-2, atol=2e-3) if precision == "bf16" else dict(rtol=1e-4, atol=1e-6)
    for i, n in enumerate([1, 0, 1, 0]):
        outs = []
        for step in (graphed, eager):
            torch.manual_seed(100 + i)
            step.run(n, read=False)
            outs.append(step.finish())
        torch.testing.assert_close(outs[0].mean_loss, outs[1].mean_loss, **tol)
        torch.testing.assert_close(outs[0].grad_norm, outs[1].grad_norm, **tol)
        for a, b in zip(graphed.opt.groups, eager.opt.groups):
            torch.testing.assert_close(a.master, b.master, **tol)
    assert graphs.stats.graphed == 3 and graphs.stats.eager_swa_copy == 1
