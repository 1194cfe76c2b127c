"""The headline's plan, in one place: its configurations in the order of their value, the seconds each is
expected to take on the card in hand, its cap, and the device-time plan of a GPU window.

Expected seconds per card. The one measured row (``bench/RESULTS.md``, "First GPU contact"): the eager
configuration at MLPerf shapes on one H200, 3.48 s per step (set-up 29 s). That configuration's arithmetic
(RESULTS.md section 7, ``scalefold estimate-step``): 64.43 TFLOP and 3.83 TB of operator traffic per step on
average. On the H200 (989.4 TFLOP/s dense bf16, 4.8 TB/s) that is 0.065 s of arithmetic and 0.80 s of memory
traffic; the remaining 2.62 s is host-issue / launch-bound and scales ~1x across cards. A card's eager step
is then ``host + bytes / bandwidth + FLOPs / peak``: H100 SXM (3.35 TB/s) 3.82 s, H200 3.48 s (its own row).
The configurations without whole-step CUDA graphs are assumed no faster per step than eager (what the window
is there to measure; a conservative plan: a faster configuration only finishes early) plus a cold set-up of
their own (Triton's JIT, graph capture, inductor; estimates, not measured). A configuration with whole-step
graphs (``graphs-step``, ``all``: ``--cuda-graphs step``) replays every launch of the step from a graph, so its
step loses the host-issue part: ``bytes / bandwidth + FLOPs / peak`` (:func:`graphed_step_s`; H100 SXM 1.21 s,
H200 0.86 s -- an ESTIMATE, not measured: this round's bar is <= 1.2 s/step on an H100; its warm-up cycle
holds the captures, one eager step each, and the first step after capture, eager). Once this run has measured
eager on the card in hand, :func:`expected_s` takes its step time instead (the last measured row wins; for a
graphed configuration: that step less the reference's host part, never below the device part).

    python bench/headline_plan.py --card h100 [--deadline 465]   # the configurations' expected seconds
    python bench/headline_plan.py --window --card h100 --call 560   # the device-time plan of a 15-minute window
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scalefold.perf.devices import DEVICES, device_spec  # noqa: E402

REFERENCE = {"card": "h200", "config": "eager", "step_s": 3.48, "setup_s": 29.0,
             "source": "bench/RESULTS.md, First GPU contact (2026-11-26, H200, code 5133cc2)"}  # fmt: skip
STEP_FLOPS = 64.43e12  # the measured configuration's matrix FLOPs per step, mean over recycling 0..3 (RESULTS.md s. 7)
STEP_BYTES = 3.83e12  # its operators' bytes read + written per step (same source)
START_S = 12.0  # a child's start: Python, torch, CUDA context, scalefold (a fresh machine: slower, in the caps)
BUILD_S = 15.0  # model, optimizer and the MLPerf batch on the GPU (the H200's 29 s set-up less its 4 warm-up steps)
PROFILE_STEPS = 2.0  # the profiled step (recycling 0) under torch.profiler, in eager steps, + PROFILE_EXPORT_S
PROFILE_EXPORT_S = 5.0
TRACE_S = (20, 40)  # the allocator trace of one more eager step: (expected, extra cap) seconds; not yet measured
RESERVE_S = 8.0  # kept back from the deadline for the table, the memory comparison and the files
# the CPU rehearsal (REHEARSE=cpu: preset tiny, fp32, torch kernels), measured on the 2-core dev box:
# import 4.6 s, build 0.1 s, a step 0.16-0.27 s, a profiled step 2.3 s, inductor's cold compile of the chains 31 s
REHEARSAL = {"start_s": 6.0, "build_s": 1.0, "step_s": 0.3, "profile_s": 3.0, "compile_s": 35.0, "recycling": 2}


@dataclass(frozen=True)
class Config:
    """One way to run the step: kernels, torch.compile, CUDA graphs, and its cold set-up beyond eager's."""

    kernels: str
    compiled: bool
    graphs: str  # "": none; "recycling": the no-grad recycling passes (GraphedStep); "step": the whole step
    extra_setup_s: float  # Triton JIT of ~30 kernels / graph capture / inductor, cold cache (estimates)

    def needs_cuda(self) -> str | None:
        """Why this configuration cannot run on a CPU (None: it can)."""
        if self.graphs:
            return "needs CUDA: CUDA graphs"
        if self.kernels == "triton":
            return "needs CUDA: the Triton kernels compile for a GPU (the CPU rehearsal runs torch kernels)"
        return None


