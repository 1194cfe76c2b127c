"""Whole-step CUDA graphs (``--cuda-graphs step``) on the CPU over the emulated capture
(:mod:`scalefold.compilation.emulated_capture`: the step recorded once, replayed without its Python).

These tests check the capture bookkeeping on top of it -- the static buffers and the copy of the live
batch into them, the replay's host side (the optimizer's pending verdict), the warm-up that leaves no
trace, the check of two consecutive replays against eager (which catches a wrong gradient and a Python
value baked into the graph), the fallbacks -- and that the step itself keeps a capture's rules: with
dropout and activation checkpointing on, replays are bit-identical to eager.
"""

from __future__ import annotations

import json

import pytest
import torch

from scalefold.compilation.graphed_step import (
    WHOLE_STEP_DDP,
    CudaGraphsUnavailable,
    WholeStepGraphs,
    perturbed_batch,
    resolve_mode,
    resolve_step_mode,
)
from scalefold.compilation.emulated_capture import EmulatedGraphBackend
from scalefold.config.training import TrainConfig
from scalefold.train.step import TrainingStep


class PlantedBackend(EmulatedGraphBackend):
    """The emulated capture with a planted fault: ``fail`` -- the capture raises (a refused operation);
    ``scale`` -- every replay leaves the gradient buffer scaled by 2 (a graph reading or writing the wrong
    memory); the replays themselves run no Python of the step."""

    def __init__(self, fail: bool = False, scale: bool = False, step: TrainingStep | None = None) -> None:
        super().__init__()
        self.fail, self.scale, self.step, self.captures = fail, scale, step, 0

    def capture(self, fn, static_args):
        if self.fail:
            fn(*static_args)
            raise RuntimeError("operation not permitted when stream is capturing")
        replay = super().capture(fn, static_args)
        self.captures += 1
        if not self.scale:
            return replay

        def scaled():
            out = replay()
            for g in self.step.opt.groups:
                g.grad.mul_(2)
            return out

        return scaled


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
    assert resolve_step_mode("auto", "cpu")[0] is False  # auto keeps eager on the CPU
    assert resolve_step_mode("step", "cpu") == (True, "--cuda-graphs step: the whole step, emulated on the CPU, one rank")
    assert resolve_step_mode("auto", "cuda", world_size=2) == (False, WHOLE_STEP_DDP)
    with pytest.raises(CudaGraphsUnavailable, match="needs a CUDA device"):
        resolve_mode("recycling", "cpu")  # the recycling graphs have no CPU emulation
    with pytest.raises(CudaGraphsUnavailable, match="2 training ranks needs --grad-reduce flat or auto"):
        resolve_step_mode("step", "cuda", world_size=2)
    assert resolve_step_mode("step", "cpu", world_size=2, flat_reduce=True)[1] == (
        "--cuda-graphs step: the whole step, emulated on the CPU, 2 training ranks, data parallel, the flat gradient "
        "all-reduce inside")
    # DAP's and BP's collectives are tensor collectives: captured inside the graph, by step and auto
    assert resolve_step_mode("step", "cuda", model_parallel=2)[1] == \
        "--cuda-graphs step: the whole step, CUDA, DAP 2 (its collectives inside the graph)"
    assert resolve_step_mode("step", "cuda", model_parallel=4, bp=2)[1] == \
        "--cuda-graphs step: the whole step, CUDA, DAP 2 x BP 2 (its collectives inside the graph)"
    with pytest.raises(CudaGraphsUnavailable, match="not supported here: a reason"):  # a model that cannot be
        resolve_step_mode("step", "cuda", unsupported="a reason")
    assert resolve_step_mode("auto", "cuda", model_parallel=2)[0] is True
    assert resolve_step_mode("auto", "cuda", model_parallel=2, world_size=4, flat_reduce=True)[1] == (
        "--cuda-graphs auto: the whole step, CUDA, 4 training ranks, DAP 2 (its collectives inside the graph), the "
        "flat gradient all-reduce inside")
    assert resolve_step_mode("auto", "cuda", model_parallel=2, world_size=4) == (False, WHOLE_STEP_DDP)


