"""Faults of a training run: pre-emption signals, non-finite steps, bad checkpoints.

* SIGTERM / SIGUSR1 sent to a real ``python -m scalefold train`` process: it writes a checkpoint of the
  step it was in, logs ``run_stop``, exits 0, and ``--resume`` continues from that step;
* a store whose structures are all NaN makes every loss non-finite: each step is skipped (weights and
  Adam state untouched, counted in metrics.jsonl) and too many in a row abort the run with
  ``run_stop status=aborted`` (exit status 2 from the CLI);
* ``--resume`` refuses a checkpoint of another model preset.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from scalefold.checkpoint.adapters import CheckpointError as ReferenceCheckpointError
from scalefold.cli import main
from scalefold.train.checkpoint_io import load_checkpoint
from scalefold.train.cli import EXIT_ABORTED, EXIT_BAD_INPUT
from scalefold.train.config import TrainConfig
from scalefold.train.loop import build_model, build_model_config, train

SIGNAL_TEST_TIMEOUT_S = 300  # generous: the machine is shared


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _mllog(path: Path) -> list[dict]:
    return [json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in path.read_text().splitlines() if ":::MLLOG " in ln]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny synthetic store (created once by a short run)."""
    root = tmp_path_factory.mktemp("faults")
    path = root / "store.h5"
    cfg = TrainConfig.from_preset(
        "tiny", overrides={"out": str(root / "warm"), "store": str(path), "max_steps": 1, "eval_every": 0}, env={}
    )
    train(cfg)
    return path


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DGXSYSTEM"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_until(out: Path, store: Path, min_records: int, sig: int, checkpoint_every: int) -> tuple[int, str]:
    """Start a long tiny run, wait for ``min_records`` completed steps, send ``sig``; (exit status, output)."""
    cmd = [sys.executable, "-m", "scalefold", "train", "--preset", "tiny", "--out", str(out), "--store", str(store),
           "--max-steps", "100000", "--eval-every", "0", "--checkpoint-every", str(checkpoint_every),
           "--num-workers", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + SIGNAL_TEST_TIMEOUT_S
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(_records(metrics)) >= min_records):  # in the loop, steps completing
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"the run never got to step {min_records}"
            time.sleep(0.1)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=SIGNAL_TEST_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, stdout + stderr


def _resume_one_more_step(out: Path, store: Path, from_step: int) -> None:
    rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(store), "--resume",
               "--max-steps", str(from_step + 1), "--eval-every", "0", "--checkpoint-every", "0"])  # fmt: skip
    assert rc == 0
    assert [r["step"] for r in _records(out / "metrics.jsonl")] == list(range(1, from_step + 2))
    # the resumed run logs its own MLPerf run; the first log keeps exactly one
    resumed = _mllog(out / f"mlperf_resumed_{from_step:08d}.log")
    assert [r["key"] for r in resumed][:2] == ["init_start", "cache_clear"] and resumed[-1]["key"] == "run_stop"
    assert [r["key"] for r in _mllog(out / "mlperf.log")].count("init_start") == 1


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_preemption_signal_checkpoints_and_exits_cleanly(tmp_path, store, signame):
    """A real signal mid-run: exit status 0, a checkpoint of the last completed step (loadable with
    weights_only=True), run_stop logged, and --resume trains on from exactly that step."""
    out = tmp_path / "run"
    rc, output = _run_until(out, store, 2, getattr(signal, signame), checkpoint_every=0)
    assert rc == 0, output[-4000:]
    last = _records(out / "metrics.jsonl")[-1]["step"]
    assert 2 <= last < 100000
    ckpts = sorted((out / "checkpoints").glob("checkpoint_*.pt"))
    assert [p.name for p in ckpts] == [f"checkpoint_{last:08d}.pt"]
    ckpt = load_checkpoint(ckpts[0])  # torch.load(weights_only=True)
    assert ckpt["iteration"] == last and ckpt["data_position"] == {"samples_consumed": last}
    assert ckpt["model_preset"] == "tiny"
    assert "stop requested" in output
    assert _mllog(out / "mlperf.log")[-1]["key"] == "run_stop"
    _resume_one_more_step(out, store, last)


