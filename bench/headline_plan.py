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
H200 0.86 s -- an ESTIMATE, not measured: this round's bar is <= 1.2 s/step on an H100). Once this run has measured
eager on the card in hand, :func:`expected_s` takes its step time instead (the last measured row wins; for a
graphed configuration: that step less the reference's host part, never below the device part).

A whole-step-graphed configuration's set-up is what its capture code runs (:func:`capture_steps`, read from
``scalefold.compilation``: one source): per recycling count captured, the backend's warm-up iterations
(``CudaGraphBackend().warmup_iters``; the CPU emulation's own on the rehearsal), the recording, and the warm-up
check's ``WHOLE_STEP_CHECKED_STEPS`` eager steps, each an eager step of that count, plus as many replays; then
the row's warm-up cycle (its first step eager: SWA's first copy). A recycling count's step scales with its
kernel launches (:data:`LAUNCHES`). Where the counts 0..R-1 do not fit the time left, the row is reshaped
(:func:`fit_counts`: the counts 0..k-1, the cheapest, one timed cycle), never started to be killed at its cap.
The headline's deadline is what the call leaves it (:func:`call_plan`: every part of ``PARTS=headline``, the
real-capture test and the trainer's whole-step runs included, >= 15 % margin under the call's deadline).

    python bench/headline_plan.py --card h100 [--deadline 465]   # the configurations' expected seconds
    python bench/headline_plan.py --window --card h100 --call 560   # the device-time plan of a 15-minute window
    python bench/headline_plan.py --call-plan --card h100 --deadline 540   # every part of PARTS=headline
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
#: kernel launches of the measured configuration's step with 0..3 no-grad recycling passes, recounted on the GPU's
#: paths (bench/RESULTS.md, "The step-time model refitted"): a count's share of the mean step
LAUNCHES = (70_967, 90_802, 110_637, 130_472)
MARGIN = 0.15  # the call's expected total stays >= 15 % under its deadline
#: the other parts of ``PARTS=headline`` (bench/gpu_session.sh, in its order): (expected s on a GPU, on the CPU
#: rehearsal, where the figure comes from); the headline itself is :func:`plan_lines`' total
CALL_PARTS = {
    "env": (20.0, 6.0, "estimate: nvidia-smi + a cold torch import (ENV_LIMIT 90 s covers a slow first start)"),
    "install": (3.0, 3.0, "estimate: an import check, no wheel to install (the headline needs none)"),
    "capture_real": (90.0, 15.0, "estimate: tests/compilation/test_whole_step_graphs.py -k real, the demo step "
                     "captured fp32, bf16 and with the Parallel Evoformer (CPU: collected and skipped)"),
    "train_step_off": (55.0, 40.0, "estimate: scalefold train --preset demo bf16 --max-steps 8, evaluations at 0/4/8, "
                       "checkpoints at 4/8, PyTorch kernels: start ~12 s, the demo store synthesised ~20 s, build "
                       "~5 s, 3 evaluations, a demo step ~0.5 s (First GPU contact: 30 steps in 14.6 s; that call's "
                       "eager run reached its step-0 evaluation at its 60 s limit, with Triton's compiles); CPU "
                       "(rehearsal, measured 40 s): tiny fp32, 3 steps"),
    "train_step_graphs": (55.0, 55.0, "train_step_off less the store's synthesis (reused) + the capture: per "
                          "recycling count (warm-up + recording + checked) demo eager steps and the checked replays, "
                          "~20 s (CPU rehearsal: measured 52 s)"),
    "train_step_compare": (3.0, 3.0, "bench/train_step_compare.py: two metrics.jsonl and a log"),
    "pack": (5.0, 5.0, "the last packing of $OUT"),
}


