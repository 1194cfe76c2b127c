"""Recomputation only where memory needs it: the ``auto`` activation-checkpointing policy, and the
check that refuses a policy that cannot fit before a run starts.

Policies (:func:`scalefold.model.memory.parse_checkpointing`): ``on`` (every block recomputes), ``off``
(none), ``N`` (the first ``N`` blocks in forward order: template pair, extra MSA, then Evoformer) and
``auto``. With ``T`` blocks in all, ``off`` is ``N = 0`` and ``on`` is ``N = T``; the predicted peak
falls as ``N`` grows. :func:`resolve_policy` finds the smallest ``N`` whose peak, predicted by the
memory model (:func:`scalefold.perf.memory.estimate_memory`, one fake step per ``N`` tried) and widened
by the margin below, fits the device: it tries ``on`` and ``off``, then interpolates between the
closest ``N`` known not to fit and known to fit (bisecting when that stalls): 3-6 fake steps.

**Margin.** The memory model matches the CPU allocator within 2 % on small presets, but its one check
against a GPU allocator (``bench/RESULTS.md``, "First GPU contact": H200, MLPerf shapes, bf16, eager,
PyTorch kernels, crop 256, DAP 1, checkpointing on, no CUDA graphs) measured
``max_memory_allocated`` = 11.6 GiB against 6.02 GiB predicted: 1.93x. Part of that was a defect of the
model, fixed since (:class:`~scalefold.perf.memory.AutocastProbe`: the CUDA autocast rule that puts
softmax and friends in fp32 never fired, so attention probabilities were predicted in bf16: 8.33 GiB), and
so was where the rule applied (below autograd, so backward never held the fp32 gradient of a softmax); the
same configuration is now predicted at 8.75 GiB (:data:`CALIBRATION_PREDICTED_BYTES`; the miss is 1.33x of
the whole peak). What remains is unexplained until a GPU's allocator trace is compared with the model line by
line (``PARTS=headline bash bench/gpu_session.sh``),
so ``auto`` assumes it scales with what the model predicts beyond the exactly known state (parameters,
gradients, optimizer state, buffers and batch: :data:`CALIBRATION_STATE_BYTES`):

    margin = (measured - state) / (predicted - state)            (:data:`MISS_FACTOR`, at least 1)
    calibrated peak = state + margin * (predicted peak - state)

and a policy fits when the calibrated peak is at most what :func:`scalefold.perf.memory.usable_bytes`
leaves of the device (minus 1 GiB of CUDA context and workspaces, over 1.1 for fragmentation). A
policy that keeps more activations than the calibration point has more of the unexplained part, which
is why the factor multiplies the activations rather than adding a constant. When a GPU measures the
peak of another policy, recalibrate here (the constants below, with the measurement's place).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from scalefold.config.training import ConfigError, TrainConfig

GiB = 2**30
#: bench/RESULTS.md, "First GPU contact" (H200, torch 2.11, code at 5133cc2): ``max_memory_allocated`` of
#: ``bench/step_headline.py --preset mlperf --precision bf16``, eager configuration (PyTorch kernels,
#: checkpointing on, no CUDA graphs), the largest over recycling counts 0-3.
CALIBRATION_MEASURED_BYTES = int(11.6 * GiB)
#: ``scalefold estimate-memory --preset mlperf --precision bf16 --kernels torch --cuda-graphs off``, the
#: same configuration, with CUDA autocast's fp32 casts in the autograd graph (8.75 GiB; 8.33 GiB with the casts
#: below autograd, 6.02 GiB before the autocast rule fired), one recycling pass run (code of 2026-11-27; the
#: prediction does not depend on the machine).
CALIBRATION_PREDICTED_BYTES = 9_395_624_960
#: ... of which parameters, gradients, optimizer state, buffers and the batch (exactly known: 1.79 GiB).
CALIBRATION_STATE_BYTES = 1_918_736_384
STATE_CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers", "batch")

#: The factor on the predicted activations (see the module docstring): (11.6 - 1.79) / (8.75 - 1.79) = 1.41.
MISS_FACTOR = max(1.0, (CALIBRATION_MEASURED_BYTES - CALIBRATION_STATE_BYTES)
                  / (CALIBRATION_PREDICTED_BYTES - CALIBRATION_STATE_BYTES))  # fmt: skip


def state_bytes(estimate: Any) -> int:
    """The exactly known part of a prediction (parameters, gradients, optimizer state, buffers, batch)."""
    return sum(estimate.breakdown.get(k, 0) for k in STATE_CATEGORIES)


def calibrated_peak(estimate: Any, margin: float | None = None) -> int:
    """A prediction's peak (a :class:`~scalefold.perf.memory.MemoryEstimate` or a
    :class:`~scalefold.perf.flops.StepCount`) with the margin on everything but the state."""
    margin = MISS_FACTOR if margin is None else margin
    state = state_bytes(estimate)
    return int(state + margin * max(estimate.peak_bytes - state, 0))


def block_counts(cfg: TrainConfig) -> list[tuple[str, int]]:
    """``(stack, blocks)`` of the configuration's model, in forward order (the stacks a policy counts)."""
    from scalefold.model.factory import build_model_config as model_config
    from scalefold.model.memory import CHECKPOINT_STACKS

    model_cfg = model_config(cfg)
    sizes = {
        "template_pair_stack": model_cfg.template_pair_stack_config.num_blocks if model_cfg.templates_enabled else 0,
        "extra_msa_stack": model_cfg.extra_msa_stack_config.num_blocks,
        "evoformer_stack": model_cfg.evoformer_stack_config.num_blocks,
    }
    return [(name, sizes[name]) for name in CHECKPOINT_STACKS if sizes[name]]