def test_warm_up_captures_every_count_leaves_no_trace_and_replays_match_eager():
    """Warm-up captures counts 0 .. R-1 and restores weights, moments, counters and RNG; the first step
    (SWA's copy) runs eagerly, later ones replay with the live batch copied into the static buffers --
    losses, norms and weights bit-identical to a twin step run eagerly, the optimizer settled after each."""
    graphed, eager = _step(), _step()
    backend = PlantedBackend()
    graphs = WholeStepGraphs(graphed, backend=backend, warn=pytest.fail)
    graphed.graphs = graphs
    before = _state(graphed)
    assert graphs.warm_up(graphed.batch) == list(range(graphed.num_ensembles))
    assert backend.captures == graphed.num_ensembles and graphs.tolerance == 0
    for a, b in zip(before, _state(graphed)):
        assert torch.equal(a, b)
    assert graphed.autocast_cache and not graphed.opt._pending

    for i, n in enumerate([1, 0, 1]):
        live = {k: v[..., : n + 1].clone() + 0 for k, v in eager.batch.items()}  # new addresses each step
        results = []
        for step in (graphed, eager):
            step.opt.set_lr(1e-3 / (i + 1))
            out = step.train(live, n, seed=100 + i, stop=i == 2, count=i)
            got = out.read(1)
            step.settle(got)
            results.append(got)
        assert results[0] == results[1]
        assert results[0].stop == (i == 2) and results[0].count == i
        for a, b in zip(_state(graphed), _state(eager)):
            assert torch.equal(a, b)
    assert graphs.stats.eager_swa_copy == 1 and graphs.stats.graphed == 2 and graphs.stats.eager_miss == 0
    assert graphed.opt.num_steps == eager.opt.num_steps == 3
    assert "2 step(s) graphed" in graphs.summary()


@pytest.mark.parametrize("parallel_evoformer", [False, True], ids=["evoformer", "parallel-evoformer"])
def test_the_demo_step_with_dropout_and_checkpointing_replays_bit_identically(parallel_evoformer):
    """The demo preset with dropout and activation checkpointing on: after SWA's first (eager) update every
    recycling count is replayed twice, each time with another seed, learning rate and batch -- losses, grad
    norms, weights, Adam's moments and SWA bit-identical to the same steps run eagerly. With the Parallel
    Evoformer its branches draw from their own generators, held by the graph and seeded before each step."""
    overrides = {"activation_checkpointing": "on", "parallel_evoformer": parallel_evoformer}
    cfg = TrainConfig.from_preset("demo", env={}, overrides=overrides)
    graphed, eager = TrainingStep.build(cfg), TrainingStep.build(cfg)
    assert any(graphed.model.checkpointed_blocks().values())
    graphs = graphed.use_whole_step_graphs(log=lambda line: None)
    assert graphs.active, graphs.reason
    counts = [0] + [n for _ in range(2) for n in range(graphed.num_ensembles)]
    for i, n, outcomes in _paired_steps(graphed, eager, counts, seed=1000):
        assert outcomes[0] == outcomes[1], (i, n)
        for a, b in zip(_state(graphed), _state(eager)):
            assert torch.equal(a, b), (i, n)
    assert graphs.stats.graphed == len(counts) - 1 and graphs.stats.eager_swa_copy == 1
    assert len(graphed.generators()) == (2 if parallel_evoformer else 0)


def test_uncaptured_shapes_run_eagerly_said_once():
    step = _step()
    lines = []
    graphs = WholeStepGraphs(step, backend=PlantedBackend(), warn=lines.append)
    assert graphs.warm_up(step.batch, counts=[0]) == [0]
    step.opt._n_averaged_host = 1  # past SWA's first update
    other = {k: v[..., :1] for k, v in step.batch.items()}
    other["seq_length"] = other["seq_length"].to(torch.int32)  # another dtype: another key
    assert graphs(other, 0) is None and graphs(other, 0) is None
    assert graphs.stats.eager_miss == 2 and len(lines) == 1 and "no whole-step graph" in lines[0]


def _stale_python_value(step: TrainingStep):
    """A Python value the host changes every step (a counter, a rate read on the host) fed to the update:
    eager sees each step's, a replay the capture's."""
    real, calls = step.opt.step, [0]

    def planted(clip_scale=None, apply=None):
        calls[0] += 1
        return real(clip_scale=clip_scale * (1.0 if calls[0] % 2 else 0.5), apply=apply)

    step.opt.step = planted


