"""A file system that fills up under a run, for real: a size-limited tmpfs mounted by the test (root, as in
CI; skipped with the reason elsewhere), filled by a second writer while ``scalefold train`` writes its
checkpoints, ``metrics.jsonl``, the MLPerf log and the curves there.

* the writers alone: a line file never tears and loses no line; an atomic checkpoint write that the disk
  refuses raises ``ENOSPC`` naming the target and leaves the previous checkpoint, and no temporary file;
* the disk fills in the middle of a run, then space comes back: one line per file naming the path and the
  free space, training goes on, the next checkpoint is the retry, and at the end every step's record and
  every MLPerf line is on disk, in order (nothing lost), every checkpoint loads;
* the disk is full to the end: the run's last checkpoint cannot be written, so the run ends with exit
  status 5 and one line naming the newest good checkpoint and the command that resumes; the newest file
  in ``checkpoints/`` is that good one, the logs parse, and ``--resume`` (space freed) continues from it.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from scalefold.checkpoint.files import CheckpointManager, load_checkpoint, save_atomic
from scalefold.diskspace import LineAppender
from fault_helpers import clean_env, fill, mllog, records

TIMEOUT_S = 300  # generous bounds: the machine is shared; nothing below depends on speed


def test_line_file_and_checkpoint_on_a_full_disk(small_disk):
    """A full tmpfs: appended lines wait in memory (the file ends with whole lines), are written in order once
    space is back; a checkpoint refused raises ENOSPC naming its path, the older checkpoint stays, no temp file."""
    disk = small_disk(1 << 20)
    reports: list[str] = []
    log = LineAppender(disk / "metrics.jsonl", report=reports.append)
    assert log.write('{"step": 1}')
    manager = CheckpointManager(disk / "checkpoints", keep_last=2)
    manager.save({"iteration": 1, "w": torch.zeros(1000)})
    filler = fill(disk)  # the file's last page has room for a few lines (tmpfs allocates pages), then none
    written = [log.write('{"step": %d, "pad": "%s"}' % (i, "x" * 90)) for i in range(2, 102)]
    assert not all(written) and log.pending > 0 and len(reports) == 1  # one line per episode
    assert "no space left on the device" in reports[0] and str(disk) in reports[0] and "free of" in reports[0]
    text = (disk / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(line.startswith('{"step"') and line.endswith("}") for line in text.splitlines())
    with pytest.raises(OSError) as info:
        manager.save({"iteration": 2, "w": torch.zeros(1 << 18)})  # 1 MiB: cannot fit
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(manager.path_for(2))
    assert [p.name for p in (disk / "checkpoints").iterdir()] == ["checkpoint_00000001.pt"]  # no temporary left
    assert load_checkpoint(manager.latest())["iteration"] == 1
    filler.unlink()
    assert log.flush() and log.pending == 0 and "written again" in reports[-1]
    assert [int(line.split(",")[0].split(":")[1].strip(" }")) for line in
            (disk / "metrics.jsonl").read_text().splitlines()] == list(range(1, 102))  # fmt: skip
    assert log.close() == []
    save_atomic({"iteration": 2}, manager.path_for(2))  # and with space, the write goes through


class _Output:
    """A process's standard error and output, read by threads, searchable while it runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._lock = threading.Lock()
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._lock:
                self.text += line

    def wait_for(self, proc: subprocess.Popen, *needles: str, meanwhile=None) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(n in self.text for n in needles):
            assert proc.poll() is None, f"the run ended (status {proc.returncode}) before {needles}:\n{self.text[-4000:]}"
            assert time.monotonic() < deadline, f"no {needles} within {TIMEOUT_S} s:\n{self.text[-4000:]}"
            if meanwhile is not None:
                meanwhile()
            time.sleep(0.1)


def _train(out: Path, store: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scalefold", "train", "--preset", "tiny", "--out", str(out), "--store", str(store),
           "--eval-every", "0", "--num-workers", "1", "--no-progress", *args]  # fmt: skip
    return subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_disk_fills_mid_run_training_goes_on_and_nothing_is_lost(small_disk, tiny_store):
    """The disk fills after step 2 and is freed after both failures were reported: the run never stops, the
    next checkpoint after the space came back is written, and metrics.jsonl / mlperf.log hold every line."""
    disk = small_disk(64 << 20)
    out = disk / "run"
    proc = _train(out, tiny_store, "--max-steps", "100000", "--checkpoint-every", "1")
    output = _Output(proc)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + TIMEOUT_S
        while not (metrics.exists() and len(records(metrics)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, output.text[-4000:]
            time.sleep(0.1)
        # filled, and kept full: space a failed checkpoint's temporary file gives back is taken again
        output.wait_for(proc, "not written to", f"cannot write {metrics}", meanwhile=lambda: fill(disk))
        filler = disk / "filler.bin"
        failed = [ln for ln in output.text.splitlines() if "not written to" in ln]
        assert len(failed) == 1, failed  # one line per episode, not one per failed checkpoint
        failed = failed[0]
        assert "no space left on the device (" in failed and "free of" in failed and "training goes on" in failed
        assert "newest good checkpoint: " + str(out / "checkpoints") in failed
        filler.unlink()
        output.wait_for(proc, "are superseded", f"{metrics} written again")
        proc.send_signal(signal.SIGTERM)  # a clean stop: the step's checkpoint, exit 0
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output.text[-4000:]
    assert "Traceback" not in output.text and "Logging error" not in output.text
    steps = [r["step"] for r in records(out / "metrics.jsonl")]
    assert steps == list(range(1, steps[-1] + 1))  # every step's record, in order: nothing lost
    ckpts = CheckpointManager(out / "checkpoints").checkpoints()
    assert ckpts[-1][0] == steps[-1] and all(load_checkpoint(p)["iteration"] == s for s, p in ckpts)
    log = mllog(out / "mlperf.log")
    assert log[0]["key"] == "init_start" and log[-1]["key"] == "run_stop"
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_disk_full_to_the_end_exits_5_and_resume_continues(small_disk, tiny_store):
    """Room for one checkpoint only: step 2's is written, step 4's (the last) is not -> exit status 5 with one
    line; the newest checkpoint on disk loads (step 2), the logs parse; freed, --resume trains on from step 2."""
    size = os.path.getsize(next((tiny_store.parent / "warm" / "checkpoints").glob("checkpoint_*.pt")))
    disk = small_disk(64 << 20)
    out = disk / "run"
    filler = fill(disk, leave=int(1.5 * size) + (256 << 10))  # one checkpoint and the logs fit, not two checkpoints
    proc = _train(out, tiny_store, "--max-steps", "4", "--checkpoint-every", "2")
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 5, stdout[-3000:] + stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("scalefold train: the run's last checkpoint of step 4 not written to "), last
    assert "no space left on the device" in last and "checkpoint_00000002.pt" in last and "--resume" in last
    assert "Traceback" not in stderr
    ckpts = CheckpointManager(out / "checkpoints").checkpoints()
    assert [s for s, _ in ckpts] == [2] and load_checkpoint(ckpts[-1][1])["iteration"] == 2
    assert [r["step"] for r in records(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert mllog(out / "mlperf.log")[-1]["key"] == "run_stop"
    filler.unlink()
    resumed = _train(out, tiny_store, "--max-steps", "4", "--checkpoint-every", "2", "--resume")
    stdout, stderr = resumed.communicate(timeout=TIMEOUT_S)
    assert resumed.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert f"resumed from step 2 ({ckpts[-1][1]})" in stdout
    assert [r["step"] for r in records(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert load_checkpoint(CheckpointManager(out / "checkpoints").latest())["iteration"] == 4
