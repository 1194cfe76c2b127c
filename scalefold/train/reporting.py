"""What a training run tells its user: ``metrics.jsonl``, console lines, the end-of-run summary.

Kept apart from the loop so that the :class:`~scalefold.train.trainer.Trainer` only says *what*
happened (a step's record, an evaluation, a skipped sample) and this module decides how it is
written: strict JSON lines on the main training rank, one atomic ``write`` per console line (ranks
share the launcher's pipe), the step-time breakdown and ``curves.png`` at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalefold.diskspace import LineAppender, atomic_output, describe_free, write_failure
from scalefold.mlperf import logger as mll
from scalefold.train.curves import plot_metrics


def announce(line: str) -> None:
    """Print ``line`` with one ``write`` of the whole line (newline included), flushed at once.

    Ranks share the launcher's stdout pipe; ``print`` may issue the text and the newline as separate
    writes, so two ranks' lines could interleave. A single write of at most ``PIPE_BUF`` bytes to a
    pipe is atomic (POSIX), so each rank's line arrives whole.
    """
    stream = sys.stdout
    stream.flush()  # anything buffered before goes out first, on its own
    data = (line + "\n").encode(getattr(stream, "encoding", None) or "utf-8", errors="replace")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stdout without a descriptor (e.g. captured)
        stream.write(line + "\n")
        stream.flush()
        return
    while data:  # a pipe write of <= PIPE_BUF bytes is never partial; longer lines are written in pieces
        data = data[os.write(fd, data) :]


@dataclass
class TrainResult:
    out: Path | None  # None on ranks that write nothing
    steps: int  # the last step taken (counted from the start of training, resumed runs included)
    final_loss: float
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    stopped_by_signal: int | None = None
    status: str = mll.STATUS_ABORTED
    timings: dict[str, float] = field(default_factory=dict)
    # samples this rank's loader gave up on (and replaced): chain_id, reason, ... (loader ranks only)
    skipped_samples: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # extra end-of-run lines (e.g. the CUDA-graph summary)
    start_step: int = 0  # the step this process started from (a resumed run's checkpoint)
    time_to_train_s: float | None = None  # run_start to run_stop, summed over resumed segments
    throughput: list[tuple[float, float | None]] = field(default_factory=list)  # (tflops, mfu) of each step
    device_name: str | None = None  # the GPU the mfu figures refer to
    time_account: list[str] = field(default_factory=list)  # the time account's summary (time_account.json)
    unsaved_checkpoint: str | None = None  # why the run's last due checkpoint is missing (a full disk), if it is


class MetricsLog:
    """``metrics.jsonl`` of the main training rank (other ranks: no-op).

    Written through a :class:`~scalefold.diskspace.LineAppender`: a full file system costs one line (the
    path and the free space), the records wait in memory and are written, in order, once there is space;
    the file always ends with a whole record. Records still unwritten when the run ends are named in one
    line by :meth:`close`."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self._file = LineAppender(path, label=str(path)) if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:  # strict JSON: NaN / inf (a skipped step's loss) are written as null
            self._file.append(json.dumps(_json_safe(record), allow_nan=False))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def write_first(self, record: dict[str, Any]) -> None:
        """``record`` before every other line (the starting point's score, taken after the run: the file
        stays in step order); the file is rewritten (atomic replace) and appended to afterwards."""
        if self._file is None:
            return
        self._file.close()
        old = self.path.read_text() if self.path.exists() else ""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(_json_safe(record), allow_nan=False) + "\n" + old)
        tmp.replace(self.path)
        self._file = self.path.open("a")

    def close(self) -> None:
        if self._file is not None:
            left = self._file.close()
            self._file = None
            if left:
                steps = [json.loads(line).get("step") for line in left]
                print(f"scalefold train: {len(left)} record(s) of steps {steps[0]}-{steps[-1]} could not be written "
                      f"to {self.path} ({describe_free(self.path)}); --resume re-runs the steps after the newest "
                      "checkpoint", file=sys.stderr, flush=True)  # fmt: skip


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON ``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (written after the checkpoint a resumed run restarts from), and a
    torn last line, if any (a writer killed in the middle of a line); replaced atomically."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # the torn end of a killed writer
            raise
        if record["step"] <= last_step:
            kept.append(line)
    with atomic_output(path) as tmp:
        tmp.write_text("".join(ln + "\n" for ln in kept))


def progress_bar(total: int, start: int, enabled: bool):
    """tqdm's bar on a terminal; plain lines at a modest rate when standard error is a file or pipe (a
    Slurm job's log), not one carriage-return update per step (``scalefold.train.plain_progress``)."""
    from tqdm import tqdm

    from scalefold.train.plain_progress import PlainProgress, is_terminal

    if enabled and not is_terminal(sys.stderr):
        return PlainProgress(total, start)
    return tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)


BREAKDOWN_KEYS = ("data_wait", "forward", "backward", "optimizer", "eval", "checkpoint")


