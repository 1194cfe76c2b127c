"""The memory model: its prediction against the CPU allocator's real peak, DAP on a fake process group,
the CUDA rules, and the start-up check. Small presets only (each estimate is a few CPU seconds)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from scalefold.config.training import TrainConfig
from scalefold.perf.memory import (
    CONTEXT_RESERVE_BYTES,
    FRAGMENTATION_MARGIN,
    GiB,
    MemoryEstimate,
    StorageTracker,
    check_fits,
    estimate_memory,
    measure_cpu_peak,
)  # fmt: skip


def _cfg(**overrides) -> TrainConfig:
    return TrainConfig.from_preset("tiny", overrides={"precision": "bf16", "activation_checkpointing": True, **overrides},
                                   env={})  # fmt: skip


@functools.cache
def _estimate(target: str, kernels: str | None = None, **overrides) -> MemoryEstimate:
    """The estimate of ``_cfg(**overrides)`` on ``target``, made once for the tests that read the same one (each is
    ~10 CPU s of fake-tensor step); a test that checks what making it does (the fake group's end) makes its own."""
    return estimate_memory(_cfg(**overrides), target=target, kernels=kernels)


@pytest.mark.parametrize("overrides", [{}, {"precision": "fp32", "activation_checkpointing": False}],
                         ids=["bf16-checkpointing", "fp32-plain"])  # fmt: skip
def test_prediction_matches_the_real_cpu_peak(overrides):
    cfg = _cfg(**overrides)
    measured = measure_cpu_peak(cfg)["peak_bytes"]
    predicted = _estimate("cpu", **overrides).peak_bytes
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)


def test_one_recycling_pass_stands_for_all():
    cfg = _cfg(num_recycling_iters=2)  # R = 3: a step takes up to 2 no-grad passes
    one = estimate_memory(cfg, target="cpu", recycling=1)
    two = estimate_memory(cfg, target="cpu", recycling=2)
    # not bit-equal: the batch slices [..., :n+1] that get copied differ in size by one recycling slice
    assert abs(one.step_peak_bytes / two.step_peak_bytes - 1) < 0.01


def test_breakdown_and_cuda_rules():
    cpu = _estimate("cpu")  # no graph pool: --cuda-graphs resolves off on the CPU
    cuda = _estimate("cuda", kernels="torch")
    assert sum(cpu.breakdown.values()) == cpu.step_peak_bytes
    assert {"parameters", "gradients", "optimizer_state", "batch"} <= set(cpu.breakdown)
    assert cpu.breakdown["optimizer_state"] == 3 * cpu.breakdown["parameters"]  # Adam moments + SWA, fp32
    assert "evoformer_stack" in cpu.modules
    # CUDA: 512-byte blocks and fp32 softmax / layer norm under autocast: never smaller than CPU's
    assert cuda.step_peak_bytes > cpu.step_peak_bytes
    assert cuda.cuda_graph_pool_bytes > 0 and cuda.peak_bytes >= cuda.step_peak_bytes
    assert cuda.settings["cuda_graphs"] and not cpu.settings["cuda_graphs"]


def test_dap_runs_on_a_fake_process_group_and_shards_activations():
    one = _estimate("cpu")  # DAP 1, the default
    two = estimate_memory(_cfg(dap=2), target="cpu")  # made here: the fake process group it sets up is gone after
    assert not dist.is_initialized()  # the fake group is gone again
    assert one.settings["dap"] == 1 and two.settings["dap"] == 2 and not two.settings["cuda_graphs"]
    assert two.breakdown["activations"] < one.breakdown["activations"]
    assert two.breakdown["parameters"] == one.breakdown["parameters"]  # DAP replicates the weights
    with pytest.raises(ValueError):
        estimate_memory(_cfg(dap=5), target="cpu")  # crop 24 does not split 5 ways