@dataclass(frozen=True)
class Config:
    """One way to run the step: kernels, torch.compile, CUDA graphs, and its cold set-up beyond eager's."""

    kernels: str
    compiled: bool
    graphs: str  # "": none; "recycling": the no-grad recycling passes (GraphedStep); "step": the whole step
    extra_setup_s: float  # Triton JIT of ~30 kernels / graph capture / inductor, cold cache (estimates)

    def needs_cuda(self) -> str | None:
        """Why this configuration cannot run on a CPU (None: it can; whole-step graphs: the emulated capture)."""
        if self.graphs == "recycling":
            return "needs CUDA: CUDA graphs of the recycling passes (no CPU emulation)"
        if self.kernels == "triton":
            return "needs CUDA: the Triton kernels compile for a GPU (the CPU rehearsal runs torch kernels)"
        return None


# inductor's share of "all" and "compile" was 60 s for the four glue chains; the GPU default now also compiles the
# structure module's six geometry chains: 2.9x the cold compile on the CPU (`scalefold bench step --preset tiny
# --compile --compile-only --compile-cache off`, 2-core box under load: four chains 45.8 s, all ten 133.4 s), so 175 s
# (the whole-step captures are not in extra_setup_s: capture_steps / expected_s count them from the capture code)
CONFIGS: dict[str, Config] = {  # in the order of their value: the baseline, this round's bar, the product's figure, ...
    "eager": Config("torch", False, "", 0.0),
    "graphs-step": Config("torch", False, "step", 0.0),  # this round's bar: <= 1.2 s/step on an H100
    "all": Config("triton", True, "step", 200.0),  # Triton JIT (25 s) + inductor (175 s), then the captures
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


def capture_steps(emulated: bool = False) -> tuple[int, int]:
    """``(eager steps, replays)`` the whole step's capture runs per recycling count, read from the capture code:
    the backend's warm-up iterations (the default ``warmup_iters`` of the backend the step uses: CUDA's, or the
    CPU emulation's with ``emulated``), the recording (one step's worth of issue), and the warm-up check's
    ``WHOLE_STEP_CHECKED_STEPS`` eager steps; as many replays."""
    import inspect

    from scalefold.compilation.graphed_step import WHOLE_STEP_CHECKED_STEPS

    if emulated:
        from scalefold.compilation.emulated_capture import EmulatedGraphBackend as backend
    else:
        from scalefold.compilation.cuda_graphs import CudaGraphBackend as backend
    warm_up = inspect.signature(backend.__init__).parameters["warmup_iters"].default
    return warm_up + 1 + WHOLE_STEP_CHECKED_STEPS, WHOLE_STEP_CHECKED_STEPS


def count_step_s(mean_s: float, n: int, recycling: int) -> float:
    """Recycling count ``n``'s share of a mean step of ``mean_s`` over counts 0..``recycling``-1, by its kernel
    launches (:data:`LAUNCHES`; extrapolated linearly past the last)."""
    def launches(k: int) -> float:
        step = LAUNCHES[1] - LAUNCHES[0]
        return LAUNCHES[k] if k < len(LAUNCHES) else LAUNCHES[-1] + (k - len(LAUNCHES) + 1) * step

    return mean_s * launches(n) / (sum(launches(k) for k in range(recycling)) / recycling)


def expected_s(name: str, card: str | None, cycles: int = 1, rehearsal: bool = False,
               measured_step_s: float | None = None, trace: bool = False, counts: list[int] | None = None) -> float:  # fmt: skip
    """Seconds from a configuration's start to its profile's end: the child's start, the build, its own
    set-up (whole-step graphs: the capture of each recycling count in ``counts``, :func:`capture_steps`), one
    warm-up and ``cycles`` timed cycles of ``counts`` (default 0..R-1), the profiled step (and the allocator
    trace with ``trace``). ``measured_step_s``: this run's eager step on this card (wins)."""
    cfg = CONFIGS[name]
    recycling = REHEARSAL["recycling"] if rehearsal else 4
    counts = list(range(recycling)) if counts is None else counts
    if rehearsal:  # the CPU: tiny, fp32; the emulated capture replays the same operators
        eager_mean = graphed_mean = measured_step_s or REHEARSAL["step_s"]
        base = REHEARSAL["start_s"] + REHEARSAL["build_s"] + (REHEARSAL["compile_s"] if cfg.compiled else 0.0)
    else:
        eager_mean, graphed_mean = measured_step_s or eager_step_s(card), graphed_step_s(card, measured_step_s)
        base = START_S + BUILD_S + cfg.extra_setup_s

    def eager(n: int) -> float:
        return count_step_s(eager_mean, n, recycling)

    def graphed(n: int) -> float:
        return count_step_s(graphed_mean, n, recycling)

    if cfg.graphs == "step":
        steps, replays = capture_steps(emulated=rehearsal)
        setup = sum(steps * eager(n) + replays * graphed(n) for n in counts)
        warm = eager(counts[0]) + sum(graphed(n) for n in counts[1:])  # its first step: SWA's first copy, eager
        step, profiled = graphed, graphed(0)
    else:
        setup, warm, step, profiled = 0.0, sum(eager(n) for n in counts), eager, eager(0)
    timed = cycles * sum(step(n) for n in counts)
    profile = REHEARSAL["profile_s"] if rehearsal else PROFILE_STEPS * profiled + PROFILE_EXPORT_S
    return base + setup + warm + timed + profile + (TRACE_S[0] if trace and not rehearsal else 0.0)


def fit_counts(name: str, card: str | None, left: float, cycles: int = 1, rehearsal: bool = False,
               measured_step_s: float | None = None, trace: bool = False) -> tuple[list[int] | None, float, str]:  # fmt: skip
    """The recycling counts ``name``'s row runs with ``left`` seconds to the deadline: 0..R-1, or -- a whole-step
    configuration whose captures would not fit -- the counts 0..k-1 for the largest k that fits (reshaped, never
    started to be killed at its cap); ``(counts or None: skipped, expected seconds, why reshaped or skipped)``."""
    recycling = REHEARSAL["recycling"] if rehearsal else 4
    tries = range(recycling, 0, -1) if CONFIGS[name].graphs == "step" else [recycling]
    full = expected_s(name, card, cycles, rehearsal, measured_step_s, trace)
    for k in tries:
        exp = expected_s(name, card, cycles, rehearsal, measured_step_s, trace, counts=list(range(k)))
        if start_or_skip(name, left, exp) is None:
            why = "" if k == recycling else (f"reshaped: recycling counts 0..{k - 1} captured and timed (0..{recycling - 1} "
                                             f"would take ~{full:.0f} s, {max(left - RESERVE_S, 0):.0f} s left)")  # fmt: skip
            return list(range(k)), exp, why
    return None, full, start_or_skip(name, left, full) or ""


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


def plan_lines(card: str | None, configs: list[str], cycles: int, deadline: float, trace: bool,
               rehearsal: bool = False) -> tuple[list[str], float]:  # fmt: skip
    """The configurations in priority order with their expected seconds and caps on ``card`` (or the CPU
    rehearsal), which of them fit ``deadline`` if each takes its expected time (a whole-step one reshaped to
    fewer recycling counts where that fits, :func:`fit_counts`); and the expected seconds of the ones that run."""
    lines, t = [], 0.0
    for i, name in enumerate(n for n in PRIORITY if n in configs):
        c = CONFIGS[name]
        head = (f"  {name:<11} kernels={c.kernels:<6} compile={str(c.compiled):<5} "
                f"cuda_graphs={c.graphs or 'off':<9} ")  # fmt: skip
        why = c.needs_cuda() if rehearsal else None
        if why:
            lines.append(head + f"-> skipped: {why}")
            continue
        traced = trace and i == 0 and not rehearsal
        counts, exp, why = fit_counts(name, card, deadline - t, cycles, rehearsal, trace=traced)
        t += exp if counts is not None else 0.0
        where = (f"  (ends ~{t:.0f} s)" + (f"; {why}" if why else "")) if counts is not None else f"  -> {why}"
        lines.append(head + f"expected ~{exp:>3.0f} s, cap {cap_s(exp, traced):.0f} s" + where)
    return lines, t


def call_plan(card: str | None, deadline: float, rehearsal: bool = False, configs: list[str] | None = None,
              cycles: int = 1) -> tuple[list[str], float, float]:  # fmt: skip
    """Every part of ``PARTS=headline`` (bench/gpu_session.sh) with its expected seconds and where the figure
    comes from; the headline's deadline is what the others leave of ``(1 - MARGIN) x deadline``.
    ``(lines, the headline's deadline, the call's expected total)``."""
    col = 1 if rehearsal else 0
    others = sum(v[col] for v in CALL_PARTS.values())
    headline_deadline = int((1 - MARGIN) * deadline - others)
    body, headline = plan_lines(card, configs or list(CONFIGS), cycles, headline_deadline, trace=True,
                                rehearsal=rehearsal)  # fmt: skip
    where = "the CPU rehearsal" if rehearsal else DEVICES[card or "h100-sxm"].name
    lines = [f"PARTS=headline on {where}: every part of the call, in its order (deadline {deadline:.0f} s):"]
    for name, values in CALL_PARTS.items():
        if name == "train_step_off":  # the headline runs between the real capture and the trainer's runs
            lines.append(f"  {'headline':<18} ~{headline:>4.0f} s  the plan below, within its deadline {headline_deadline} s "
                         "(what the other parts leave of the call's deadline less 15 %)")  # fmt: skip
        lines.append(f"  {name:<18} ~{values[col]:>4.0f} s  {values[2]}")
    total = others + headline
    lines.append(f"  total expected ~{total:.0f} s of the {deadline:.0f} s deadline: margin {100 * (1 - total / deadline):.0f} % "
                 f"(>= {100 * MARGIN:.0f} % wanted)")  # fmt: skip
    steps = (f"a CPU step ~{REHEARSAL['step_s']:.2f} s (REHEARSAL)" if rehearsal else
             f"eager step ~{eager_step_s(card):.2f} s, graphed ~{graphed_step_s(card):.2f} s")  # fmt: skip
    eager_steps, replays = capture_steps(rehearsal)
    lines.append(f"headline plan (deadline {headline_deadline} s; {steps}; the whole step's capture per recycling "
                 f"count: {eager_steps} eager steps + {replays} replays, read from scalefold.compilation):")  # fmt: skip
    return lines + body, headline_deadline, total


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
    ap.add_argument("--call-plan", action="store_true", help="every part of PARTS=headline within --deadline (the "
                    "call's; default 540), the headline's deadline what the others leave less the 15 %% margin")  # fmt: skip
    ap.add_argument("--headline-deadline", action="store_true", help="print only that deadline (bench/gpu_session.sh)")
    ap.add_argument("--bash-expect", action="store_true", help="print the other parts' expected seconds as bash "
                    "assignments EXPECT[part]=s (bench/gpu_session.sh: one source)")  # fmt: skip
    ap.add_argument("--rehearsal", action="store_true", help="the CPU rehearsal's figures (REHEARSE=cpu)")
    args = ap.parse_args(argv)
    card = card_key(args.card)
    if card is None:
        print(f"headline_plan: unknown card {args.card!r}; known: {', '.join(DEVICES)} (or h100, h200)", file=sys.stderr)
        return 3
    if args.window:
        print("\n".join(window_plan(args.call)))
        return 0
    if args.bash_expect:
        print(" ".join(f"EXPECT[{k}]={v[1 if args.rehearsal else 0]:.0f}" for k, v in CALL_PARTS.items()))
        return 0
    if args.call_plan or args.headline_deadline:
        deadline = 540.0 if args.deadline == ap.get_default("deadline") else args.deadline
        lines, headline_deadline, _ = call_plan(card, deadline, args.rehearsal, args.configs, args.cycles)
        print(headline_deadline if args.headline_deadline else "\n".join(lines))
        return 0
    lines, total = plan_lines(card, args.configs, args.cycles, args.deadline, args.trace)
    print(f"headline on {DEVICES[card].name}: eager step ~{eager_step_s(card):.2f} s (from {REFERENCE['source']})")
    print("\n".join(lines) + f"\n  total expected ~{total:.0f} s of the {args.deadline:.0f} s deadline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
