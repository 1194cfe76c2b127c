"""Progress a cluster log can hold: plain lines at a modest rate when standard error is not a
terminal (a Slurm job's log file), tqdm's bar on a terminal; the MLPerf log unaffected."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from scalefold.train.plain_progress import PlainProgress, format_duration
from scalefold.train.reporting import progress_bar

ROOT = Path(__file__).resolve().parents[2]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run_steps(progress: PlainProgress, clock: _Clock, steps: int, seconds_per_step: float) -> None:
    for step in range(steps):
        clock.now += seconds_per_step
        progress.update(1)
        progress.set_postfix(loss=f"{10.0 - step / 100:.3f}", recycling=1)


def test_lines_at_the_first_step_every_interval_and_the_last():
    """100 one-second steps with a 30 s interval: 5 lines (steps 1, 31, 61, 91, 100), each with the step,
    the loss the loop reported for it, the step time and the ETA -- no carriage return."""
    out, clock = io.StringIO(), _Clock()
    progress = PlainProgress(100, stream=out, interval_s=30.0, clock=clock)
    _run_steps(progress, clock, 100, 1.0)
    progress.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split()[2] for ln in lines] == ["1/100", "31/100", "61/100", "91/100", "100/100"]
    assert lines[0] == "train: step 1/100 (1 %)  loss 10.000"
    assert lines[1] == "train: step 31/100 (31 %)  loss 9.700  1.00 s/step  elapsed 30s  ETA 1m09s"
    assert lines[-1].endswith("loss 9.010  1.00 s/step  elapsed 1m39s  ETA 0s")


def test_close_writes_the_step_a_run_stopped_at_and_resumed_runs_count_from_their_start():
    """A run stopped early (target reached, signal) ends with its last step's line; a resumed run
    starts at its checkpoint's step."""
    out, clock = io.StringIO(), _Clock()
    progress = PlainProgress(1000, initial=400, stream=out, interval_s=30.0, clock=clock)
    _run_steps(progress, clock, 10, 2.0)
    progress.write("step 410: eval lDDT-Cα 0.5")  # to stdout, as tqdm.write
    progress.set_description("evaluating step 410 (SWA weights)")
    progress.close()
    progress.close()
    lines = out.getvalue().splitlines()
    assert [ln.split()[2] for ln in lines] == ["401/1000", "410/1000"]
    assert "2.00 s/step" in lines[1] and f"ETA {format_duration(590 * 2.0)}" in lines[1]


def test_format_duration():
    assert [format_duration(s) for s in (0, 9.4, 61, 3599, 7500)] == ["0s", "9s", "1m01s", "59m59s", "2h05m"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_lines_elsewhere(monkeypatch):
    """The choice follows standard error: a terminal gets tqdm's bar, a file plain lines; disabled
    progress stays silent either way."""
    from tqdm import tqdm

    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = progress_bar(10, 0, enabled=True)
    assert isinstance(bar, tqdm)
    bar.close()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(progress_bar(10, 0, enabled=True), PlainProgress)
    assert isinstance(progress_bar(10, 0, enabled=False), tqdm)


def test_train_log_written_to_a_file_has_progress_lines_and_no_carriage_returns(tmp_path):
    """``scalefold train --preset tiny`` (progress on) with stdout and stderr to a file, as a Slurm job
    writes them: progress lines for the first and the last step, no '\\r'; the MLPerf log holds its
    own records only."""
    env = {**os.environ, "SCALEFOLD_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    log = tmp_path / "slurm-1.out"
    with log.open("wb") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "scalefold", "train", "--preset", "tiny", "--out", str(tmp_path / "run"),
             "--max-steps", "4"],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path, timeout=600,
        )  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text
    steps = [ln.split()[2] for ln in text.splitlines() if ln.startswith("train: step ")]
    assert steps[0] == "1/4" and steps[-1] == "4/4", text
    assert "loss " in text.split("train: step 4/4", 1)[1].splitlines()[0]
    mlperf = (tmp_path / "run" / "mlperf.log").read_text()
    assert "train: step" not in mlperf and '"key": "run_stop"' in mlperf