def test_kill_9_loses_at_most_the_steps_since_the_last_checkpoint(tmp_path, store):
    """SIGKILL (no chance to react) during a run checkpointing every 2 steps: the newest complete
    checkpoint loads, --resume restarts from it and drops the metrics of the lost steps."""
    out = tmp_path / "run"
    rc, output = _run_until(out, store, 3, signal.SIGKILL, checkpoint_every=2)
    assert rc == -signal.SIGKILL, output[-4000:]
    last = _records(out / "metrics.jsonl")[-1]["step"]
    ckpts = sorted((out / "checkpoints").glob("checkpoint_*.pt"))
    saved = int(ckpts[-1].stem.split("_")[1])
    assert saved % 2 == 0 and last - 2 <= saved <= last
    assert load_checkpoint(ckpts[-1])["iteration"] == saved
    _resume_one_more_step(out, store, saved)
    assert not [p for p in (out / "checkpoints").iterdir() if ".tmp-" in p.name]  # a torn write is cleaned up


def _poison(store: Path, dst: Path) -> Path:
    """A copy of ``store`` whose every atom position is NaN (a corrupt dataset)."""
    shutil.copy(store, dst)
    with h5py.File(dst, "r+") as f:
        positions = f["residues/all_atom_positions"]
        positions[...] = np.full(positions.shape, np.nan, dtype=positions.dtype)
    return dst


def test_non_finite_steps_are_skipped_then_the_run_aborts(tmp_path, store):
    """Every loss is NaN: steps 1-2 are skipped (counted; the step-2 checkpoint holds the initial weights
    and no Adam state), step 3 exceeds --max-consecutive-nonfinite 2: exit status 2, run_stop aborted."""
    bad = _poison(store, tmp_path / "nan.h5")
    out = tmp_path / "run"
    env = {"SCALEFOLD_MAX_CONSECUTIVE_NONFINITE": "2"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(bad), "--max-steps", "6",
                   "--eval-every", "0", "--checkpoint-every", "2"])  # fmt: skip
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert rc == EXIT_ABORTED
    records = _records(out / "metrics.jsonl")
    assert [(r["step"], r["skipped"], r["skipped_total"]) for r in records] == [(1, True, 1), (2, True, 2), (3, True, 3)]
    assert all(not np.isfinite(r["loss"]) for r in records)
    log = _mllog(out / "mlperf.log")
    assert log[-1]["key"] == "run_stop" and log[-1]["metadata"]["status"] == "aborted"

    cfg = TrainConfig.from_preset("tiny", overrides={"store": str(bad)}, env={})
    initial = build_model(cfg, build_model_config(cfg), torch.device("cpu"), torch.float32).state_dict()
    ckpt = load_checkpoint(out / "checkpoints" / "checkpoint_00000002.pt")
    assert all(torch.equal(ckpt["alphafold_state_dict"][k], v) for k, v in initial.items())
    assert ckpt["optimizer_state_dict"]["state"] == {}  # Adam never stepped
    assert not (out / "checkpoints" / "checkpoint_00000004.pt").exists()


def test_resume_refuses_a_checkpoint_of_another_preset(tmp_path, store):
    """A checkpoint recorded as model preset 'demo' is refused by a 'tiny' run with a message naming both."""
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--out", str(out), "--store", str(store), "--max-steps", "1",
                 "--eval-every", "0", "--checkpoint-every", "1"]) == 0  # fmt: skip
    path = out / "checkpoints" / "checkpoint_00000001.pt"
    ckpt = load_checkpoint(path)
    ckpt["model_preset"] = "demo"
    torch.save(ckpt, path)
    cfg = TrainConfig.from_preset(
        "tiny", overrides={"out": str(out), "store": str(store), "max_steps": 2, "resume": True}, env={}
    )
    with pytest.raises(ReferenceCheckpointError, match="'demo'.*'tiny'"):
        train(cfg)
    rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(store), "--max-steps", "2", "--resume"])
    assert rc == EXIT_BAD_INPUT
