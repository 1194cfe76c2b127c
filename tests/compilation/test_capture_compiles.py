"""No compilation inside a capture (scalefold.compilation.capture_compiles): a ``torch.compile`` region that
meets inputs it was not compiled for while the step is captured is refused with the region and the shapes,
the whole step's graphs turn off in one line, and the run goes on eagerly with unchanged numbers. A planted
new shape class on the CPU: a compiled region whose input shape changes with a host counter, so the capture
meets a shape the warm-up never did."""

from __future__ import annotations

import pytest
import torch

from scalefold.compilation.emulated_capture import CaptureRefused, EmulatedGraphBackend, record
from scalefold.compilation.whole_step_graphs import WholeStepGraphs, perturbed_batch
from scalefold.config.training import TrainConfig
from scalefold.train.step import TrainingStep

pytestmark = pytest.mark.usefixtures("one_thread")


def _glue(x):
    return torch.sin(x) * 2 + 1


def _loss_glue(x):  # another code object: Dynamo's cache is per code, shared by every torch.compile of it
    return torch.cos(x) * 2


def test_a_region_recompiled_inside_the_capture_is_refused_naming_it_and_the_shape():
    compiled = torch.compile(_glue, dynamic=False, backend="eager")
    warm = torch.ones(4)
    compiled(warm)  # compiled for float32[4]
    graph = record(lambda x: compiled(x) + 1, warm)  # the warm shape: no compilation, recorded
    warm.fill_(0.5)
    assert torch.equal(graph.replay(), _glue(warm) + 1)
    with pytest.raises(CaptureRefused, match=r"torch.compile region _glue \(tests/compilation/test_capture_compiles.py") as info:
        record(lambda x: compiled(x) + 1, torch.ones(6))  # a new shape class: Dynamo would compile here
    assert info.value.rule == "recompile" and "x float32[6]" in info.value.what, info.value
    assert info.value.where.startswith("tests/compilation/test_capture_compiles.py:"), info.value.where


def _plant_new_shape_class(monkeypatch, compiled, growing=False):
    """The loss calls ``compiled`` on float32[3] at odd calls and float32[4] at even ones (adding 0: the
    numbers do not change): the backend's eager warm-up iteration meets [3], the capture [4]. ``growing``:
    float32[3 + call] (each call a shape never met: the capture's too, however many calls came before)."""
    from scalefold.losses import alphafold_loss

    real, calls = alphafold_loss.find_structural_violations, [0]

    def planted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        extra = compiled(torch.ones(3 + (calls[0] if growing else (calls[0] + 1) % 2))).sum()
        out["between_residues"]["clashes_mean_loss"] = out["between_residues"]["clashes_mean_loss"] + 0 * extra
        return out

    monkeypatch.setattr(alphafold_loss, "find_structural_violations", planted)


def test_a_recompile_in_the_whole_step_capture_turns_graphs_off_and_the_run_goes_on_unchanged(monkeypatch):
    compiled = torch.compile(_loss_glue, dynamic=False, backend="eager")
    compiled(torch.ones(3))  # --compile's warm-up: the shape it met
    _plant_new_shape_class(monkeypatch, compiled)
    cfg = TrainConfig.from_preset("tiny", env={})
    graphed, eager = TrainingStep.build(cfg), TrainingStep.build(cfg)
    lines = []
    graphs = WholeStepGraphs(graphed, backend=EmulatedGraphBackend(), warn=lines.append)
    graphed.graphs = graphs
    assert graphs.warm_up(graphed.batch, counts=[0]) == [] and not graphs.active
    assert len(lines) == 1 and "recycling count 0: capture failed: CaptureRefused: a compilation (torch.compile " \
        "region _loss_glue" in lines[0] and "x float32[4]" in lines[0] and "off for this run" in lines[0], lines
    for i in range(2):
        live = {k: v[..., :1] for k, v in perturbed_batch(eager.batch, seed=i).items()}
        outcomes = []
        for step in (graphed, eager):
            outcomes.append(step.train(live, 0, seed=50 + i).read(1))
            step.settle(outcomes[-1])
        assert outcomes[0] == outcomes[1]
    for a, b in zip(graphed.opt.groups, eager.opt.groups):
        assert torch.equal(a.master, b.master)
    assert graphs.stats.eager_off == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_recompile_inside_a_real_capture_is_named():
    """On a GPU: a region that meets a new shape only once the capture starts (after the backend's eager
    warm-up iterations) raises CompiledInCapture naming it, not CUDA's invalidated-capture error."""
    from scalefold.compilation.capture_compiles import CompiledInCapture
    from scalefold.compilation.cuda_graphs import CudaGraphBackend

    compiled = torch.compile(_glue, dynamic=False, backend="inductor")
    backend, calls = CudaGraphBackend(), [0]
    x = torch.ones(8, device="cuda")

    def fn(a):
        calls[0] += 1
        return compiled(a if calls[0] <= backend.warmup_iters else a[:5])

    with pytest.raises(CompiledInCapture, match=r"torch.compile region _glue .* x float32\[5\]"):
        backend.capture(fn, (x,))


def test_train_with_compile_and_the_emulated_capture_names_a_recompile_and_keeps_its_numbers(tmp_path, capsys,
                                                                                           monkeypatch):  # fmt: skip
    """``scalefold train --compile --cuda-graphs step`` on the CPU (the emulated capture): the warmed ``--compile``
    regions pass the capture; a planted region meeting a new shape class inside it turns graphs off in one
    line, and the run's metrics are those of the same run with graphs off."""
    import json

    from scalefold.cli import main

    compiled = torch.compile(_cli_glue, dynamic=False, backend="eager")
    compiled(torch.ones(3))
    _plant_new_shape_class(monkeypatch, compiled, growing=True)
    monkeypatch.setenv("SCALEFOLD_COMPILE_BACKEND", "eager")  # the compile regions' backend: no inductor build
    common = ["train", "--preset", "tiny", "--max-steps", "2", "--eval-every", "0", "--checkpoint-every", "0",
              "--store", str(tmp_path / "store.h5"), "--no-progress", "--deterministic", "--compile"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "step"), "--cuda-graphs", "step"]) == 0
    captured = capsys.readouterr()
    off_lines = [line for line in captured.err.splitlines() if "whole-step graphs are off" in line]
    assert len(off_lines) == 1 and "CaptureRefused: a compilation (torch.compile region _cli_glue" in off_lines[0]
    assert "meets inputs it was not compiled for: x float32[" in off_lines[0], off_lines
    assert main([*common, "--out", str(tmp_path / "off"), "--cuda-graphs", "off"]) == 0

    def metrics(path):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("time_")} for x in path.read_text().splitlines()]

    assert metrics(tmp_path / "step" / "metrics.jsonl") == metrics(tmp_path / "off" / "metrics.jsonl")


def _cli_glue(x):  # a code object of its own (Dynamo's cache is per code)
    return torch.tanh(x) * 3
