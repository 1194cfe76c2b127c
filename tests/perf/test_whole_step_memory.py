"""The memory model with whole-step CUDA graphs (``--cuda-graphs step``): the graphs' one pool holds the step's
transient peak (and the static batch) for the run, and an eager step needs its own beside it."""

from __future__ import annotations

import pytest

from scalefold.config.training import TrainConfig
from scalefold.perf.memory import estimate_memory

pytestmark = pytest.mark.usefixtures("one_thread")


def test_whole_step_graphs_count_the_pool_and_an_eager_step_beside_it():
    def est(mode):
        cfg = TrainConfig.from_preset("tiny", env={}, overrides={"cuda_graphs": mode})
        return estimate_memory(cfg, target="cuda", kernels="torch")

    recycling, step, off = est("recycling"), est("step"), est("off")
    assert recycling.step_peak_bytes == step.step_peak_bytes == off.step_peak_bytes  # the same fake step
    assert step.settings["cuda_graphs"] == "step" and recycling.settings["cuda_graphs"] == "recycling"
    assert off.peak_bytes == off.step_peak_bytes and off.cuda_graph_pool_bytes == 0
    # the pool: the whole transient peak (above the state at the forward's start) plus the static batch
    assert step.cuda_graph_pool_bytes > recycling.cuda_graph_pool_bytes
    assert step.peak_bytes == step.step_peak_bytes + step.cuda_graph_pool_bytes
    assert step.cuda_graph_pool_bytes < step.step_peak_bytes  # the state (weights, Adam, grads) is not in it


def test_whole_step_graphs_at_dap2_count_their_pool_too():
    """At DAP-2 the whole step is captured with its collectives inside: ``step`` holds its pool there as well."""
    def est(mode):
        cfg = TrainConfig.from_preset("tiny", env={}, overrides={"cuda_graphs": mode, "dap": 2})
        return estimate_memory(cfg, target="cuda", kernels="torch")

    step, off = est("step"), est("off")
    assert step.settings["cuda_graphs"] == "step" and off.settings["cuda_graphs"] is False
    assert 0 < step.cuda_graph_pool_bytes < step.step_peak_bytes == off.step_peak_bytes
    assert step.peak_bytes == step.step_peak_bytes + step.cuda_graph_pool_bytes
