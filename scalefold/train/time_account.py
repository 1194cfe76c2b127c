"""Where a run's seconds went: every second between ``run_start`` and ``run_stop``, and the init before it.

MLPerf scores time to train, not step time. The :class:`TimeAccount` of a training rank is one clock
(``time.perf_counter``) and a timeline of *phases*: each switch from one phase to the next is a single
clock reading that ends one segment and starts the next, so the segments tile the run without gaps
or overlaps and the parts add up to ``run_stop - run_start`` by construction (up to float rounding).
Time in no named phase is ``other``, measured like the rest, not computed as a remainder.

The parts of ``run_start .. run_stop`` (``parts_s`` of ``time_account.json``):

* ``step`` -- the step itself: from the batch in hand to the step's one host read
  (:meth:`~scalefold.train.step.StepResult.read`: on a GPU, the wait for the device);
* ``data_wait`` -- the loader's ``get`` (and, once after ``run_start``, the loader's start-up);
* ``host`` -- host work between steps: after the host read, the step's record, the skip verdict, the
  MLPerf cycle bookkeeping, up to the next ``get``;
* ``compile`` -- compilation and capture inside the timed region (``torch.compile``'s recompilations,
  Triton autotuning), carved out of the steps they happened in (:func:`compile_seconds`);
* ``checkpoint`` -- checkpoint writes;
* ``evaluation`` -- the training ranks on evaluation: the validation cache, each cycle's synchronous
  evaluation or the asynchronous hand-over (host copy, the stop flag's broadcast), the wait for pending
  evaluations at the end (``evaluation`` in ``detail_s``: ``eval_cache``, ``eval_baseline``,
  ``eval_cycle``, ``eval_final``);
* ``to_run_stop`` -- the latency from the end of the step whose evaluation reached the target (else the
  last step) to ``run_stop``, with what the rank did meanwhile (``to_run_stop`` in ``detail_s``);
* ``other`` -- anything else (the dataset split, closing the loader, ...).

Before ``run_start`` (``init_s``, reported apart: MLPerf's init is not timed): the process's start to
:func:`~scalefold.train.trainer.train` (imports, the FLOP count), the distributed set-up, the build
(MLPerf's init block: store, model, starting checkpoint), the warm-up (compilation, CUDA-graph capture,
DDP). After ``run_stop`` (``after_run_stop_s``): what the rank did until the account was written.

With asynchronous evaluation the first evaluation rank logs ``run_stop``; its reply carries the wall
time of it (:func:`scalefold.evaluation.protocol.reply_time`), which :meth:`TimeAccount.run_stop` maps
onto this rank's clock (same node: the same wall clock; across nodes: NTP, as MLPerf's log assumes).
"""

from __future__ import annotations

import json
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: the phases of the timeline, each with the part of the account it belongs to
PHASES: dict[str, str] = {
    "init_process": "init", "init_setup": "init", "init_build": "init", "init_warm_up": "init", "init_other": "init",
    "step": "step", "compile": "compile", "data_wait": "data_wait", "data_setup": "data_wait", "host": "host",
    "checkpoint": "checkpoint", "eval_cache": "evaluation", "eval_baseline": "evaluation", "eval_cycle": "evaluation",
    "eval_final": "evaluation", "close": "other", "report": "other", "other": "other", "after": "after",
}  # fmt: skip
#: the parts of run_start .. run_stop, in the order they are printed and drawn
RUN_PARTS = ("step", "data_wait", "host", "compile", "checkpoint", "evaluation", "to_run_stop", "other")
LABELS = {
    "step": "step (compute)", "data_wait": "data wait", "host": "host work", "compile": "compilation",
    "checkpoint": "checkpoints", "evaluation": "evaluation", "to_run_stop": "to run_stop", "other": "other",
    "init_process": "process start", "init_setup": "set-up", "init_build": "build", "init_warm_up": "warm-up",
    "init_other": "other", "eval_cache": "validation cache", "eval_baseline": "step-0 score", "eval_cycle": "cycles",
    "eval_final": "final wait", "data_setup": "loader start", "close": "closing", "report": "reports", "after": "after run_stop",
}  # fmt: skip
#: what a phase is called in the breakdown of ``to_run_stop``
TO_RUN_STOP_LABELS = {**LABELS, "eval_cycle": "evaluation", "eval_final": "waiting for evaluations",
                      "checkpoint": "checkpoint write", "close": "closing the loader", "step": "steps"}  # fmt: skip
