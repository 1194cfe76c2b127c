"""Faults of a training run: pre-emption signals, non-finite steps, bad checkpoints.

* SIGTERM / SIGUSR1 sent to a real ``python -m scalefold train`` process: it writes a checkpoint of the
  step it was in, logs ``run_stop``, exits 0, and ``--resume`` continues from that step;
* a store whose structures are all NaN makes every loss non-finite: each step is skipped (weights and
  Adam state untouched, counted in metrics.jsonl) and too many in a row abort the run with
  ``run_stop status=aborted`` (exit status 2 from the CLI);
* ``--resume`` refuses a checkpoint of another model preset, and checkpoint files none of which loads
  (listing each file's error); without any checkpoint it starts afresh (new metrics.jsonl, mlperf.log);
  the resumed run's MLPerf log is named after the checkpoint that loaded;
* pre-emption of a run with an asynchronous evaluation rank (srun-style launch, the signal sent to every
  process): the training rank checkpoints, the evaluation rank serves until training ends, both exit 0;
* a missing store is refused (exit status 3) unless the preset (demo, tiny) or a flag synthesises one.
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
from scalefold.checkpoint.files import load_checkpoint
from scalefold.cli import main
from scalefold.commands.train import EXIT_ABORTED
from scalefold.config.training import TrainConfig
from scalefold.distributed.launch import free_port
from scalefold.errors import EXIT_USER_ERROR
from scalefold.model.factory import build_model, build_model_config
from scalefold.train.trainer import train

SIGNAL_TEST_TIMEOUT_S = 300  # generous: the machine is shared


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _mllog(path: Path) -> list[dict]:
    return [json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in path.read_text().splitlines() if ":::MLLOG " in ln]


@pytest.fixture(scope="module")
def store(tiny_store):
    """The tiny synthetic store (tests/train/conftest.py: synthesised once per session)."""
    return tiny_store


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


def test_non_finite_steps_are_skipped_then_the_run_aborts(tmp_path, store, capsys):
    """Every loss is NaN: steps 1-2 are skipped (counted; the step-2 checkpoint holds the initial weights
    and no Adam state), step 3 exceeds --max-consecutive-nonfinite 2: exit status 2, run_stop aborted.
    metrics.jsonl stays strict JSON (the non-finite loss is null), and the aborted run still prints its
    step-time breakdown and plots its curves."""
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
    captured = capsys.readouterr()
    assert "step-time breakdown over 3 steps (3 skipped):" in captured.out, captured.out[-3000:]
    assert "scalefold train: aborted: 3 consecutive non-finite steps" in captured.err
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"

    def _no_constants(name):
        raise ValueError(f"{name} is not strict JSON")

    records = [json.loads(x, parse_constant=_no_constants) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["skipped_total"]) for r in records] == [(1, True, 1), (2, True, 2), (3, True, 3)]
    assert all(r["loss"] is None for r in records)
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
    assert rc == EXIT_USER_ERROR


# ---------------------------------------------------------------------------------------------
# Pre-emption with an asynchronous evaluation rank (srun-style launch: ranks from SLURM_*)
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_preemption_with_an_eval_rank_checkpoints_and_both_ranks_exit_0(tmp_path, store):
    """1 training + 1 evaluation rank launched the way srun does (SLURM_PROCID / SLURM_NTASKS, no torchrun);
    Slurm pre-emption signals every process of every task, so SIGUSR1 goes to each task's whole process
    group (loader workers included): the training rank checkpoints its last step and ends its run
    (run_stop aborted, once), the evaluation rank keeps serving until training's end-of-training
    sentinel; both exit 0."""
    out, port = tmp_path / "run", free_port()
    cmd = [sys.executable, "-m", "scalefold", "train", "--preset", "tiny", "--out", str(out), "--store", str(store),
           "--max-steps", "100000", "--eval-every", "2", "--checkpoint-every", "0", "--num-workers", "1",
           "--num-async-eval-ranks", "1", "--process-group-timeout-s", "120", "--eval-timeout-s", "120"]  # fmt: skip
    procs = []
    try:
        for rank in range(2):
            env = {**_clean_env(), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                   "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))  # fmt: skip
        deadline = time.monotonic() + SIGNAL_TEST_TIMEOUT_S
        metrics = out / "metrics.jsonl"
        # past the first submission (step 2): the evaluation rank is serving
        while not (metrics.exists() and len([r for r in _records(metrics) if "loss" in r]) >= 3):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "the run never got to step 3"
            time.sleep(0.1)
        for p in procs:
            os.killpg(p.pid, signal.SIGUSR1)
        outputs = [p.communicate(timeout=SIGNAL_TEST_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    train_out, eval_out = outputs
    assert [p.returncode for p in procs] == [0, 0], f"{train_out[-4000:]}\n---\n{eval_out[-4000:]}"
    assert "stop requested (signal)" in train_out and "scalefold train: aborted" not in train_out
    # the loader's forkserver, resource tracker and workers ignored the signal: no worker "died"
    assert "restarting it" not in train_out and "died unexpectedly" not in train_out + eval_out
    assert "evaluation rank 1: SIGUSR1 received; served evaluations until training ended" in eval_out
    last = [r for r in _records(out / "metrics.jsonl") if "loss" in r][-1]["step"]
    ckpts = sorted((out / "checkpoints").glob("checkpoint_*.pt"))
    assert [p.name for p in ckpts] == [f"checkpoint_{last:08d}.pt"]
    assert load_checkpoint(ckpts[0])["iteration"] == last
    events = _mllog(out / "mlperf.log")
    run_stops = [e for e in events if e["key"] == "run_stop"]
    assert len(run_stops) == 1 and run_stops[0]["metadata"]["status"] == "aborted"  # as a pre-empted single run
    assert run_stops[0]["metadata"]["file"].endswith("train/trainer.py") and events[-1]["key"] == "run_stop"


# ---------------------------------------------------------------------------------------------
# --resume without a usable checkpoint
# ---------------------------------------------------------------------------------------------


def test_resume_refuses_when_no_checkpoint_loads(tmp_path, store, capsys):
    """Checkpoint files exist but none loads (a truncated one, an empty one): --resume is refused with every
    file and its error, exit status 3, nothing trained and the old metrics.jsonl untouched."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "checkpoint_00000002.pt").write_bytes(b"PK\x03\x04 not a whole zip archive")
    (out / "checkpoints" / "checkpoint_00000004.pt").write_bytes(b"")
    old = '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'
    (out / "metrics.jsonl").write_text(old)
    rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(store), "--resume", "--max-steps", "3",
               "--eval-every", "0"])  # fmt: skip
    assert rc == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "none of the 2 checkpoint file(s)" in err, err
    assert "checkpoint_00000004.pt is empty" in err and "checkpoint_00000002.pt" in err and "truncated or corrupt" in err
    assert (out / "metrics.jsonl").read_text() == old
    assert not list(out.glob("*.log"))