class PolicyDoesNotFit(ConfigError):
    """A policy whose calibrated peak exceeds the device (the message names the smallest ``N`` that fits)."""


@dataclass
class Probe:
    """One policy tried: ``N`` blocks recomputing, its prediction and whether it fits."""

    blocks: int
    estimate: Any  # MemoryEstimate, or a StepCount (its FLOPs too)
    calibrated_bytes: int
    fits: bool

    def to_json(self) -> dict[str, Any]:
        out = {"peak_bytes": self.estimate.peak_bytes, "calibrated_peak_bytes": self.calibrated_bytes, "fits": self.fits}
        if hasattr(self.estimate, "flops_mean"):  # a StepCount: its FLOPs per recycling count too
            step = self.estimate
            out["flops_mean"] = step.flops_mean
            out["flops"] = {str(n): step.flops(n) for n in step.recycling_counts()}
            out["model_flops"] = {str(n): step.model_flops(n) for n in step.recycling_counts()}
            out["bytes"] = {str(n): step.bytes(n) for n in step.recycling_counts()}
            floors = step.floors()
            out["floor_s"] = {card: v["floor_s"]["mean"] for card, v in floors.items()}
            out["compute_s"] = {card: v["compute_s"]["mean"] for card, v in floors.items()}
        return out


@dataclass
class PolicyChoice:
    """A policy checked against a device: ``blocks`` (``N``) of ``total_blocks`` recompute."""

    blocks: int
    total_blocks: int
    checkpointed_blocks: dict[str, int]
    capacity_bytes: int
    usable_bytes: int
    margin: float
    probes: dict[int, Probe] = field(default_factory=dict)

    @property
    def policy(self) -> str:
        """The policy as the command line writes it (``on``, ``off`` or ``N``)."""
        return "on" if self.blocks == self.total_blocks else "off" if self.blocks == 0 else str(self.blocks)

    @property
    def probe(self) -> Probe:
        return self.probes[self.blocks]

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "blocks": self.blocks, "total_blocks": self.total_blocks,
            "checkpointed_blocks": self.checkpointed_blocks, "capacity_bytes": self.capacity_bytes,
            "usable_bytes": self.usable_bytes, "margin": round(self.margin, 4),
            "peak_bytes": self.probe.estimate.peak_bytes, "calibrated_peak_bytes": self.probe.calibrated_bytes,
            "probes": {str(n): p.to_json() for n, p in sorted(self.probes.items())},
        }  # fmt: skip


def _describe(n: int, total: int) -> str:
    return "on" if n == total else "off" if n == 0 else f"{n}"


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