class _Clone(torch.autograd.Function):  # grad mode is off inside forward, as in DAP's collectives
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _TwoPasses(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            kept = self.iteration(x)  # a recycling pass: only its output survives
        return kept, self.iteration(x + kept)  # the grad pass

    def iteration(self, x):
        return _Clone.apply(x * 2)


def test_a_functions_forward_belongs_to_the_pass_it_runs_in():
    x = torch.ones(1000, requires_grad=True)  # 4,000 bytes per storage
    model = _TwoPasses()
    tracker = StorageTracker()
    tracker.phase("forward")
    tracker.passes(model)
    with tracker:
        kept, out = model(x)
    assert "iteration" not in vars(model)  # undone at exit
    assert out.requires_grad and not kept.requires_grad
    live = {cat: n for (cat, _), n in tracker.live.items() if n}
    # the temporaries died; the Function's output in the grad pass is the grad pass's (was: recycling)
    assert live == {"recycling": 4000, "activations": 4000}, live


def test_recycling_bytes_live_at_the_grad_peak_do_not_grow_with_dap():
    """Under DAP the grad pass's scatter / gather / all_to_all allocate inside autograd Functions (grad
    mode off there); counted by the operator's grad mode they looked like recycling storages kept alive
    into the grad pass (tiny bf16 + checkpointing, CUDA rules: 0.47 MB at DAP 2 against 0.20 MB at DAP 1;
    MLPerf crop 256 DAP 2: 1.02 GiB)."""
    # the PyTorch kernels at both sizes: the fused triangle multiplication runs at DAP 1 only (DAP keeps the
    # module's path, whose linear layers hold the shared weight casts into the grad pass)
    one = _estimate("cuda", kernels="torch")  # DAP 1, the default
    two = estimate_memory(_cfg(dap=2), target="cuda", kernels="torch")
    none = estimate_memory(_cfg(dap=2), target="cuda", kernels="torch", recycling=0)
    assert "recycling" not in none.breakdown and "recycling" not in none.phase_peaks
    # what survives a recycling pass: the recycled first MSA row, pair and positions -- the same at DAP 2
    assert 0 < two.breakdown["recycling"] <= one.breakdown["recycling"]
    # and the recycling pass's own peak stays below the grad pass's (it sizes the CUDA-graph pool)
    assert one.phase_peaks["recycling"] < one.phase_peaks["forward"]


def _fake_estimate(peaks: dict[int, int]):
    def run(cfg: TrainConfig) -> MemoryEstimate:
        return MemoryEstimate(peaks[cfg.dap], peaks[cfg.dap], 0, {}, {}, {}, {"dap": cfg.dap})

    return run


def _capacity(usable: int) -> int:
    return int(CONTEXT_RESERVE_BYTES + usable * (1 + FRAGMENTATION_MARGIN)) + 1


def test_check_fits_names_the_dap_size_that_fits():
    # the real tiny estimates: DAP 2 needs less per rank than DAP 1; a device between the two
    cfg = _cfg()
    one = _estimate("cuda", dap=1).peak_bytes
    two = _estimate("cuda", dap=2).peak_bytes
    assert two < one
    assert check_fits(cfg, capacity_bytes=_capacity(one)) is None  # its own (default) estimate
    # the same real estimates, each made once: DAP 1 does not fit, DAP 2 does
    message = check_fits(cfg, capacity_bytes=_capacity((one + two) // 2), estimate=lambda c: _estimate("cuda", dap=c.dap))
    assert message is not None and "--dap 2" in message and "exceeds" in message


def test_check_fits_messages():
    cfg = _cfg()
    peaks = {1: 70 * GiB, 2: 40 * GiB, 4: 30 * GiB, 8: 20 * GiB}
    msg = check_fits(cfg, capacity_bytes=_capacity(35 * GiB), estimate=_fake_estimate(peaks))
    assert "DAP 4 fits" in msg and "--dap 4" in msg and "70.0 GiB" in msg
    assert check_fits(cfg, capacity_bytes=_capacity(80 * GiB), estimate=_fake_estimate(peaks)) is None
    msg = check_fits(cfg, capacity_bytes=_capacity(10 * GiB), estimate=_fake_estimate(peaks))
    assert "no DAP size up to 8 fits" in msg
    assert check_fits(cfg, device="cpu") is None  # host memory is not checked


def test_cli_json_and_bad_input(capsys):
    import json

    from scalefold.cli import main

    assert main(["estimate-memory", "--preset", "tiny", "--target", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_bytes"] > 0 and out["modules"] and out["settings"]["target"] == "cpu"
    assert main(["estimate-memory", "--preset", "nope"]) == 3
    assert main(["estimate-memory", "--preset", "tiny", "--dap", "5"]) == 3
    assert "estimate-memory" in capsys.readouterr().err
