"""Every run accounts for its time (issue 41, item 1): ``time_account.json`` / ``.png`` and the summary.

The account's sums are checked against readings of the same clock (never against how fast this
machine is): first with a clock the test drives itself (exact, binary-fraction seconds), then on real
runs of the ``tiny`` preset, where the parts must add up to the recorded ``run_start -> run_stop``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from scalefold.cli import main
from scalefold.train.time_account import RUN_PARTS, TimeAccount, summary_lines

#: float rounding of a sum of a few hundred segments (the readings are exact binary fractions here)
EXACT = 1e-9


class Clock:
    """A clock the test advances: ``tick(s)``."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.compiled = 0.0  # the compile probe's running total

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float) -> None:
        self.t += seconds


def _account(clock: Clock) -> TimeAccount:
    """An account through an init of 0.5 + 3 + 1 + 0.25 s (2 s before train()), then run_start."""
    account = TimeAccount(clock=clock, probe=lambda: clock.compiled, process_age=2.0)
    for phase, seconds in (("init_build", 0.5), ("init_warm_up", 3.0), ("init_other", 1.0), ("", 0.25)):
        clock.tick(seconds)  # the phase before ``phase`` took ``seconds``
        if phase:
            account.switch(phase)
    account.run_start()
    clock.tick(0.125)  # "other": the dataset split
    with account.phase("data_setup"):
        clock.tick(0.5)
    with account.phase("eval_cache"):
        clock.tick(1.0)
    return account


def _steps(account: TimeAccount, clock: Clock, steps: range, eval_every: int, stop_at: int | None = None) -> None:
    """The loop's hooks as the Trainer calls them: data wait 1/16, host 1/32 before and 1/64 after the
    step (1 s, of which 1/4 s compiling at step 1), evaluation 2 s every ``eval_every`` steps."""
    for step in steps:
        account.switch("data_wait")
        clock.tick(0.0625)
        account.switch("host")
        clock.tick(0.03125)
        account.step_started()
        clock.tick(1.0)
        if step == 1:
            clock.compiled += 0.25
        account.step_read(step)
        clock.tick(0.015625)
        if step % eval_every == 0:
            account.evaluated(step)
            account.switch("eval_cycle")
            clock.tick(2.0)
            if step == stop_at:
                account.run_stop(target_step=step)
            account.switch("host")


def test_parts_of_a_run_that_reaches_its_target_add_up_exactly():
    """4 steps, evaluations at 2 and 4 (the target): every part is what the hooks timed, the parts add up to
    run_start -> run_stop, the latency runs from step 4's host read to run_stop, and what follows run_stop
    (the checkpoint, closing) is counted after it, not in the time to train."""
    clock = Clock()
    account = _account(clock)
    _steps(account, clock, range(1, 5), eval_every=2, stop_at=4)
    with account.phase("checkpoint"):  # after run_stop: untimed
        clock.tick(0.5)
    account.switch("close")
    clock.tick(0.25)
    info = account.report()
    parts = info["parts_s"]
    assert list(parts) == list(RUN_PARTS)
    expected = {"step": 3.75, "compile": 0.25, "data_wait": 4 * 0.0625 + 0.5, "host": 4 * 0.03125 + 3 * 0.015625,
                "checkpoint": 0.0, "evaluation": 1.0 + 2.0, "to_run_stop": 0.015625 + 2.0, "other": 0.125}  # fmt: skip
    assert parts == pytest.approx(expected, abs=EXACT)
    assert info["sum_of_parts_s"] == pytest.approx(info["run_start_to_run_stop_s"], abs=EXACT)
    assert info["run_start_to_run_stop_s"] == pytest.approx(sum(expected.values()), abs=EXACT)
    assert info["detail_s"]["to_run_stop"] == pytest.approx({"host": 0.015625, "eval_cycle": 2.0}, abs=EXACT)
    assert info["detail_s"]["evaluation"] == pytest.approx({"eval_cache": 1.0, "eval_cycle": 2.0}, abs=EXACT)
    assert info["to_run_stop_from"] == "the end of step 4, whose evaluation reached the target"
    after = {k: v for k, v in info["after_run_stop_s"]["parts"].items() if v}
    assert after == pytest.approx({"checkpoint": 0.5, "close": 0.25}, abs=EXACT)
    assert info["init_s"]["parts"] == pytest.approx({"init_setup": 0.5, "init_build": 3.0, "init_warm_up": 1.0,
                                                     "init_other": 0.25, "init_process": 2.0}, abs=EXACT)  # fmt: skip
    assert info["init_s"]["since_process_start"] == pytest.approx(6.75, abs=EXACT)
    assert info["steps"] == 4 and info["run_stop_logged_by"] == "training rank"