COLORS = {
    "step": "tab:blue", "data_wait": "tab:cyan", "host": "tab:purple", "compile": "tab:olive", "checkpoint": "tab:brown",
    "evaluation": "tab:orange", "to_run_stop": "tab:red", "other": "tab:gray", "init": "lightgray", "after": "white",
}  # fmt: skip
JSON_NAME, PNG_NAME = "time_account.json", "time_account.png"
_NAMES = tuple(PHASES)
_INDEX = {name: i for i, name in enumerate(_NAMES)}


def compile_seconds() -> float:
    """Seconds this process spent compiling so far: ``torch.compile`` (dynamo's frame and backward
    compiles, inductor included) and Triton autotuning (:func:`scalefold.kernels.autotune.tuning_seconds`).
    Read before and after a step, the difference is the compilation inside it. Neither module is
    imported here (importing dynamo takes seconds): one that was never imported compiled nothing."""
    total = 0.0
    dynamo = sys.modules.get("torch._dynamo.utils")
    spent = getattr(dynamo, "cumulative_time_spent_ns", None)  # absent in a torch without the counters
    if spent is not None:
        total += (spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)) / 1e9
    autotune = sys.modules.get("scalefold.kernels.autotune")
    if autotune is not None:
        total += autotune.tuning_seconds()
    return total


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat`` against ``CLOCK_BOOTTIME``, 10 ms
    resolution); ``None`` where that is not known."""
    import os

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class TimeAccount:
    """One rank's timeline of phases (see the module docstring); :meth:`report` sums it up.

    Created at :func:`~scalefold.train.trainer.train`'s entry (phase ``init_setup``; the time since the
    process started is counted as ``init_process``). ``clock`` and ``probe`` (:func:`compile_seconds`)
    are parameters so that a test can drive the account with readings of its own."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, probe: Callable[[], float] = compile_seconds,
                 process_age: float | None = None) -> None:  # fmt: skip
        self.clock, self.probe = clock, probe
        self._phases, self._times = array("B"), array("d")
        self.current = ""
        t0 = self.switch("init_setup")
        age = process_age_s() if process_age is None else process_age
        self.process_s = age  # before train(): imports, argument parsing, the FLOP count
        self.t_run_start: float | None = None
        self.t_run_stop: float | None = None
        self.wall_run_start: float | None = None
        self.t_first = t0
        self.last_step: tuple[int, float] | None = None  # (step, end of its host read)
        self.step_ends: dict[int, float] = {}  # evaluated steps -> the end of their host read
        self.target_step: int | None = None
        self.steps = 0
        self.run_stop_source = "training rank"
        self._compile_before = 0.0

    # -- the timeline ------------------------------------------------------------------------------

    def switch(self, phase: str, at: float | None = None) -> float:
        """End the current phase and start ``phase`` now (one reading; ``at``: a reading already taken)."""
        t = self.clock() if at is None else at
        self._phases.append(_INDEX[phase])
        self._times.append(t)
        self.current = phase
        return t

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``name`` for the duration of the block, then back to the phase before it."""
        before = self.current
        self.switch(name)
        try:
            yield
        finally:
            self.switch(before)

    def run_start(self) -> float:
        """``run_start`` was logged: the timed region begins (phase ``other`` until the loop's first)."""
        self.wall_run_start = time.time()
        self.t_run_start = self.switch("other")
        return self.t_run_start

    def step_started(self) -> float:
        """The batch is in hand, the step begins (returns the reading)."""
        self._compile_before = self.probe()
        return self.switch("step")

    def step_read(self, step: int) -> float:
        """The step's one host read returned: the step ends, host work begins. Compilation that happened
        inside the step (the probe's difference) is cut from the step's end and counted as ``compile``."""
        t = self.clock()
        start = self._times[-1]
        compiled = min(max(self.probe() - self._compile_before, 0.0), t - start)
        if compiled > 0:
            self.switch("compile", at=t - compiled)
        self.switch("host", at=t)
        self.last_step = (step, t)
        self.steps += 1
        return t

    def evaluated(self, step: int) -> None:
        """``step``'s weights go to evaluation (a train-eval cycle ends): remember where the step ended."""
        if self.last_step is not None and self.last_step[0] == step:
            self.step_ends[step] = self.last_step[1]

    def run_stop(self, target_step: int | None = None, wall: float | None = None) -> None:
        """``run_stop`` was logged (now, or at wall time ``wall`` by another process: the first evaluation
        rank); ``target_step``: the step whose evaluation reached the target. The first call counts."""
        if self.t_run_stop is not None or self.t_run_start is None:
            return
        if wall is not None and self.wall_run_start is not None:  # this rank goes on until it learns of it
            self.t_run_stop = self.t_run_start + (wall - self.wall_run_start)
            self.run_stop_source = "first evaluation rank"
        else:
            self.t_run_stop = self.switch("after")
        self.target_step = target_step

    # -- the sums ----------------------------------------------------------------------------------

    def segments(self, end: float) -> Iterator[tuple[str, float, float]]:
        """``(phase, start, stop)`` of every segment, the last one ending at ``end``."""
        times = list(self._times) + [end]
        for i, p in enumerate(self._phases):
            yield _NAMES[p], times[i], max(times[i + 1], times[i])

    def report(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The account as a JSON-ready dict (see :func:`summarise`), read now."""
        end = self.clock()
        cut = self._cut_point()
        info = summarise(list(self.segments(end)), self.t_first, self.t_run_start, self.t_run_stop, cut, end)
        info["init_s"]["parts"]["init_process"] = self.process_s
        info["init_s"]["since_process_start"] = None if self.process_s is None else info["init_s"]["total"] + self.process_s
        info["steps"] = self.steps
        info["run_stop_logged_by"] = self.run_stop_source
        info["to_run_stop_from"] = self._cut_label()
        info.update(extra or {})
        return info

    def _cut_point(self) -> float | None:
        if self.target_step is not None and self.target_step in self.step_ends:
            return self.step_ends[self.target_step]
        if self.last_step is not None and (self.t_run_stop is None or self.last_step[1] <= self.t_run_stop):
            return self.last_step[1]
        return None

    def _cut_label(self) -> str:
        if self.target_step is not None and self.target_step in self.step_ends:
            return f"the end of step {self.target_step}, whose evaluation reached the target"
        if self.last_step is not None:
            return f"the end of step {self.last_step[0]}, the last step"
        return "run_start (no step was taken)"


def summarise(segments: list[tuple[str, float, float]], t_first: float, t_start: float | None, t_stop: float | None,
              t_cut: float | None, end: float) -> dict[str, Any]:  # fmt: skip
    """Sum ``segments`` (``(phase, start, stop)``, tiling ``t_first .. end``) into the windows
    ``init`` (before ``t_start``), the run (``t_start .. t_cut``: by part), ``to_run_stop`` (``t_cut ..
    t_stop``: by phase) and ``after`` (from ``t_stop``). A run without ``run_stop`` is counted to ``end``."""
    t_start = end if t_start is None else t_start
    stop = end if t_stop is None else t_stop
    cut = stop if t_cut is None else min(max(t_cut, t_start), stop)
    windows = {"init": (t_first, t_start), "run": (t_start, cut), "to_run_stop": (cut, stop), "after": (stop, end)}
    sums: dict[str, dict[str, float]] = {w: {} for w in windows}
    for phase, a, b in segments:
        for w, (lo, hi) in windows.items():
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                sums[w][phase] = sums[w].get(phase, 0.0) + overlap
    parts = dict.fromkeys(RUN_PARTS, 0.0)
    for phase, seconds in sums["run"].items():
        parts[PHASES[phase] if PHASES[phase] in parts else "other"] += seconds
    parts["to_run_stop"] = sum(sums["to_run_stop"].values())
    detail = {"evaluation": {k: v for k, v in sums["run"].items() if PHASES[k] == "evaluation"},
              "data_wait": {k: v for k, v in sums["run"].items() if PHASES[k] == "data_wait"},
              "to_run_stop": sums["to_run_stop"]}  # fmt: skip
    return {
        "clock": "time.perf_counter of the main training rank; every part is a sum of segments between its readings",
        "run_start_to_run_stop_s": stop - t_start, "run_stop_logged": t_stop is not None,
        "parts_s": parts, "sum_of_parts_s": sum(parts.values()), "detail_s": detail,
        "init_s": {"total": t_start - t_first, "parts": sums["init"]},
        "after_run_stop_s": {"total": end - stop, "parts": sums["after"]},
        "to_run_stop_at_s": cut - t_start,  # seconds since run_start where to_run_stop begins
        "timeline": _timeline(segments, t_start, end),
    }  # fmt: skip


def _timeline(segments: list[tuple[str, float, float]], t_start: float, end: float, limit: int = 3000) -> list[list]:
    """``[part, start, seconds]`` since run_start, neighbours of one part merged. Beyond ``limit`` entries
    (a long run) the run is drawn in ``limit`` equal bins, each of the part that took most of it: the
    picture of a long run, not its record (the parts are)."""
    merged: list[list] = []
    for phase, a, b in segments:
        part = PHASES[phase]
        if merged and merged[-1][0] == part:
            merged[-1][2] = b - t_start - merged[-1][1]
        else:
            merged.append([part, a - t_start, b - a])
    if len(merged) > limit:
        width = (end - t_start) / limit
        bins = [dict() for _ in range(limit)]
        for part, a, s in merged:
            if a < 0:
                continue
            i = min(int(a / width), limit - 1)
            bins[i][part] = bins[i].get(part, 0.0) + s
        merged = [[max(b, key=b.get), i * width, width] for i, b in enumerate(bins) if b]
    return [[p, round(a, 6), round(s, 6)] for p, a, s in merged if a + s > 0]


def summary_lines(info: dict[str, Any], where: str | None = None) -> list[str]:
    """The account in a few lines (the last lines of ``scalefold train``'s output)."""
    total, parts, detail = info["run_start_to_run_stop_s"], info["parts_s"], info["detail_s"]
    steps = max(info.get("steps", 0), 1)
    head = f"time account: run_start -> run_stop {total:.1f} s" + (f" ({where})" if where else "")
    lines = [head + ":"]

    def row(key: str, seconds: float, note: str = "") -> str:
        share = 100 * seconds / total if total > 0 else 0.0
        return f"  {LABELS.get(key, key):<16s}{seconds:8.2f} s {share:5.1f} %" + (f"  {note}" if note else "")

    lines.append(row("step", parts["step"], f"{info.get('steps', 0)} steps, {1000 * parts['step'] / steps:.0f} ms each"))
    for key in RUN_PARTS[1:]:
        if key == "to_run_stop":
            what = ", ".join(f"{TO_RUN_STOP_LABELS[k]} {v:.2f} s" for k, v in _largest(detail["to_run_stop"]))
            lines.append(row(key, parts[key], f"from {info['to_run_stop_from']}" + (f": {what}" if what else "")))
        elif key == "evaluation" and detail["evaluation"]:
            lines.append(row(key, parts[key], ", ".join(f"{LABELS[k]} {v:.2f} s" for k, v in _largest(detail["evaluation"]))))
        else:
            lines.append(row(key, parts[key]))
    init = info["init_s"]
    since = init.get("since_process_start")
    order = ("init_process", "init_setup", "init_build", "init_warm_up", "init_other")
    init_parts = ", ".join(f"{LABELS[k]} {init['parts'][k]:.1f} s" for k in order if init["parts"].get(k))
    lines.append(f"  init (before run_start, untimed): {init['total'] if since is None else since:.1f} s ({init_parts})")
    return lines


def _largest(parts: dict[str, float], n: int = 4) -> list[tuple[str, float]]:
    return sorted(((k, v) for k, v in parts.items() if v > 0.0005), key=lambda kv: -kv[1])[:n]


def write_account(info: dict[str, Any], out: Path) -> tuple[Path, Path | None]:
    """``time_account.json`` and ``time_account.png`` in ``out``; a picture that fails costs one line."""
    out = Path(out)
    path = out / JSON_NAME
    path.write_text(json.dumps(info, indent=1) + "\n")
    try:
        png = draw_account(info, out / PNG_NAME)
    except Exception as exc:  # noqa: BLE001 -- the JSON is the record; the picture never fails a run
        print(f"scalefold train: could not draw {out / PNG_NAME}: {type(exc).__name__}: {exc}", flush=True)
        png = None
    return path, png


def draw_account(info: dict[str, Any], png: Path) -> Path:
    """Two panels: the stacked bar of init, the run's parts and the time after run_stop; the run's
    timeline (seconds since run_start), each segment coloured by its part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bar, ax_line) = plt.subplots(2, 1, figsize=(11, 4.6), gridspec_kw={"height_ratios": [1.2, 1]})
    total = info["run_start_to_run_stop_s"]
    init = info["init_s"].get("since_process_start") or info["init_s"]["total"]
    ax_bar.barh(0, init, left=-init, color=COLORS["init"], edgecolor="k", lw=0.3,
                label=f"init (untimed) {init:.1f} s")  # fmt: skip
    x = 0.0
    for key in RUN_PARTS:
        seconds = info["parts_s"][key]
        if seconds > 0:
            share = 100 * seconds / total if total > 0 else 0.0
            ax_bar.barh(0, seconds, left=x, color=COLORS[key], edgecolor="k", lw=0.3,
                        label=f"{LABELS[key]} {seconds:.1f} s ({share:.1f} %)")  # fmt: skip
            x += seconds
    after = info["after_run_stop_s"]["total"]
    ax_bar.barh(0, after, left=x, color=COLORS["after"], edgecolor="k", lw=0.3, hatch="//",
                label=f"after run_stop {after:.1f} s")  # fmt: skip
    ax_bar.axvline(0, color="k", lw=1)
    ax_bar.axvline(total, color="k", lw=1)
    ax_bar.set_yticks([])
    ax_bar.set_title(f"run_start -> run_stop: {total:.1f} s ({info.get('steps', 0)} steps)", fontsize=10)
    ax_bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=7, frameon=False)
    for part in COLORS:
        spans = [(a, s) for p, a, s in info["timeline"] if p == part and 0 <= a < total + after]
        if spans and part not in ("init", "after"):
            ax_line.broken_barh(spans, (0, 1), facecolors=COLORS[part], lw=0)
    cut = info.get("to_run_stop_at_s")
    if cut is not None and info["parts_s"]["to_run_stop"] > 0:
        ax_line.axvspan(cut, total, ymin=0, ymax=1 / 1.3, fill=False, hatch="xx", edgecolor=COLORS["to_run_stop"], lw=0)
        ax_line.axvline(cut, color=COLORS["to_run_stop"], lw=1.5)
        ax_line.text(cut, 1.05, f" {info.get('to_run_stop_from', '')} -> run_stop", color=COLORS["to_run_stop"],
                     fontsize=7, ha="right" if cut > total / 2 else "left", va="bottom")  # fmt: skip
    ax_line.set_xlim(0, max(total, 1e-3))
    ax_line.set_ylim(0, 1.3)
    ax_line.set_yticks([])
    ax_line.set_xlabel("seconds since run_start")
    fig.suptitle(f"where the seconds went{': ' + info['title'] if info.get('title') else ''}", fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)


__all__ = ["JSON_NAME", "PHASES", "PNG_NAME", "RUN_PARTS", "TimeAccount", "compile_seconds", "draw_account",
           "process_age_s", "summarise", "summary_lines", "write_account"]  # fmt: skip
