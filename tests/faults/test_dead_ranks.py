"""Dead and stalled ranks, for real: ``torchrun --nproc-per-node 4 -m scalefold train --preset tiny --dap 2``
(DAP-2 x DP-2 on gloo), one rank sent SIGKILL or SIGSTOP in the middle of the step loop.

Every survivor ends within the configured bound (``--stall-timeout`` for a stopped rank, then
``--dead-peer-timeout``) with one line naming the rank, its host and pid, its step and the command that
resumes; exit status 4; the transport's traceback is in ``<out>/faults/rank<R>.txt``, not in the output;
torchrun's failure summary names the rank (its own entry for a killed one; the first survivor's message
for a stopped one, which never exits by itself); the newest checkpoint loads, ``metrics.jsonl`` and the
MLPerf log parse (``run_stop aborted``), and the printed resume command continues from the checkpoint.

An asynchronous evaluation rank killed after its first evaluation: training names it at its next cycle
(``--num-async-eval-ranks 1``), ends with exit status 4 and the same kind of line, and the MLPerf log is
complete (one ``run_stop``, status aborted; the compliance checker fails only the rules a tiny run cannot
meet).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fault_helpers import clean_env, mllog, records

from scalefold.checkpoint.files import CheckpointManager, load_checkpoint
from scalefold.distributed.launch import free_port
from scalefold.mlperf.logger import check_log

pytestmark = pytest.mark.distributed

TIMEOUT_S = 420  # generous: four processes on a busy 2-core machine; the assertions are on behaviour
STALL_S, DEAD_PEER_S = 6, 10
FAULT_ARGS = ("--stall-timeout", str(STALL_S), "--dead-peer-timeout", str(DEAD_PEER_S))
#: the compliance rules a tiny run cannot meet (tests/test_slurm_submission.py's SMALL_RUN_FAILURES)
SMALL_RUN_FAILURES = [
    "eval_accuracy", "eval_samples", "init_checkpoint_sha256sum", "max_extra_msa", "max_msa_clusters",
    "max_templates", "model_parameters_count", "num_recycling_iters", "train_samples", "train_sequence_crop_size",
    "val_every_iters",
]  # fmt: skip


def _line_re(rank: int) -> re.Pattern:
    return re.compile(rf"^scalefold train: rank {rank} \(host (\S+), pid (\d+)\) (.+?) at step (\d+); rank (\d+) stops "
                      rf"\(exit status 4; details in (\S+)\); resume: (torchrun .+ --resume)(?: \[.*\])?$", re.M)  # fmt: skip


class _Launch:
    """``torchrun --nproc-per-node N -m scalefold train ARGS`` with its output collected while it runs.

    torchrun SIGTERMs the survivors as soon as it notices a dead worker and SIGKILLs those still running after
    its ``--shutdown-timeout`` (30 s by default); a survivor ignores the SIGTERM once it handles the fault and
    ends by itself within ``--dead-peer-timeout`` of it, but on a loaded machine it may not get there within
    30 s of CPU-starved wall time and would then die without its line. The launch gives torchrun a grace of
    ``TIMEOUT_S``, so every survivor ends by itself; the tests assert the bound on the survivors' end."""

    def __init__(self, nproc: int, *args: str) -> None:
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                    str(free_port()), "--shutdown-timeout", str(TIMEOUT_S), "-m", "scalefold", "train", *args]  # fmt: skip
        self.proc = subprocess.Popen(self.cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)  # fmt: skip
        self.text = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.text += line

    def ranks(self) -> dict[int, int]:
        """``{rank: pid}`` of torchrun's worker processes (their environment says their rank)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"RANK" in env:
                found[int(env[b"RANK"])] = int(entry.name)
        return found

    def wait_until(self, ready, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            assert self.proc.poll() is None, f"the launch ended before {what}:\n{self.text[-6000:]}"
            assert time.monotonic() < deadline, f"no {what} within {TIMEOUT_S} s:\n{self.text[-6000:]}"
            time.sleep(0.2)

    def finish(self, timeout: float = TIMEOUT_S) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._reader.join(timeout=10)
        return self.proc.returncode


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _steps_done(out: Path, n: int):
    metrics = out / "metrics.jsonl"
    return lambda: metrics.exists() and len([r for r in records(metrics) if "loss" in r]) >= n


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGSTOP"])
def test_a_killed_or_stopped_rank_is_named_by_every_survivor(tmp_path, tiny_store, signame):
    victim, out = 2, tmp_path / "run"
    args = ("--preset", "tiny", "--dap", "2", "--out", str(out), "--store", str(tiny_store), "--max-steps", "100000",
            "--eval-every", "0", "--checkpoint-every", "2", "--num-workers", "1", "--no-progress", *FAULT_ARGS)  # fmt: skip
    launch = _Launch(4, *args)
    pids: dict[int, int] = {}
    try:
        launch.wait_until(_steps_done(out, 3), "3 steps")  # the checkpoint of step 2 is on disk
        pids = launch.ranks()
        assert sorted(pids) == [0, 1, 2, 3], pids
        t_signal = time.monotonic()
        os.kill(pids[victim], getattr(signal, signame))
        survivors = [pids[r] for r in (0, 1, 3)]
        launch.wait_until(lambda: not any(_alive(p) for p in survivors), "the survivors' exit")
        ended_s = time.monotonic() - t_signal
        if signame == "SIGSTOP":
            assert _alive(pids[victim])  # still stopped: its peers did not wait for it
    finally:
        if signame == "SIGSTOP" and pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pids[victim], sig)
                except ProcessLookupError:
                    pass
        rc = launch.finish()
    output = launch.text
    bound = (STALL_S if signame == "SIGSTOP" else 0) + DEAD_PEER_S + 120  # detection + grace + a busy machine
    assert ended_s < bound, f"survivors took {ended_s:.0f} s"
    assert rc == 1, output[-6000:]  # torchrun's status for a failed worker; its summary names which
    lines = {int(m.group(5)): m for m in _line_re(victim).finditer(output)}
    assert sorted(lines) == [0, 1, 3], output[-6000:]
    for rank, m in lines.items():
        host, pid, what, step, detail, resume = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(6), m.group(7)
        assert pid == pids[victim] and host and step >= 3
        assert ("died" in what) if signame == "SIGKILL" else ("no heartbeat" in what and "stopped" in what), what
        assert Path(detail) == out / "faults" / f"rank{rank}.txt" and Path(detail).exists()
        assert f"--out {out}" in resume and "--resume" in resume
    assert not re.search(r"\[rank\d\]: Traceback|pair\.cc|GLHF", output), output[-6000:]  # the transport's text
    assert re.search(r"exitcode\s*: 4", output)  # survivors: exit status 4 in torchrun's summary
    root = output.split("Root Cause (first observed failure):", 1)[1]
    if signame == "SIGKILL":  # the killed rank's own entry
        assert f"rank      : {victim}" in root and "SIGKILL" in root, root
    else:  # the stopped rank's own entry (killed at last), or a survivor's, whose message names it
        assert f"rank      : {victim}" in root or f"rank {victim} (host" in root, root
    if signame == "SIGKILL":  # the transport's traceback went to the file
        assert "Traceback" in (out / "faults" / "rank0.txt").read_text()
    _check_on_disk(out)
    if signame == "SIGKILL":
        _resume(lines[0].group(7), out)


def _check_on_disk(out: Path) -> None:
    """The newest checkpoint loads; metrics.jsonl and the MLPerf log parse; run_stop aborted is logged."""
    manager = CheckpointManager(out / "checkpoints")
    step, newest = manager.checkpoints()[-1]
    assert load_checkpoint(newest)["iteration"] == step
    steps = [r["step"] for r in records(out / "metrics.jsonl") if "loss" in r]  # (evaluations have records too)
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= step
    log = mllog(out / "mlperf.log")
    assert log[-1]["key"] == "run_stop" and log[-1]["metadata"]["status"] == "aborted"
    assert [r["key"] for r in log].count("run_stop") == 1


def _resume(command: str, out: Path) -> None:
    """The printed command, with a step budget of one more step, continues from the newest checkpoint."""
    saved = CheckpointManager(out / "checkpoints").checkpoints()[-1][0]
    args = shlex.split(command)
    args = args[args.index("train") + 1 :]
    args[args.index("--max-steps") + 1] = str(saved + 1)
    launch = _Launch(4, *args)
    rc = launch.finish()
    assert rc == 0, launch.text[-6000:]
    assert f"resumed from step {saved}" in launch.text
    assert [r["step"] for r in records(out / "metrics.jsonl") if "loss" in r] == list(range(1, saved + 2))


def test_a_killed_evaluation_rank_ends_the_run_with_its_name(tmp_path, tiny_store):
    out = tmp_path / "run"
    args = ("--preset", "tiny", "--out", str(out), "--store", str(tiny_store), "--num-async-eval-ranks", "1",
            "--max-steps", "100000", "--eval-every", "2", "--checkpoint-every", "2", "--num-workers", "1",
            "--no-progress", *FAULT_ARGS)  # fmt: skip
    launch = _Launch(2, *args)
    try:
        metrics = out / "metrics.jsonl"
        launch.wait_until(lambda: metrics.exists() and any("eval_lddt_ca" in r for r in records(metrics)),
                          "the first evaluation")  # fmt: skip
        pids = launch.ranks()
        os.kill(pids[1], signal.SIGKILL)
    finally:
        rc = launch.finish()
    output = launch.text
    assert rc == 1, output[-6000:]
    line = _line_re(1).search(output)
    assert line is not None and int(line.group(5)) == 0 and "died" in line.group(3), output[-6000:]
    assert not re.search(r"\[rank\d\]: Traceback|pair\.cc|GLHF", output), output[-6000:]
    _check_on_disk(out)
    events = mllog(out / "mlperf.log")
    keys = [e["key"] for e in events]
    # the evaluation the kill cut short has its eval_start only; the official checker accepts that
    assert keys.count("eval_stop") >= 1 and keys.count("eval_start") - keys.count("eval_stop") in (0, 1)
    assert keys[-1] == "run_stop" and keys.count("run_stop") == 1
    report = check_log(out / "mlperf.log")
    assert report.failed_rules == SMALL_RUN_FAILURES and report.warnings == [], report.output[-4000:]


def test_a_rank_killed_during_the_whole_step_capture_is_named_by_every_survivor(tmp_path, tiny_store):
    """``--cuda-graphs step`` at DAP-2 x DP-2 (the emulated capture over gloo): a rank killed while the ranks
    record and check their whole-step graphs (their collectives inside) ends every survivor within the bound,
    one line each naming it, never a hang (issue 39)."""
    victim, out = 3, tmp_path / "run"
    args = ("--preset", "tiny", "--dap", "2", "--out", str(out), "--store", str(tiny_store), "--max-steps", "100000",
            "--eval-every", "0", "--checkpoint-every", "2", "--num-workers", "1", "--no-progress", "--cuda-graphs",
            "step", "--grad-reduce", "flat", *FAULT_ARGS)  # fmt: skip
    launch = _Launch(4, *args)
    try:
        launch.wait_until(lambda: "runs the emulated capture" in launch.text, "the capture")
        pids = launch.ranks()
        assert sorted(pids) == [0, 1, 2, 3], pids
        t_signal = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        survivors = [pids[r] for r in (0, 1, 2)]
        launch.wait_until(lambda: not any(_alive(p) for p in survivors), "the survivors' exit")
        ended_s = time.monotonic() - t_signal
    finally:
        rc = launch.finish()
    output = launch.text
    assert "captured the whole step" not in output, "the kill came after the capture: " + output[-3000:]
    assert ended_s < DEAD_PEER_S + 120, f"survivors took {ended_s:.0f} s"
    assert rc == 1, output[-6000:]
    lines = {int(m.group(5)): m for m in _line_re(victim).finditer(output)}
    assert sorted(lines) == [0, 1, 2], output[-6000:]
    assert all(int(m.group(2)) == pids[victim] and "died" in m.group(3) for m in lines.values()), output[-6000:]
    assert not re.search(r"\[rank\d\]: Traceback|pair\.cc|GLHF", output), output[-6000:]
