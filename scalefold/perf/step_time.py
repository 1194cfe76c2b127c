"""A step-time model per card: the counted step's launches priced one by one (``scalefold estimate-step``'s
``predicted_s``).

Each launch the counter records (:class:`scalefold.perf.flops.OpCounter`: an operator that is not a view, a
Triton operator as its kernels, a compiled elementwise chain as one kernel forward and one backward) takes

    max(its matrix FLOPs / (the card's dense peak x ``flops_efficiency``),
        its bytes / (the card's bandwidth x ``bandwidth_efficiency``),
        its kernels x ``min_kernel_s``)

on the device: a roofline per launch, never shorter than the shortest kernel the card runs back to back. A
**graphed** step (every launch replayed from a CUDA graph) is the sum of those; an **eager** step adds what the
host spends per launch (``host_s_per_launch``: Python, the dispatcher, autograd, the launch call) -- the host
and the device are taken not to overlap, which the measured eager steps bear out (below).

**Calibration** (:data:`TIMINGS`). The only measured steps are eager, on one H200 (``bench/RESULTS.md``,
"First GPU contact": ``bench/step_headline.py --preset mlperf --precision bf16``, the PyTorch kernel path,
CUDA graphs off: 3.48 s on average, 2.66 / 3.85 / 3.52 / 3.88 s with 0 / 1 / 2 / 3 no-grad passes).
``host_s_per_launch`` is fitted to the 3.48 s mean of that configuration's count (``estimate-step --preset
mlperf --precision bf16 --crop 256 --dap 1 --kernels torch --cuda-graphs off``); the device terms are not
fitted (no graphed or profiled step has been measured yet): the efficiencies and the minimum kernel time are
priors, stated here and in ``bench/RESULTS.md`` with the miss of every measured row. The host cost is taken
to be the host's, not the card's: the H100's entry uses the same figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scalefold.perf.devices import DEVICES, DeviceSpec


@dataclass(frozen=True)
class CardTiming:
    """What the model charges a launch on one card (see the module docstring)."""

    spec: DeviceSpec
    flops_efficiency: float  # fraction of the dense matrix peak a product reaches
    bandwidth_efficiency: float  # fraction of the memory bandwidth a memory-bound kernel reaches
    min_kernel_s: float  # the shortest time one kernel takes, back to back on the device
    host_s_per_launch: float  # eager only: the host's time per launch

    def launch_seconds(self, signature: tuple[int, ...], precision: str = "bf16") -> float:
        """Device seconds of one launch ``(mm_bf16, mm_fp32, mm_fp64, bytes, kernels)``."""
        mm16, mm32, mm64, nbytes, kernels = signature
        s = self.spec
        fp32 = s.tf32 if precision == "tf32" else s.fp32
        compute = (mm16 / s.bf16 + mm32 / fp32 + mm64 / s.fp64) / self.flops_efficiency
        return max(compute, nbytes / (s.bandwidth * self.bandwidth_efficiency), kernels * self.min_kernel_s)


#: Priors of the device terms (not fitted: no graphed step has been measured): cuBLAS reaching 60 % of the
#: dense peak at the model's product shapes (K = 32..256, the triangle products' batched 256 x 256 x 256), HBM
#: reached at 80 %, 4 us per kernel back to back (launch gap and the tail of a small grid, H100/H200).
FLOPS_EFFICIENCY, BANDWIDTH_EFFICIENCY, MIN_KERNEL_S = 0.6, 0.8, 4e-6
#: The measured configuration's count (the code as measured: each weight cast per pass and per recomputation)
#: and the measured eager steps it is fitted to (``bench/RESULTS.md``, "First GPU contact" and "Issue 34"):
#: launches and graphed (device) seconds on the H200 under the priors above, per no-grad pass count. Counted on
#: the GPU's paths (:mod:`scalefold.kernels.device_path`: dropout one ``native_dropout`` kernel, the optimizer's
#: device chunks): the count made before those paths were modelled (75,686 / 96,057 / 116,428 / 136,799 launches;
#: graphed 0.9183 / 1.1910 / 1.4638 / 1.7365 s) less what they remove from the same configuration today
#: (4,719 / 5,255 / 5,791 / 6,327 launches, 0.0170 / 0.0192 / 0.0213 / 0.0235 s: the counts of ``--kernels torch
#: --cuda-graphs off`` with and without them).
CALIBRATION = {
    "card": "h200",
    "count": "estimate-step --preset mlperf --precision bf16 --crop 256 --dap 1 --kernels torch --cuda-graphs off "
    "(before the shared weight casts; the GPU's dropout and optimizer paths)",
    "launches": {0: 70967, 1: 90802, 2: 110637, 3: 130472},
    "graphed_s": {0: 0.9013, 1: 1.1718, 2: 1.4425, 3: 1.7130},
    "measured_s": {0: 2.66, 1: 3.85, 2: 3.52, 3: 3.88},
    "measured_mean_s": 3.48,
}
#: Fitted: ``(3.48 s - the mean graphed seconds) / the mean launches`` of :data:`CALIBRATION` (the misses:
#: -8.6 / -18.7 / +8.8 / +16.7 % at n = 0 / 1 / 2 / 3; ``tests/perf/test_step_time.py`` recomputes the fit).
HOST_S_PER_LAUNCH = 21.57e-6

TIMINGS: dict[str, CardTiming] = {
    key: CardTiming(DEVICES[key], FLOPS_EFFICIENCY, BANDWIDTH_EFFICIENCY, MIN_KERNEL_S, HOST_S_PER_LAUNCH)
    for key in ("h100-sxm", "h200")
}
#: The cards ``estimate-step`` predicts for (keys of :data:`TIMINGS` and of ``predicted_s``).
PREDICT_CARDS = ("h100-sxm", "h200")


def device_seconds(profile: Mapping[tuple[int, ...], int], timing: CardTiming, precision: str = "bf16") -> float:
    """Device seconds of the launches ``profile`` (``{signature: calls}``) on one card."""
    return sum(calls * timing.launch_seconds(sig, precision) for sig, calls in profile.items())


def step_seconds(
    profile: Mapping[tuple[int, ...], int], timing: CardTiming, precision: str = "bf16"
) -> dict[str, float]:
    """``{"graphed": device seconds, "eager": the same plus the host's time per launch}`` of one step."""
    graphed = device_seconds(profile, timing, precision)
    launches = sum(calls * sig[-1] for sig, calls in profile.items())
    return {"graphed": graphed, "eager": graphed + launches * timing.host_s_per_launch}


def predict(step: Any, cards: tuple[str, ...] = PREDICT_CARDS, timings: Mapping[str, CardTiming] | None = None) -> dict:
    """``{card: {"eager": {"0": s, ..., "mean": s}, "graphed": {...}}}`` of a
    :class:`~scalefold.perf.flops.StepCount`: per recycling count ``n`` and the mean over the uniform
    draw the training makes."""
    timings = TIMINGS if timings is None else timings
    precision = step.settings.get("precision", "bf16")
    profiles = {n: step.launch_profile(n) for n in step.recycling_counts()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for card in cards:
        per_mode: dict[str, dict[str, float]] = {"eager": {}, "graphed": {}}
        for n, profile in profiles.items():
            for mode, seconds in step_seconds(profile, timings[card], precision).items():
                per_mode[mode][str(n)] = seconds
        for per_n in per_mode.values():
            per_n["mean"] = sum(per_n.values()) / len(per_n)
        out[card] = per_mode
    return out


def fit_host_seconds(graphed_s: float, launches: float, measured_s: float) -> float:
    """The host time per launch that makes an eager step of ``launches`` launches and ``graphed_s`` device
    seconds take ``measured_s``: ``(measured_s - graphed_s) / launches``."""
    if launches <= 0:
        raise ValueError("no launches to fit the host's time to")
    return (measured_s - graphed_s) / launches


__all__ = [
    "BANDWIDTH_EFFICIENCY", "CALIBRATION", "FLOPS_EFFICIENCY", "HOST_S_PER_LAUNCH", "MIN_KERNEL_S", "PREDICT_CARDS", "TIMINGS",
    "CardTiming", "device_seconds", "fit_host_seconds", "predict", "step_seconds",
]  # fmt: skip