# inductor's share of "all" and "compile" was 60 s for the four glue chains; the GPU default now also compiles the
# structure module's six geometry chains: 2.9x the cold compile on the CPU (`scalefold bench step --preset tiny
# --compile --compile-only --compile-cache off`, 2-core box under load: four chains 45.8 s, all ten 133.4 s), so 175 s
CONFIGS: dict[str, Config] = {  # in the order of their value: the baseline, the product's figure, the single features
    "eager": Config("torch", False, "", 0.0),
    "all": Config("triton", True, "step", 210.0),  # Triton JIT + inductor + the captures (one eager step each)
    "graphs-step": Config("torch", False, "step", 20.0),  # this round's bar: <= 1.2 s/step on an H100
    "triton": Config("triton", False, "", 25.0),
    "graphs": Config("torch", False, "recycling", 10.0),
    "compile": Config("torch", True, "", 175.0),
}
PRIORITY = tuple(CONFIGS)


def card_key(device_name: str | None) -> str | None:
    """The :data:`scalefold.perf.devices.DEVICES` key of a device name or key (None: unknown card)."""
    spec = device_spec(device_name)
    return next((k for k, v in DEVICES.items() if v is spec), None) if spec is not None else None


def eager_step_s(card: str | None) -> float:
    """The eager MLPerf step's expected seconds on ``card`` (module docstring); an unknown card: the H100 SXM's."""
    spec = DEVICES.get(card or "", DEVICES["h100-sxm"])
    return host_s() + STEP_BYTES / spec.bandwidth + STEP_FLOPS / spec.bf16


def host_s() -> float:
    """The reference step's host-issue / launch-bound seconds (module docstring): what whole-step graphs remove."""
    ref = DEVICES[REFERENCE["card"]]
    return REFERENCE["step_s"] - STEP_BYTES / ref.bandwidth - STEP_FLOPS / ref.bf16


def graphed_step_s(card: str | None, measured_eager_s: float | None = None) -> float:
    """A whole-step-graphed MLPerf step's expected seconds on ``card`` (an estimate): the eager step (``measured_eager_s``
    where this run has it) less its host-issue part, never below the device part ``bytes / bandwidth + FLOPs / peak``."""
    spec = DEVICES.get(card or "", DEVICES["h100-sxm"])
    device = STEP_BYTES / spec.bandwidth + STEP_FLOPS / spec.bf16
    return max(device, (measured_eager_s or eager_step_s(card)) - host_s())


def expected_s(name: str, card: str | None, cycles: int = 1, rehearsal: bool = False,
               measured_step_s: float | None = None, trace: bool = False) -> float:  # fmt: skip
    """Seconds from a configuration's start to its profile's end: the child's start, the build, its own
    set-up, one warm-up and ``cycles`` timed cycles of the recycling counts, the profiled step (and the
    allocator trace with ``trace``). ``measured_step_s``: this run's eager step on this card (wins)."""
    cfg = CONFIGS[name]
    if rehearsal:
        r = REHEARSAL
        step = measured_step_s or r["step_s"]
        extra = r["compile_s"] if cfg.compiled else 0.0
        return r["start_s"] + r["build_s"] + extra + r["recycling"] * (1 + cycles) * step + r["profile_s"]
    step = graphed_step_s(card, measured_step_s) if cfg.graphs == "step" else measured_step_s or eager_step_s(card)
    total = START_S + BUILD_S + cfg.extra_setup_s + 4 * (1 + cycles) * step + PROFILE_STEPS * step + PROFILE_EXPORT_S
    return total + (TRACE_S[0] if trace else 0.0)


def cap_s(expected: float, trace: bool = False, scale: float = 1.0) -> float:
    """A configuration's cap: 1.5x its expected seconds + 15 s (+ the trace's allowance), times ``scale``
    (``SCALEFOLD_HEADLINE_CAP_SCALE``: the CPU rehearsal's generous caps on a busy box)."""
    return scale * (1.5 * expected + 15.0 + (TRACE_S[1] if trace else 0.0))


