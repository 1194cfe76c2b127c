"""The activation-checkpointing planner: ``auto`` picks the fewest recomputing blocks that fit with the
calibrated margin, a policy that cannot fit is refused naming the smallest N that does; and the
command-line side of it (``estimate-step`` / ``estimate-memory``). Fake predictions stand in for the
fake-tensor step except in the one end-to-end command."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from scalefold.cli import main
from scalefold.config.training import TrainConfig
from scalefold.perf import recompute
from scalefold.perf.recompute import (
    MISS_FACTOR,
    PolicyDoesNotFit,
    block_counts,
    calibrated_peak,
    resolve_policy,
)  # fmt: skip

GiB = 2**30
STATE = 2 * GiB


@dataclass
class _Estimate:
    peak_bytes: int
    breakdown: dict = field(default_factory=dict)


def _mlperf(policy="auto", dap=1) -> TrainConfig:
    return TrainConfig.from_preset("mlperf", overrides={"precision": "bf16", "activation_checkpointing": policy, "dap": dap},
                                   env={})  # fmt: skip


def _linear_model(calls: list):
    """A peak that falls by 1.4 GiB per recomputing block from 82 GiB (off) -- MLPerf has 54 blocks."""

    def estimate(cfg: TrainConfig) -> _Estimate:
        policy = cfg.activation_checkpointing
        n = 54 if policy == "on" else 0 if policy == "off" else int(policy)
        calls.append(n)
        peak = STATE + int((80 - 1.4 * n) * GiB)
        return _Estimate(peak, {"parameters": STATE // 4, "optimizer_state": STATE * 3 // 4, "activations": peak - STATE})

    return estimate


def _fits(n: int, capacity: int) -> bool:
    est = _linear_model([])(_mlperf(str(n)))
    return calibrated_peak(est) <= recompute._Search(_mlperf(), capacity, None).usable


def test_the_margin_multiplies_the_activations_only():
    est = _Estimate(10 * GiB, {"parameters": GiB, "gradients": GiB, "optimizer_state": GiB, "activations": 7 * GiB})
    assert calibrated_peak(est, margin=1.5) == 3 * GiB + int(1.5 * 7 * GiB)
    assert calibrated_peak(est) == 3 * GiB + int(MISS_FACTOR * 7 * GiB)
    # calibrated on the one GPU measurement: the predicted 8.33 GiB of that configuration becomes 11.6 GiB
    calibration = _Estimate(recompute.CALIBRATION_PREDICTED_BYTES, {"batch": recompute.CALIBRATION_STATE_BYTES})
    assert calibrated_peak(calibration) == pytest.approx(recompute.CALIBRATION_MEASURED_BYTES, rel=1e-6)
    assert 1.0 < MISS_FACTOR < 1.93


@pytest.mark.parametrize("capacity_gib", [80, 60, 40])
def test_auto_picks_the_fewest_recomputing_blocks_that_fit(capacity_gib):
    calls: list[int] = []
    choice = resolve_policy(_mlperf(), capacity_bytes=capacity_gib * GiB, estimate=_linear_model(calls))
    smallest = next(n for n in range(55) if _fits(n, capacity_gib * GiB))
    assert choice.blocks == smallest and choice.probe.fits and not choice.probes[smallest - 1].fits
    assert len(calls) == len(set(calls)) <= 8  # each policy tried once; interpolation, not a scan
    assert sum(choice.checkpointed_blocks.values()) == smallest
    assert choice.checkpointed_blocks["template_pair_stack"] == 2 and choice.checkpointed_blocks["extra_msa_stack"] == 4


@pytest.mark.parametrize("seed", range(12))
def test_auto_finds_the_boundary_of_any_falling_peak(seed):
    """Peaks falling unevenly with N (the stacks' blocks differ): the search still returns the smallest N."""
    g = torch.Generator().manual_seed(seed)
    drops = torch.rand(54, generator=g) ** 3 * 4 * GiB  # some blocks free much more than others
    peaks = [STATE + int(6 * GiB + drops[n:].sum()) for n in range(55)]

    def estimate(cfg):
        p = cfg.activation_checkpointing
        return _Estimate(peaks[54 if p == "on" else 0 if p == "off" else int(p)], {"batch": STATE})

    capacity = int((1 + (1 + torch.rand(1, generator=g).item() * 30)) * GiB)
    usable = recompute._Search(_mlperf(), capacity, None).usable
    fitting = [n for n in range(55) if calibrated_peak(_Estimate(peaks[n], {"batch": STATE})) <= usable]
    if not fitting:
        with pytest.raises(PolicyDoesNotFit):
            resolve_policy(_mlperf(), capacity_bytes=capacity, estimate=estimate)
        return
    choice = resolve_policy(_mlperf(), capacity_bytes=capacity, estimate=estimate)
    assert choice.blocks == fitting[0] and len(choice.probes) <= 10


def test_a_policy_that_cannot_fit_is_refused_with_the_smallest_n():
    estimate = _linear_model([])
    smallest = next(n for n in range(55) if _fits(n, 80 * GiB))
    with pytest.raises(PolicyDoesNotFit, match=rf"activation checkpointing 10: predicted peak .* GiB per rank.*"
                       rf"the smallest N that fits is {smallest} .*--activation-checkpointing {smallest} \(or auto\)"):
        resolve_policy(_mlperf("10"), capacity_bytes=80 * GiB, estimate=estimate)
    with pytest.raises(PolicyDoesNotFit, match="activation checkpointing off: predicted peak 82.0 GiB"):
        resolve_policy(_mlperf("off"), capacity_bytes=80 * GiB, estimate=estimate)
    fits = resolve_policy(_mlperf("on"), capacity_bytes=80 * GiB, estimate=estimate)
    assert fits.policy == "on" and list(fits.probes) == [54]  # a policy that fits costs one prediction
    with pytest.raises(PolicyDoesNotFit, match="no policy fits .*larger --dap or a smaller --crop"):
        resolve_policy(_mlperf("on"), capacity_bytes=8 * GiB, estimate=estimate)
    with pytest.raises(PolicyDoesNotFit, match="no policy fits"):
        resolve_policy(_mlperf("auto"), capacity_bytes=8 * GiB, estimate=estimate)


def test_without_device_memory_auto_is_an_input_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_policy(_mlperf("on"), estimate=_linear_model([])) is None  # nothing to check against
    with pytest.raises(ValueError, match="auto needs the device memory"):
        resolve_policy(_mlperf("auto"), estimate=_linear_model([]))


def test_block_counts_follow_the_model():
    assert block_counts(_mlperf()) == [("template_pair_stack", 2), ("extra_msa_stack", 4), ("evoformer_stack", 48)]


def test_the_commands_refuse_bad_policies(monkeypatch, capsys):
    monkeypatch.setattr("scalefold.perf.flops.count_step", lambda cfg, **kw: _linear_model([])(cfg))
    rc = main(["estimate-step", "--activation-checkpointing", "10", "--device-memory-gib", "80"])
    err = capsys.readouterr().err
    assert rc == 3 and "scalefold estimate-step: activation checkpointing 10: predicted peak" in err
    assert "the smallest N that fits is" in err and "Traceback" not in err
    rc = main(["estimate-step", "--activation-checkpointing", "sometimes"])
    assert rc == 3 and "--activation-checkpointing: activation checkpointing 'sometimes'" in capsys.readouterr().err
    rc = main(["estimate-memory", "--activation-checkpointing", "99", "--preset", "tiny"])
    assert rc == 3 and "the model has 4 blocks" in capsys.readouterr().err
    rc = main(["estimate-step", "--preset", "tiny", "--device-memory-gib", "-1"])
    assert rc == 3 and "must be > 0" in capsys.readouterr().err


def test_estimate_step_json_on_a_small_preset(capsys):
    rc = main(["estimate-step", "--preset", "tiny", "--precision", "bf16", "--activation-checkpointing", "2",
               "--device-memory-gib", "2", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["recycling_counts"] == [0, 1]
    assert out["checkpointed_blocks"] == {"template_pair_stack": 1, "extra_msa_stack": 1, "evoformer_stack": 0}
    assert 0 < out["flops"]["0"] < out["flops"]["1"] and out["flops_mean"] == (out["flops"]["0"] + out["flops"]["1"]) / 2
    assert out["model_flops"]["0"] < out["flops"]["0"]  # two blocks recompute
    assert set(out["floor_s"]) == {"h100-sxm", "h200", "a100-sxm-80gb"} and out["peak_bytes"] > 0
    assert sum(m["flops"]["0"] for m in out["modules"].values()) == out["flops"]["0"]
    assert out["policy"]["policy"] == "2" and out["policy"]["probes"]["2"]["fits"]