def test_a_run_stop_logged_by_the_evaluation_rank_cuts_the_timeline_at_its_wall_time():
    """Asynchronous evaluation: the weights of step 2 reached the target, the evaluation rank logged
    run_stop 1.5 s into step 4 (its reply's wall time), training learnt of it at step 6. The run ends
    there on this rank's clock: step 2's end -> run_stop is the latency, steps 4.5..6 come after it."""
    clock = Clock()
    account = _account(clock)
    _steps(account, clock, range(1, 7), eval_every=2)
    t_step2_end = account.step_ends[2]
    t_run_stop = t_step2_end + 0.015625 + 2.0 + 0.0625 + 0.03125 + 1.0 + 0.015625 + 0.5  # half-way into cycle 4
    account.run_stop(target_step=2, wall=account.wall_run_start + (t_run_stop - account.t_run_start))
    info = account.report()
    assert info["run_start_to_run_stop_s"] == pytest.approx(t_run_stop - account.t_run_start, abs=1e-6)
    assert info["parts_s"]["to_run_stop"] == pytest.approx(t_run_stop - t_step2_end, abs=1e-6)
    assert info["sum_of_parts_s"] == pytest.approx(info["run_start_to_run_stop_s"], abs=EXACT)
    assert info["to_run_stop_from"] == "the end of step 2, whose evaluation reached the target"
    assert info["run_stop_logged_by"] == "first evaluation rank"
    after = info["after_run_stop_s"]
    assert after["total"] == pytest.approx(clock.t - t_run_stop, abs=1e-6) and after["parts"]["step"] > 0


def test_a_run_without_the_target_counts_from_its_last_step():
    clock = Clock()
    account = _account(clock)
    _steps(account, clock, range(1, 4), eval_every=2)
    account.switch("close")
    clock.tick(0.25)
    with account.phase("eval_final"):
        clock.tick(0.5)
    account.run_stop()
    info = account.report()
    assert info["to_run_stop_from"] == "the end of step 3, the last step"
    assert info["detail_s"]["to_run_stop"] == pytest.approx({"host": 0.015625, "close": 0.25, "eval_final": 0.5}, abs=EXACT)
    assert info["sum_of_parts_s"] == pytest.approx(info["run_start_to_run_stop_s"], abs=EXACT)


def test_a_long_runs_timeline_is_binned_and_its_parts_are_not():
    """20,000 steps: the JSON's timeline stays a picture (at most 3,000 entries), the parts still add up."""
    clock = Clock()
    account = _account(clock)
    _steps(account, clock, range(1, 20001), eval_every=40, stop_at=20000)
    info = account.report()
    assert len(info["timeline"]) <= 3000
    assert info["sum_of_parts_s"] == pytest.approx(info["run_start_to_run_stop_s"], rel=1e-12)
    assert info["parts_s"]["step"] == pytest.approx(20000 - 0.25, abs=1e-6)


def test_the_summary_names_every_part():
    clock = Clock()
    account = _account(clock)
    _steps(account, clock, range(1, 5), eval_every=2, stop_at=4)
    lines = summary_lines(account.report(), where="runs/x/time_account.json")
    assert lines[0] == f"time account: run_start -> run_stop {account.t_run_stop - account.t_run_start:.1f} s (runs/x/time_account.json):"
    for label in ("step (compute)", "data wait", "host work", "compilation", "checkpoints", "evaluation",
                  "to run_stop", "other"):  # fmt: skip
        assert any(line.startswith(f"  {label} ") for line in lines), label
    assert "from the end of step 4, whose evaluation reached the target: evaluation 2.00 s" in "\n".join(lines)
    assert lines[-1] == ("  init (before run_start, untimed): 6.8 s (process start 2.0 s, set-up 0.5 s, build 3.0 s, "
                         "warm-up 1.0 s, other 0.2 s)")


def test_the_compile_probe_counts_a_real_compile_and_the_reply_carries_run_stops_time():
    """:func:`compile_seconds` grows by dynamo's own compile time when something compiles (what the account
    cuts out of the step it happened in); an evaluation reply carries its wall time (run_stop's, when the
    target is reached), which the plain decoding leaves as it was."""
    import torch

    from scalefold.evaluation.protocol import RESULT, decode_reply, encode_reply, reply_time
    from scalefold.train.time_account import compile_seconds

    before = compile_seconds()
    torch.compile(lambda x: (x.sin() * 2).sum(), backend="eager")(torch.randn(5))
    assert compile_seconds() > before
    reply = encode_reply(RESULT, 40, 10240, 0.8125, True, at=1796189303.663)
    assert decode_reply(reply) == (RESULT, 40, 10240, 0.8125, True, "")
    assert reply_time(reply) == 1796189303.663


_PRELOAD_SCRIPT = """
import sys


def sample(index, seed):  # what a loader worker has imported before its first sample
    return sorted(m for m in ("torch", "scalefold.data.dataset") if m in sys.modules)


if __name__ == "__main__":
    from scalefold.data.loader import PriorityQueueLoader
    from scalefold.train import stopping

    if sys.argv[1] == "plain":
        stopping.WORKER_PRELOAD = ()
    stopping.start_multiprocessing_helpers_ignoring_stop_signals()
    with PriorityQueueLoader(sample, [(0, 0)], num_workers=1, mp_context="forkserver") as loader:
        print(next(iter(loader))[1])
"""