def print_breakdown(result: TrainResult, file: Any = None) -> None:
    """Step-time breakdown (data wait, forward, backward, optimizer, eval, checkpoint): seconds, share of
    the total, milliseconds per step; then the evaluation history."""
    ran = result.steps - result.start_step  # the steps this process took (timings cover only these)
    steps = max(ran, 1)
    timings = {k: result.timings.get(k, 0.0) for k in BREAKDOWN_KEYS}
    timings.update({k: v for k, v in result.timings.items() if k not in timings})
    total = sum(timings.values())
    resumed = f", steps {result.start_step + 1}-{result.steps} after resuming" if result.start_step else ""
    lines = [f"step-time breakdown over {ran} step{'s' if ran != 1 else ''}{resumed} ({result.skipped_steps} skipped):"]
    for key, seconds in timings.items():
        share = 100 * seconds / total if total > 0 else 0.0
        lines.append(f"  {key:<11s} {seconds:8.2f} s  {share:5.1f} %  {1000 * seconds / steps:9.1f} ms/step")
    lines.append(f"  {'total':<11s} {total:8.2f} s  100.0 %  {1000 * total / steps:9.1f} ms/step")
    if result.skipped_samples:  # data the loader gave up on (each replaced: the step still happened)
        lines.append(f"data: {len(result.skipped_samples)} sample(s) skipped and replaced: " + ", ".join(
            f"{s['chain_id']} ({s['reason']})" for s in result.skipped_samples))  # fmt: skip
    lines.extend(result.notes)
    if result.throughput:
        lines.append(throughput_line(result))
    if result.eval_history:
        lines.append("eval lDDT-Cα: " + ", ".join(f"step {s}: {v:.4f}" for s, v in result.eval_history))
    print("\n".join(lines), file=file, flush=True)


def throughput_line(result: TrainResult) -> str:
    """The median step's TFLOP/s per rank and, where the device's peak is known, its MFU."""
    import statistics

    tflops = statistics.median(t for t, _ in result.throughput)
    mfus = [m for _, m in result.throughput if m is not None]
    line = f"step throughput: {tflops:.4g} TFLOP/s per rank (median of {len(result.throughput)} steps, executed FLOPs"
    if mfus:
        line += f"); MFU {100 * statistics.median(mfus):.2f} % of the {result.device_name or 'device'}'s dense peak"
    else:
        line += "; MFU: the device's peak is not known"
    return line + ("" if mfus else ")")


def final_report(preset: str, out: Path, metrics_path: Path, result: TrainResult, target: float | None = None,
                 start_label: str = "untrained model") -> None:  # fmt: skip
    """``curves.png`` (with the ``target`` line and the starting point) and the step-time breakdown (main
    training rank; also after an abort, where a failure to plot is reported and never hides the abort's
    own error)."""
    try:
        if metrics_path.exists():
            plot_metrics(metrics_path, out / "curves.png", title=f"scalefold train --preset {preset}",
                         target=target, start_label=start_label)  # fmt: skip
    except OSError as exc:  # a full disk: curves.png keeps its previous picture (written atomically)
        print(f"scalefold train: curves not written to {out / 'curves.png'}: {write_failure(out, exc)}", flush=True)
    except Exception as exc:  # noqa: BLE001 -- the breakdown still follows
        print(f"scalefold train: could not plot {metrics_path}: {type(exc).__name__}: {exc}", flush=True)
    print_breakdown(result)


def time_to_train_line(clock: Any, result: TrainResult) -> str:
    """MLPerf's time to train (``run_start`` to ``run_stop``, summed over the segments of a resumed run:
    ``clock`` is the run's :class:`~scalefold.mlperf.clock.RunClock`) with the status and the lDDT-Cα before/after."""
    line = f"time to train: {clock.total_s():.1f} s (run_start to run_stop"
    if clock.segments_before:
        line += (f", {clock.segments_before + 1} segments: {clock.before_s:.1f} s up to the checkpoint of step "
                 f"{clock.resumed_step} + {clock.segment_s():.1f} s after resuming")  # fmt: skip
    line += f", status {result.status}"
    if result.eval_history:
        first, last = result.eval_history[0], result.eval_history[-1]
        line += f"; eval lDDT-Cα {first[1]:.4f} at step {first[0]} -> {last[1]:.4f} at step {last[0]}"
    return line + ")"


def print_run_files(out: Path, store: str, file: Any = None) -> None:
    """Where the run's outputs are, and the commands that use them next."""
    out = Path(out)
    ckpts = sorted((out / "checkpoints").glob("checkpoint_*.pt"))
    logs = sorted(out.glob("mlperf*.log"))
    lines = [f"run directory: {out}"]
    for label, path in (("curves", out / "curves.png"), ("Cα trace", out / "trace.png"),
                        ("metrics", out / "metrics.jsonl"), ("time account", out / "time_account.png")):  # fmt: skip
        if path.exists():
            lines.append(f"  {label + ':':<12s} {path}")
    if logs:
        lines.append(f"  {'MLPerf log:':<12s} {', '.join(str(p) for p in logs)}")
    if ckpts:
        lines.append(f"  {'checkpoints:':<12s} {out / 'checkpoints'} (newest: {ckpts[-1].name})")
        lines.append("next:")
        lines.append(f"  scalefold evaluate --store {store} --checkpoint {ckpts[-1]}")
        lines.append(f"  scalefold predict --fasta FASTA [--a3m A3M] --checkpoint {ckpts[-1]} --out PRED.pdb")
    print("\n".join(lines), file=file, flush=True)


__all__ = [
    "BREAKDOWN_KEYS", "MetricsLog", "TrainResult", "announce", "final_report", "print_breakdown", "print_run_files", "time_to_train_line",
    "progress_bar", "truncate_metrics",
]  # fmt: skip