class _Search:
    """Fake steps of ``cfg`` with ``N`` recomputing blocks, each run once."""

    def __init__(self, cfg: TrainConfig, capacity: int, estimate: Callable[[TrainConfig], Any] | None) -> None:
        from scalefold.perf.memory import usable_bytes

        self.cfg, self.capacity = cfg, capacity
        self.usable = usable_bytes(capacity)
        self.stacks = block_counts(cfg)
        self.total = sum(n for _, n in self.stacks)
        self.run = estimate or _default_estimate
        self.probes: dict[int, Probe] = {}

    def __call__(self, n: int) -> Probe:
        if n not in self.probes:
            est = self.run(replace(self.cfg, activation_checkpointing=_describe(n, self.total)))
            calibrated = calibrated_peak(est)
            self.probes[n] = Probe(n, est, calibrated, calibrated <= self.usable)
        return self.probes[n]

    def smallest(self) -> int | None:
        """The smallest ``N`` that fits, ``None`` when not even ``on`` does."""
        if not self(self.total).fits:
            return None
        if self(0).fits:
            return 0
        lo, hi, moves = 0, self.total, []
        while hi - lo > 1:
            c_lo, c_hi = self(lo).calibrated_bytes, self(hi).calibrated_bytes
            guess = lo + math.ceil((c_lo - self.usable) / max(c_lo - c_hi, 1) * (hi - lo))  # the peak ~ linear in N
            if moves[-2:] in (["lo", "lo"], ["hi", "hi"]):  # interpolation creeping from one side: bisect
                guess = (lo + hi) // 2
            guess = min(max(guess, lo + 1), hi - 1)
            if self(guess).fits:
                hi = guess
                moves.append("hi")
            else:
                lo = guess
                moves.append("lo")
        return hi

    def choice(self, n: int) -> PolicyChoice:
        from scalefold.model.memory import checkpointed_blocks

        return PolicyChoice(n, self.total, checkpointed_blocks(n, self.stacks), self.capacity, self.usable,
                            MISS_FACTOR, dict(self.probes))  # fmt: skip

    def too_big(self, n: int) -> str:
        p = self(n)
        return (f"activation checkpointing {_describe(n, self.total)}: predicted peak {_gib(p.estimate.peak_bytes)} per "
                f"rank, {_gib(p.calibrated_bytes)} with the {MISS_FACTOR:.2f}x margin on activations (the memory model's "
                f"measured miss), exceeds the {_gib(self.usable)} usable of a {_gib(self.capacity)} device")  # fmt: skip


def _default_estimate(cfg: TrainConfig) -> Any:
    from scalefold.perf.flops import count_step

    return count_step(cfg)  # the FLOPs of each policy tried come with it (cached)


def device_capacity(device: Any = None) -> int | None:
    """Total memory of a CUDA device (default the current one); ``None`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.device(device if device is not None else "cuda")
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def resolve_policy(
    cfg: TrainConfig, capacity_bytes: int | None = None, device: Any = None,
    estimate: Callable[[TrainConfig], Any] | None = None,
) -> PolicyChoice | None:  # fmt: skip
    """Check ``cfg.activation_checkpointing`` against a device of ``capacity_bytes`` (default: the CUDA
    device's memory). ``auto``: the smallest ``N`` that fits; ``on`` / ``off`` / ``N``: that policy,
    refused with :class:`PolicyDoesNotFit` (naming the prediction and the smallest ``N`` that fits)
    when it does not fit. Without a capacity (no CUDA, none given): ``None`` for an explicit policy;
    ``auto`` raises :class:`~scalefold.config.training.ConfigError`. ``estimate(cfg)`` (a MemoryEstimate or StepCount) replaces the fake
    step (default :func:`scalefold.perf.flops.count_step`, cached: the FLOPs of every policy tried).
    A ``PolicyDoesNotFit`` is a ``ConfigError`` (a ``ValueError``): the command line reports it as an input error."""
    from scalefold.config.recompute import parse_checkpointing

    policy = parse_checkpointing(cfg.activation_checkpointing)
    capacity = capacity_bytes if capacity_bytes is not None else device_capacity(device)
    if capacity is None:
        if policy == "auto":
            raise ConfigError("activation checkpointing auto needs the device memory: run on CUDA or give "
                              "--device-memory-gib")  # fmt: skip
        return None
    search = _Search(cfg, capacity, estimate)
    if policy != "auto":
        n = search.total if policy is True else 0 if policy is False else int(policy)
        if n > search.total:
            try:
                search.choice(n)  # raises, naming the blocks there are
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        if search(n).fits:
            return search.choice(n)
        head = search.too_big(n)
        best = search.smallest()
        if best is None:
            raise PolicyDoesNotFit(f"{head}; no policy fits (on: {_gib(search(search.total).calibrated_bytes)} with "
                                   "the margin): use a larger --dap or a smaller --crop")  # fmt: skip
        raise PolicyDoesNotFit(f"{head}; the smallest N that fits is {best} (predicted "
                               f"{_gib(search(best).estimate.peak_bytes)}, {_gib(search(best).calibrated_bytes)} with "
                               f"the margin): --activation-checkpointing {_describe(best, search.total)} (or auto)")  # fmt: skip
    best = search.smallest()
    if best is None:
        raise PolicyDoesNotFit(f"{search.too_big(search.total)}: no policy fits; use a larger --dap or a smaller --crop")
    return search.choice(best)


__all__ = [
    "CALIBRATION_MEASURED_BYTES", "CALIBRATION_PREDICTED_BYTES", "CALIBRATION_STATE_BYTES", "MISS_FACTOR",
    "PolicyChoice", "PolicyDoesNotFit", "Probe", "block_counts", "calibrated_peak", "device_capacity",
    "resolve_policy", "state_bytes",
]  # fmt: skip
