"""compile_blocks' report: graph breaks and recompilations are counted, strict mode fails loudly.

Small stand-in stacks (a module with ``blocks``) make each situation happen on purpose; one test
runs the real ``tiny`` training step compiled in strict mode and expects zero of both. The cheap
``eager`` dynamo backend is used throughout: what is counted (dynamo's tracing and guards) is the
same for every backend. Nothing here depends on speed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scalefold.compilation.regions import BLOCK_REGIONS, CompileCheckError, compile_blocks


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class BreakingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        torch._dynamo.graph_break()  # what an unsupported call inside a block does
        return y + x


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Model(nn.Module):
    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)  # the stack's input requires grad in the grad pass, as in AlphaFold
        self.evoformer_stack = Stack(block)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.evoformer_stack(self.embed(x)))


def _train_like(model: nn.Module, x: torch.Tensor) -> None:
    """A no-grad recycling pass, then the grad pass and backward (the two expected grad modes)."""
    with torch.no_grad():
        model(x)
    model(x).sum().backward()


def test_clean_region_reports_zero_and_counts_blocks():
    model = Model()
    report = compile_blocks(model, regions=("evoformer_stack",), backend="eager", strict=True)
    assert report == 3 and report.regions == {"evoformer_stack": 3}
    _train_like(model, torch.randn(4, 8))
    stats = report.stats()
    assert stats["graph_breaks"] == 0 and stats["recompiles"] == 0
    assert stats["frames"] == {"evoformer_stack": 2}  # one graph per grad mode serves all three blocks
    report.check()  # does not raise
    assert compile_blocks(model, regions=("evoformer_stack",), backend="eager") == 0  # idempotent


def test_graph_break_counted_with_reason_and_fatal_in_strict_mode():
    model = Model(BreakingBlock)
    report = compile_blocks(model, regions=("evoformer_stack",), backend="eager")
    _train_like(model, torch.randn(4, 8))  # default: runs, with the breaks counted
    stats = report.stats()
    assert stats["graph_breaks"] >= 1
    assert any("graph_break" in reason or "graph break" in reason.lower() for reason in stats["graph_break_reasons"])
    assert "graph breaks" in report.summary()

    torch._dynamo.reset()
    strict_model = Model(BreakingBlock)
    compile_blocks(strict_model, regions=("evoformer_stack",), backend="eager", strict=True)
    with pytest.raises(Exception, match="(?i)graph.?break"):
        strict_model(torch.randn(4, 8))


def test_recompile_counted_but_grad_mode_switch_is_not():
    model = Model()
    report = compile_blocks(model, regions=("evoformer_stack",), backend="eager", strict=True)
    _train_like(model, torch.randn(4, 8))
    assert report.stats()["recompiles"] == 0  # no-grad then grad: expected
    model(torch.randn(5, 8))  # a new shape under dynamic=False: a recompilation
    stats = report.stats()
    assert stats["recompiles"] == 1
    assert "evoformer_stack" in stats["recompile_reasons"]
    with pytest.raises(CompileCheckError, match="1 recompiles"):
        report.check()


def test_input_strides_do_not_recompile():
    """Region inputs with other strides (a recycling slice of another batch) reuse the graph."""
    model = Model()
    report = compile_blocks(model, regions=("evoformer_stack",), backend="eager", strict=True)
    stack = model.evoformer_stack  # called directly: the first block sees the argument's strides
    stack(torch.randn(4, 8, requires_grad=True))
    stack(torch.randn(8, 4, requires_grad=True).t())  # same shape, transposed strides
    stack(torch.randn(4, 8, 3, requires_grad=True)[..., 1])  # a slice of a trailing dimension (recycling slices)
    assert report.stats()["recompiles"] == 0, report.summary()


def test_non_strict_report_never_raises():
    model = Model()
    report = compile_blocks(model, regions=("evoformer_stack",), backend="eager")
    model(torch.randn(4, 8))
    model(torch.randn(6, 8))
    assert report.stats()["recompiles"] == 1
    report.check()  # not strict: counted, not fatal


def test_module_region_and_fp32_region_compile_their_inner_forward():
    from scalefold.model.precision import run_in_fp32

    model = Model()
    run_in_fp32(model.head)
    report = compile_blocks(model, regions=("head",), backend="eager", strict=True)
    assert report.regions == {"head": 1}
    assert model.head._scalefold_fp32  # still runs in fp32 under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 8))
    assert out.dtype == torch.float32
    assert report.stats()["graph_breaks"] == 0


def test_a_region_compiles_with_the_garbage_collector_off_and_leaves_it_as_it_was():
    """A compiled region's call (its first one compiles) runs with Python's cyclic collector off, and turns it back
    on after only where it was on (the step loop keeps it off)."""
    import gc

    seen = []

    def backend(gm, example_inputs):  # called while the region compiles
        seen.append(gc.isenabled())
        return gm.forward

    model = Model()
    compile_blocks(model, regions=("evoformer_stack",), backend=backend, strict=True)
    assert gc.isenabled()
    model(torch.randn(4, 8))
    assert seen and not any(seen) and gc.isenabled()  # compiled (the three blocks share a graph) with it off
    gc.disable()
    try:
        model(torch.randn(4, 8))
        assert not gc.isenabled()
    finally:
        gc.enable()
    # the elementwise chains, compiled functions of their own, too
    from scalefold.kernels import elementwise

    seen.clear()
    state = dict(elementwise._state)
    elementwise.enable(backend, ("sigmoid_gate",))
    try:
        elementwise.chain("sigmoid_gate")(torch.randn(4, 8), torch.randn(4, 8))
    finally:
        elementwise._state.update(state)
        elementwise._compiled.pop(backend, None)
    assert seen and not any(seen) and gc.isenabled()


# fp32 (the tiny preset's precision): the same regions, strict, backend and recycling counts are
# tests/perf/test_step_bench.py::test_bench_step_json_counts_breaks_and_recompiles (through the command)
@pytest.mark.parametrize("precision", ["bf16"])
def test_tiny_training_step_compiles_without_breaks_or_recompiles(precision, monkeypatch):
    """... and the loss's constant tables are not traced into its graph: the violation term's distance bounds
    (thousands of NumPy assignments: minutes of compile time when dynamo traces them) are built when the loss
    module is, and the compiled step never calls their builder."""
    from scalefold import residue_constants
    from scalefold.config.training import TrainConfig
    from scalefold.train.step import TrainingStep

    cfg = TrainConfig.from_preset("tiny", overrides={"precision": precision}, env={})
    step = TrainingStep.build(cfg)
    built = []
    make_bounds = residue_constants.make_atom14_dists_bounds
    monkeypatch.setattr(residue_constants, "make_atom14_dists_bounds", lambda **kw: built.append(kw) or make_bounds(**kw))
    report = compile_blocks(step.model, BLOCK_REGIONS, backend="eager", strict=True, loss_fn=step.loss_fn)
    assert set(report.regions) == {"evoformer_stack", "extra_msa_stack", "template_pair_stack", "structure_module",
                                   "loss"}  # fmt: skip
    step.run(1)  # a no-grad recycling pass, the grad pass, backward, optimizer
    step.run(0)
    assert built == []  # built with the loss module, never in (or traced into) the compiled step
    stats = report.stats()
    assert stats["graph_breaks"] == 0, report.summary()
    assert stats["recompiles"] == 0, report.summary()
    report.check()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiny_training_step_elementwise_chains_compile_without_breaks_or_recompiles(precision):
    """The elementwise chains (all of them, ``fullgraph``): every chain the step calls is compiled, no
    graph breaks, and after the warm-up (every recycling count once) no graph is compiled again."""
    from scalefold.config.training import TrainConfig
    from scalefold.kernels import elementwise
    from scalefold.train.step import TrainingStep

    cfg = TrainConfig.from_preset("tiny", overrides={"precision": precision}, env={})
    step = TrainingStep.build(cfg)
    try:
        report = compile_blocks(step.model, ("elementwise:all",), backend="eager", strict=True, loss_fn=step.loss_fn)
        assert report.regions == {"elementwise": len(elementwise.CHAINS)} and elementwise.enabled()
        for n in range(step.num_ensembles):  # the warm-up
            step.run(n)
        report.mark_warm()
        graphs = report.stats()["elementwise_graphs"]
        assert graphs["masked_softmax"] > 0 and graphs["sigmoid_gate"] > 0 and graphs["gated_projection"] > 0, graphs
        for n in reversed(range(step.num_ensembles)):
            step.run(n)
        stats = report.stats()
        assert stats["graph_breaks"] == 0 and stats["recompiles"] == 0, report.summary()
        assert stats["elementwise_graphs"] == graphs
    finally:
        elementwise.disable()


def test_a_chain_graph_after_the_warm_up_counts_as_a_recompile():
    from scalefold.kernels import elementwise, sigmoid_gate

    model = torch.nn.Linear(2, 2)
    torch._dynamo.reset()  # no graph of this chain from an earlier test
    try:
        report = compile_blocks(model, ("elementwise:sigmoid_gate",), backend="eager")
        sigmoid_gate(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
        report.mark_warm()
        sigmoid_gate(torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64))  # new dtype
        stats = report.stats()
        assert stats["recompiles"] == 1 and "sigmoid_gate" in stats["recompile_reasons"]["elementwise"][0]
    finally:
        elementwise.disable()


def test_elementwise_region_names():
    from scalefold.compilation.regions import elementwise_chains
    from scalefold.kernels import elementwise

    assert elementwise_chains("elementwise", "cuda") == elementwise.CHAINS
    assert elementwise_chains("elementwise", "cpu") == elementwise.DEFAULT_CHAINS["cpu"]
    assert elementwise_chains("elementwise:all") == elementwise.CHAINS
    assert elementwise_chains("elementwise:dropout_add+sigmoid_gate") == ("dropout_add", "sigmoid_gate")
    with pytest.raises(ValueError, match="nope"):
        elementwise_chains("elementwise:nope")


def test_train_compile_regions_names(tmp_path, capsys):
    """``--compile-regions`` knows the regions compile_blocks knows; a misspelt one ends in one line naming it."""
    from scalefold.cli import main
    from scalefold.compilation.regions import ALL_REGIONS
    from scalefold.config.training import COMPILE_REGION_NAMES

    assert set(COMPILE_REGION_NAMES) == set(ALL_REGIONS) | {"auxiliary_heads"}
    rc = main(["train", "--compile", "--compile-regions", "evoformer_stak", "--out", str(tmp_path / "run")])
    assert rc == 3 and "evoformer_stak" in capsys.readouterr().err