def test_resume_without_any_checkpoint_starts_fresh(tmp_path, store, capsys):
    """--resume with no checkpoint at all: a fresh run from step 0 that says so, a new metrics.jsonl
    (not appended to the old one) and the normal log name mlperf.log."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(store), "--resume", "--max-steps", "1",
               "--eval-every", "0", "--checkpoint-every", "0"])  # fmt: skip
    assert rc == 0
    assert "--resume: no checkpoint in" in capsys.readouterr().out
    assert [r["step"] for r in _records(out / "metrics.jsonl")] == [1]
    assert [p.name for p in out.glob("*.log")] == ["mlperf.log"]


def test_resume_log_is_named_after_the_checkpoint_that_loaded(tmp_path, store, capsys):
    """The newest checkpoint is damaged: --resume continues from the older one, says it skipped the newer,
    and names its MLPerf log after the checkpoint it loaded."""
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--out", str(out), "--store", str(store), "--max-steps", "2",
                 "--eval-every", "0", "--checkpoint-every", "1"]) == 0  # fmt: skip
    newest = out / "checkpoints" / "checkpoint_00000002.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    capsys.readouterr()
    assert main(["train", "--preset", "tiny", "--out", str(out), "--store", str(store), "--resume", "--max-steps", "2",
                 "--eval-every", "0", "--checkpoint-every", "0"]) == 0  # fmt: skip
    console = capsys.readouterr().out
    assert "skipping a checkpoint that does not load" in console and "checkpoint_00000002.pt" in console
    assert "resumed from step 1" in console
    assert sorted(p.name for p in out.glob("*.log")) == ["mlperf.log", "mlperf_resumed_00000001.log"]
    assert [r["step"] for r in _records(out / "metrics.jsonl")] == [1, 2]


def test_missing_store_is_refused_unless_the_preset_synthesises_one(tmp_path, capsys):
    """--preset mlperf with an absent --store: exit status 3, the path and how to create a store named,
    nothing created. demo / tiny (and --synthesize-missing-store) synthesise it."""
    from scalefold.train.run_directory import StoreNotFoundError, check_store

    missing = tmp_path / "data" / "store.h5"
    out = tmp_path / "run"
    rc = main(["train", "--preset", "mlperf", "--store", str(missing), "--out", str(out), "--max-steps", "1"])
    assert rc == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert str(missing) in err and "scalefold preprocess" in err and "scalefold synth" in err
    assert "--synthesize-missing-store" in err
    assert not missing.exists() and not out.exists()
    mlperf = TrainConfig.from_preset("mlperf", overrides={"store": str(missing)}, env={})
    with pytest.raises(StoreNotFoundError):
        check_store(mlperf)
    assert check_store(mlperf.replace(synthesize_missing_store=True)) == missing
    for preset in ("demo", "tiny"):
        assert TrainConfig.from_preset(preset, env={}).synthesize_missing_store
    env = {"SCALEFOLD_SYNTHESIZE_MISSING_STORE": "1"}
    assert TrainConfig.from_preset("mlperf", env=env).synthesize_missing_store


def test_stop_request_is_reentrant_and_restores_the_handlers():
    """train() installs one StopRequest for the whole run (a signal during the setup counts); the loop's
    nested `with` of the same object keeps its handlers and the caught signal; the outermost exit
    restores the previous handlers."""
    from scalefold.train.stopping import StopRequest

    before = signal.getsignal(signal.SIGUSR1)
    request = StopRequest()
    with request:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # the Python-level handler runs in the main thread at the next bytecode boundary
        with request:
            assert request.requested and request.signal_name == "SIGUSR1"
        assert signal.getsignal(signal.SIGUSR1) == request._handle
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_failed_runs_stop_request_leaves_the_signals_ignored():
    """A rank of a launch whose run failed (train() calls StopRequest.ignore_after_exit) leaves SIGTERM / SIGUSR1
    ignored when the ``with`` ends, not the previous (default) handlers back: the launcher's SIGTERM to the
    survivors of a dead rank cannot end one before it has named the rank at fault."""
    from scalefold.train.stopping import StopRequest

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        request = StopRequest()
        with request:
            try:
                raise RuntimeError("Connection reset by peer")  # what a dead peer's collective raises
            except RuntimeError:
                request.ignore_after_exit()
        assert {sig: signal.getsignal(sig) for sig in before} == {sig: signal.SIG_IGN for sig in before}
        os.kill(os.getpid(), signal.SIGUSR1)  # ignored: this process lives on
        time.sleep(0.01)
        assert not request.requested  # the flag's handler is gone too
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