def start_or_skip(name: str, left: float, expected: float) -> str | None:
    """Why ``name`` is not started with ``left`` seconds to the deadline (None: start it): only when the
    time left, less the reserve for the table, covers its expected seconds."""
    if left - RESERVE_S < expected:
        return f"skipped: expected ~{expected:.0f} s, {max(left - RESERVE_S, 0):.0f} s left before the deadline"
    return None


def plan_lines(card: str | None, configs: list[str], cycles: int, deadline: float, trace: bool) -> tuple[list[str], float]:
    """The configurations in priority order with their expected seconds and caps on ``card``, which of them
    fit ``deadline`` if each takes its expected time; and the expected seconds of the ones that fit."""
    lines, t = [], 0.0
    for i, name in enumerate(n for n in PRIORITY if n in configs):
        traced = trace and i == 0
        exp = expected_s(name, card, cycles, trace=traced)
        why = start_or_skip(name, deadline - t, exp)
        t += 0 if why else exp
        c = CONFIGS[name]
        lines.append(f"  {name:<11} kernels={c.kernels:<6} compile={str(c.compiled):<5} cuda_graphs={c.graphs or 'off':<9} "
                     f"expected ~{exp:>3.0f} s, cap {cap_s(exp, traced):.0f} s"
                     + (f"  -> {why}" if why else f"  (ends ~{t:.0f} s)"))  # fmt: skip
    return lines, t


def window_plan(call_expected_s: float, call_limit_s: float = 600.0, window_s: float = 900.0,
                start_s: float = 120.0, give_back_s: float = 10.0) -> list[str]:  # fmt: skip
    """The device-time plan of a GPU window: the machine's start, the one call, an optional short follow-up on
    the still-warm machine, give-back -- all within ``window_s`` of device time."""
    follow = window_s - start_s - call_limit_s - give_back_s - 30.0  # 30 s: the tool's round trips, idle
    lines = [f"window plan ({window_s / 60:.0f} minutes of device time, every start, call, idle second and close counted):",
             f"  1. machine start                     ~{start_s:.0f} s (1-2 minutes)",
             f"  2. the call: this script             expected ~{call_expected_s:.0f} s, limit {call_limit_s:.0f} s (timeout_s 600)"]  # fmt: skip
    if follow >= 30:
        lines.append(f"  3. optional follow-up on the warm machine, only if the call ended early: <= {follow:.0f} s "
                     f"(e.g. PARTS=probe_attention_grid, ~20 s), then give_back")  # fmt: skip
    else:
        lines.append(f"  3. no follow-up: {max(follow, 0):.0f} s left after a full call")
    lines.append(f"  4. give_back at once                 ~{give_back_s:.0f} s")
    used = start_s + call_expected_s + give_back_s
    lines.append(f"  expected device time {used:.0f} s of {window_s:.0f} s (worst case, the call at its limit: "
                 f"{start_s + call_limit_s + give_back_s:.0f} s)")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card", default="h100", help="h100 | h200 | a devices.py key or device name (default h100)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--cycles", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=465.0)
    ap.add_argument("--trace", action="store_true", help="the first configuration also records the allocator trace")
    ap.add_argument("--window", action="store_true", help="print the device-time plan of a 15-minute window")
    ap.add_argument("--call", type=float, default=560.0, help="--window: the call's expected seconds")
    args = ap.parse_args(argv)
    card = card_key(args.card)
    if card is None:
        print(f"headline_plan: unknown card {args.card!r}; known: {', '.join(DEVICES)} (or h100, h200)", file=sys.stderr)
        return 3
    if args.window:
        print("\n".join(window_plan(args.call)))
        return 0
    lines, total = plan_lines(card, args.configs, args.cycles, args.deadline, args.trace)
    print(f"headline on {DEVICES[card].name}: eager step ~{eager_step_s(card):.2f} s (from {REFERENCE['source']})")
    print("\n".join(lines) + f"\n  total expected ~{total:.0f} s of the {args.deadline:.0f} s deadline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
