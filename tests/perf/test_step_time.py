"""The step-time model (``scalefold.perf.step_time``): a roofline per launch, at least the minimum kernel
time; eager adds the host's time per launch; the calibration against the measured eager steps."""

from __future__ import annotations

import json

import pytest

from scalefold.perf import step_time
from scalefold.perf.devices import DEVICES
from scalefold.perf.flops import StepCount
from scalefold.perf.step_time import CardTiming, fit_host_seconds, predict, step_seconds

H200 = CardTiming(DEVICES["h200"], flops_efficiency=0.5, bandwidth_efficiency=0.8, min_kernel_s=5e-6, host_s_per_launch=2e-5)


def test_a_launch_is_the_larger_of_its_flops_its_bytes_and_the_minimum():
    spec = H200.spec
    assert H200.launch_seconds((0, 0, 0, 0, 1)) == 5e-6  # an empty kernel: the minimum
    assert H200.launch_seconds((0, 0, 0, 10**9, 1)) == pytest.approx(1e9 / (spec.bandwidth * 0.8))
    assert H200.launch_seconds((10**12, 0, 0, 10, 1)) == pytest.approx(1e12 / (spec.bf16 * 0.5))
    assert H200.launch_seconds((0, 10**9, 0, 10, 1)) == pytest.approx(1e9 / (spec.fp32 * 0.5))
    assert H200.launch_seconds((0, 10**10, 0, 10, 1), "tf32") == pytest.approx(1e10 / (spec.tf32 * 0.5))
    assert H200.launch_seconds((0, 0, 0, 0, 5)) == 5 * 5e-6  # a Triton operator's several kernels


def test_eager_adds_the_host_per_launch():
    profile = {(0, 0, 0, 10**8, 1): 100, (0, 0, 0, 0, 5): 10}
    s = step_seconds(profile, H200)
    device = 100 * 1e8 / (H200.spec.bandwidth * 0.8) + 10 * 25e-6
    assert s["graphed"] == pytest.approx(device)
    assert s["eager"] == pytest.approx(device + 150 * 2e-5)


def _count(recycling_launches: int, grad_launches: int) -> StepCount:
    """A step count of two launch kinds: the no-grad pass's and the rest."""
    parts = {"recycling": {"m": [0] * 6 + [recycling_launches]}, "forward": {"m": [0] * 6 + [grad_launches]}}
    profile = {"recycling": {"m": {(0, 0, 0, 0, 1): recycling_launches}}, "forward": {"m": {(0, 0, 0, 0, 1): grad_launches}}}
    return StepCount(parts=parts, recycling_run=1, num_ensembles=4, memory=None, settings={"precision": "bf16"},
                     profile=profile, ops={})  # fmt: skip


def test_predicted_s_has_the_shape_estimate_step_promises():
    out = predict(_count(100, 300), timings={"h200": H200, "h100-sxm": H200})
    assert set(out) == {"h100-sxm", "h200"}
    card = out["h200"]
    assert set(card) == {"eager", "graphed"}
    assert set(card["eager"]) == {"0", "1", "2", "3", "mean"}
    # n passes: 300 + 100 n launches of 5 us, eager 25 us each
    for n in range(4):
        assert card["graphed"][str(n)] == pytest.approx((300 + 100 * n) * 5e-6)
        assert card["eager"][str(n)] == pytest.approx((300 + 100 * n) * 25e-6)
    assert card["eager"]["mean"] == pytest.approx(sum(card["eager"][str(n)] for n in range(4)) / 4)


def test_the_host_fit():
    assert fit_host_seconds(0.5, 1000, 0.6) == pytest.approx(1e-4)
    with pytest.raises(ValueError):
        fit_host_seconds(0.5, 0, 0.6)


def test_the_calibration_meets_the_measured_rows():
    """The host time per launch is the fit to the measured mean of the counted configuration
    (:data:`~scalefold.perf.step_time.CALIBRATION`), and every measured row is within 25 %."""
    cal = step_time.CALIBRATION
    timing = step_time.TIMINGS[cal["card"]]
    launches = sum(cal["launches"].values()) / len(cal["launches"])
    device = sum(cal["graphed_s"].values()) / len(cal["graphed_s"])
    assert timing.host_s_per_launch == pytest.approx(fit_host_seconds(device, launches, cal["measured_mean_s"]), rel=0.01)
    for n, measured in cal["measured_s"].items():
        predicted = cal["graphed_s"][n] + cal["launches"][n] * timing.host_s_per_launch
        assert abs(predicted / measured - 1) < 0.25, (n, predicted, measured)


def test_estimate_step_reports_launches_and_predicted_seconds(capsys):
    from scalefold.cli import main

    # the PyTorch kernels: on the Triton path the fused attention and triangle multiplication hold every chain of
    # the tiny preset (no dropout there), so only this path shows the chains as kernels of their own
    rc = main(["estimate-step", "--preset", "tiny", "--precision", "bf16", "--kernels", "torch", "--compile", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["recycling_counts"] == [0, 1]
    assert 0 < out["launches"]["0"] < out["launches"]["1"]
    assert out["launches_mean"] == (out["launches"]["0"] + out["launches"]["1"]) / 2
    assert sum(m["launches"]["1"] for m in out["modules"].values()) == out["launches"]["1"]
    assert any(op.startswith("chain:") for op in out["launches_by_op"])  # --compile: the chains are kernels
    assert out["settings"]["compiled_chains"]
    assert set(out["predicted_s"]) == {"h100-sxm", "h200"}
    for card in out["predicted_s"].values():
        assert set(card) == {"eager", "graphed"}
        assert set(card["graphed"]) == {"0", "1", "mean"}
        assert 0 < card["graphed"]["0"] < card["graphed"]["1"] and card["graphed"]["1"] < card["eager"]["1"]