@pytest.mark.parametrize("fault, why", [
    ("fail", "capture failed: RuntimeError: operation not permitted"),
    ("scale", "warm-up step 1 of 2: replay differs from eager (gradient buffer"),
    ("stale", "replay differs from eager (weights"),
])  # fmt: skip
def test_a_failed_capture_a_wrong_gradient_or_a_baked_value_turns_graphs_off_in_one_line(fault, why):
    step = _step()
    if fault == "stale":
        _stale_python_value(step)
    lines = []
    backend = PlantedBackend(fail=fault == "fail", scale=fault == "scale", step=step)
    graphs = WholeStepGraphs(step, backend=backend, warn=lines.append)
    before = _state(step)
    assert graphs.warm_up(step.batch) == []
    assert not graphs.active and len(lines) == 1 and why in lines[0] and "off for this run" in lines[0], lines
    for a, b in zip(before, _state(step)):  # nothing half-applied: the warm-up undone bit for bit
        assert torch.equal(a, b)
    assert graphs(step.sliced(0), 0) is None and graphs.stats.eager_off == 1


def test_graphs_that_leave_no_room_for_an_eager_step_are_turned_off_with_the_figures():
    """On a GPU the warm-up weighs the graphs' pool and an eager step's transient peak against what is left
    on the card (planted figures here): graphs that would not fit are off for the run in one line."""
    step = _step()
    lines = []
    graphs = WholeStepGraphs(step, backend=PlantedBackend(), warn=lines.append)
    graphs.memory_figures = lambda: (10 * 2**30, 5 * 2**30, 2**30)
    before = _state(step)
    assert graphs.warm_up(step.batch, counts=[0]) == [] and not graphs.active
    assert len(lines) == 1 and "pool holds 10.00 GiB" in lines[0] and "needs 5.00 GiB beside it" in lines[0], lines
    assert "1.00 GiB is left" in lines[0]
    for a, b in zip(before, _state(step)):
        assert torch.equal(a, b)
    fits = WholeStepGraphs(_step(), backend=PlantedBackend(), warn=pytest.fail)
    fits.memory_figures = lambda: (10 * 2**30, 2**30, 2 * 2**30)
    assert fits.warm_up(fits.step.batch, counts=[0]) == [0]


def test_a_refused_operation_in_the_step_turns_graphs_off_naming_its_line(monkeypatch):
    """An ``.item()`` planted in the loss: the warm-up's capture refuses it, names the line, runs eagerly."""
    from scalefold.losses import alphafold_loss

    real = alphafold_loss.find_structural_violations

    def planted(*args, **kwargs):
        out = real(*args, **kwargs)
        out["between_residues"]["clashes_mean_loss"].sum().item()  # planted host read
        return out

    monkeypatch.setattr(alphafold_loss, "find_structural_violations", planted)
    step = _step()
    lines = []
    graphs = WholeStepGraphs(step, backend=EmulatedGraphBackend(), warn=lines.append)
    assert graphs.warm_up(step.batch, counts=[0]) == []
    assert len(lines) == 1 and "CaptureRefused: a device-to-host read" in lines[0], lines
    assert "tests/compilation/test_whole_step_graphs.py:" in lines[0] and "(planted)" in lines[0], lines


def test_the_trainer_replays_whole_step_graphs_with_the_same_numbers(tmp_path, capsys):
    """``--cuda-graphs step`` on a CPU runs the emulated capture (one line says so) and writes the metrics and
    checkpoint of a run with graphs off, bit for bit; the summary counts the replayed steps."""
    from scalefold.checkpoint.files import load_checkpoint
    from scalefold.cli import main

    store = tmp_path / "store.h5"
    common = ["train", "--preset", "tiny", "--max-steps", "3", "--eval-every", "0", "--checkpoint-every", "3",
              "--store", str(store), "--no-progress", "--deterministic"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "off"), "--cuda-graphs", "off"]) == 0
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "step"), "--cuda-graphs", "step"]) == 0
    out = capsys.readouterr().out
    assert "--cuda-graphs step on a CPU runs the emulated capture" in out
    assert "cuda graphs (whole step): 2 step(s) graphed, 1 eager before SWA's first update" in out

    def metrics(path):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("time_")} for x in path.read_text().splitlines()]

    off, step = (metrics(tmp_path / m / "metrics.jsonl") for m in ("off", "step"))
    assert len(off) == 3 and off == step
    (a,), (b,) = (sorted((tmp_path / m / "checkpoints").glob("*.pt")) for m in ("off", "step"))
    assert _tensors(load_checkpoint(a)) == _tensors(load_checkpoint(b))


def _paired_steps(graphed: TrainingStep, eager: TrainingStep, counts: list[int], seed: int):
    """Each step ``i`` of recycling count ``n`` on both steps -- its own perturbed batch, learning rate and
    seed --, read and settled: yields ``(i, n, (graphed outcome, eager outcome))``."""
    for i, n in enumerate(counts):
        live = {k: v[..., : n + 1] for k, v in perturbed_batch(eager.batch, seed=i).items()}
        outcomes = []
        for step in (graphed, eager):
            step.opt.set_lr(1e-3 * (0.7**i))
            outcomes.append(step.train(live, n, seed=seed + i).read(1))
            step.settle(outcomes[-1])
        yield i, n, outcomes