@pytest.mark.parametrize("mode", ["preload", "plain"])
def test_loader_workers_start_with_the_pipeline_imported(tmp_path, mode):
    """The forkserver (started before run_start) imports the workers' modules once: a worker it forks has
    torch and the feature pipeline before its first sample, so the first batch after run_start does not wait
    for a worker's imports (without the preload it has neither)."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(_PRELOAD_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "['scalefold.data.dataset', 'torch']" if mode == "preload" else "[]"
    assert proc.stdout.strip().splitlines()[-1] == expected


# ---------------------------------------------------------------------------------------------
# Real runs of the tiny preset
# ---------------------------------------------------------------------------------------------


def _mllog(path: Path) -> list[dict]:
    return [json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in path.read_text().splitlines() if ":::MLLOG " in ln]


@pytest.fixture(scope="module")
def reached(tmp_path_factory):
    """``scalefold train --preset tiny --target-lddt 0.01``: the first evaluation (step 2) reaches the target
    (the untrained model scores ~0.03 on the tiny store); its console output and run directory."""
    root = tmp_path_factory.mktemp("time_account")
    out, buffer = root / "run", io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(root / "store.h5"), "--target-lddt",
                   "0.01", "--max-steps", "6", "--eval-every", "2", "--checkpoint-every", "2"])  # fmt: skip
    assert rc == 0, buffer.getvalue()[-3000:]
    return out, buffer.getvalue()


def test_a_tiny_run_writes_its_account_and_its_parts_add_up(reached):
    out, _ = reached
    info = json.loads((out / "time_account.json").read_text())
    assert list(info["parts_s"]) == list(RUN_PARTS)
    assert all(v >= 0 for v in info["parts_s"].values())
    assert info["sum_of_parts_s"] == pytest.approx(sum(info["parts_s"].values()), abs=EXACT)
    assert info["sum_of_parts_s"] == pytest.approx(info["run_start_to_run_stop_s"], abs=1e-6)
    # the timeline is the same readings: its spans before run_stop tile the run
    spans = sum(min(a + s, info["run_start_to_run_stop_s"]) - a for _, a, s in info["timeline"]
                if 0 <= a < info["run_start_to_run_stop_s"])  # fmt: skip
    assert spans == pytest.approx(info["run_start_to_run_stop_s"], abs=1e-4)
    assert info["steps"] == 2 and info["status"] == "success" and info["evaluation"] == "synchronous"
    assert info["parts_s"]["step"] > 0 and info["parts_s"]["evaluation"] > 0
    assert info["to_run_stop_from"] == "the end of step 2, whose evaluation reached the target"
    assert (out / "time_account.png").read_bytes()[:4] == b"\x89PNG"
    assert info["time_to_train_s"] > 0 and info["init_s"]["total"] > 0


def test_after_the_target_nothing_waits_before_run_stop(reached):
    """The evaluation that reached the target is followed by run_stop at once: the step's checkpoint, closing
    the loader and the starting point's score (step 0, not MLPerf's) come after run_stop, untimed; the
    MLPerf log ends with run_stop; metrics.jsonl stays in step order."""
    out, _ = reached
    info = json.loads((out / "time_account.json").read_text())
    # the first evaluation may wait for the rest of the validation cache's background build
    assert set(info["detail_s"]["to_run_stop"]) <= {"host", "eval_cache", "eval_cycle"}, info["detail_s"]["to_run_stop"]
    assert info["detail_s"]["to_run_stop"]["eval_cycle"] > 0
    assert "eval_baseline" not in info["detail_s"]["evaluation"] and info["parts_s"]["checkpoint"] == 0
    after = info["after_run_stop_s"]["parts"]
    assert after["checkpoint"] > 0 and after["eval_baseline"] > 0 and after["close"] > 0 and after["report"] > 0
    assert (out / "checkpoints" / "checkpoint_00000002.pt").exists()
    events = _mllog(out / "mlperf.log")
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "success"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in records] == [0, 1, 2, 2] and "eval_lddt_ca" in records[0]


def test_the_last_lines_of_the_output_are_the_account(reached):
    out, console = reached
    path = out / "time_account.json"
    expected = summary_lines(json.loads(path.read_text()), where=str(path))
    assert console.rstrip("\n").splitlines()[-len(expected) :] == expected
    assert f"time account: {out / 'time_account.png'}" in console  # listed with the run's files


# The asynchronous run's account (1 training + 1 evaluation rank, launched by torchrun) is checked on the end-to-end
# run of tests/evaluation/test_async_eval.py (test_an_asynchronous_runs_account_ends_at_the_evaluation_ranks_run_stop):
# one launch serves both files' assertions.