def _tensors(obj, prefix=""):
    """Every tensor of a nested checkpoint as ``{path: (dtype, values)}`` (comparable bit for bit)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: (obj.dtype, obj.detach().double().flatten().tolist())}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _tensors(val, f"{prefix}/{key}").items()}
    return {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision,parallel_evoformer", [("fp32", False), ("bf16", False), ("fp32", True)],
                         ids=["fp32", "bf16", "fp32-parallel-evoformer"])  # fmt: skip
def test_real_whole_step_graphs_match_eager(precision, parallel_evoformer):
    """On a GPU, at the settings that matter: the demo step (dropout and activation checkpointing on) captured
    whole per recycling count and replayed twice per count, each with another seed, learning rate and batch:
    losses, norms and weights as the eager step's within rounding; the capture's own warm-up check passed.
    With the Parallel Evoformer its branches' CUDA generators are registered with each graph (a replay draws
    new masks from them, as eager does)."""
    overrides = {"precision": precision, "activation_checkpointing": "on", "parallel_evoformer": parallel_evoformer}
    cfg = TrainConfig.from_preset("demo", overrides=overrides, env={})
    graphed, eager = TrainingStep.build(cfg, "cuda"), TrainingStep.build(cfg, "cuda")
    assert any(graphed.model.checkpointed_blocks().values())
    graphs = graphed.use_whole_step_graphs(log=print)
    assert graphs.active, graphs.reason  # e.g. a refused operation in the step, or a disagreeing replay
    tol = dict(rtol=2e-2, atol=2e-3) if precision == "bf16" else dict(rtol=1e-4, atol=1e-6)
    counts = [0] + [n for _ in range(2) for n in range(graphed.num_ensembles)]
    for _, _, outs in _paired_steps(graphed, eager, counts, seed=100):
        assert outs[0].skipped == outs[1].skipped
        torch.testing.assert_close(outs[0].mean_loss, outs[1].mean_loss, **tol)
        torch.testing.assert_close(outs[0].grad_norm, outs[1].grad_norm, **tol)
        for a, b in zip(graphed.opt.groups, eager.opt.groups):
            torch.testing.assert_close(a.master, b.master, **tol)
    assert graphs.stats.graphed == len(counts) - 1 and graphs.stats.eager_swa_copy == 1
    if parallel_evoformer:
        assert [g.device.type for g in graphed.generators()] == ["cuda", "cuda"]


def test_the_step_down_its_cuda_code_paths_replays_bit_identically():
    """The step forced down the branches it takes on a GPU (``device_path.as_cuda``: dropout's one
    ``native_dropout`` kernel, the optimizer's device staging chunks, the one-reduction gradient norm) is
    recorded and replayed as on the CPU's own: with dropout and activation checkpointing on, every recycling
    count replayed with new seeds, rates and batches, bit-identical to the same steps run eagerly on those
    paths; the graphs hold the CUDA branch's operators."""
    from scalefold.kernels import device_path
    from scalefold.model.dropout import SharedDropout

    cfg = TrainConfig.from_preset("tiny", env={}, overrides={"activation_checkpointing": "on"})
    with device_path.as_cuda():
        graphed, eager = TrainingStep.build(cfg), TrainingStep.build(cfg)
        for step in (graphed, eager):  # the tiny preset's rates are 0: the demo's, so masks are drawn
            for module in step.model.modules():
                if isinstance(module, SharedDropout):
                    module.p = 0.25
        backend = EmulatedGraphBackend()
        graphs = graphed.use_whole_step_graphs(log=lambda line: None, backend=backend)
        assert graphs.active, graphs.reason
        counts = [0] + list(range(graphed.num_ensembles))
        for i, n, outcomes in _paired_steps(graphed, eager, counts, seed=2000):
            assert outcomes[0] == outcomes[1], (i, n)
            for a, b in zip(_state(graphed), _state(eager)):
                assert torch.equal(a, b), (i, n)
    assert graphs.stats.graphed == len(counts) - 1
    recorded = {str(func) for g in backend.graphs for func, *_ in g.nodes}
    assert "aten.native_dropout.default" in recorded and "aten.bernoulli_.float" not in recorded
