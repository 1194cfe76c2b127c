"""``--init-from CKPT``: the MLPerf reference checkpoint format as the starting point of a run.

The reference file is ``torch.save({"alphafold_state_dict", "optimizer_state_dict", "iteration"})``
with a ``torch.optim.Adam`` state dict. Here such a file is written by plain ``torch.optim.Adam`` on
the tiny model; loading it must put the weights in the model, the Adam moments on the flat buffers
(continuing equals torch Adam continuing), start SWA from the weights, and log the file's sha256 in
the MLPerf log. Files that do not fit are refused naming the file and listing the mismatches.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from scalefold.checkpoint.adapters import CheckpointError
from scalefold.cli import main
from scalefold.config.training import TrainConfig
from scalefold.errors import EXIT_USER_ERROR
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.factory import build_model, build_model_config
from scalefold.optim.adam_swa import FlatAdamSWA
from scalefold.train.run_checkpoints import init_from_checkpoint

ITERATION = 7


def _tiny_cfg(**kw) -> TrainConfig:
    return TrainConfig.from_preset("tiny", overrides=kw, env={})


def _reference_checkpoint(path: Path, steps: int = 3) -> dict:
    """A reference-format checkpoint written by torch.optim.Adam after ``steps`` steps on random gradients."""
    cfg = _tiny_cfg()
    torch.manual_seed(99)
    model = AlphaFold(build_model_config(cfg), activation_checkpointing=False)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-6)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 0.01
        adam.step()
    ckpt = {"alphafold_state_dict": model.state_dict(), "optimizer_state_dict": adam.state_dict(), "iteration": ITERATION}
    torch.save(ckpt, path)
    return ckpt


def test_weights_and_adam_moments_land_on_the_flat_buffers(tmp_path):
    """After loading, the model holds the weights, SWA equals them, and one more flat Adam+SWA step with
    a given gradient equals torch Adam continuing from the same state dict."""
    path = tmp_path / "ref.pt"
    ref = _reference_checkpoint(path)
    cfg = _tiny_cfg()
    model = build_model(cfg, build_model_config(cfg), torch.device("cpu"), torch.float32)
    opt = FlatAdamSWA(list(model.named_parameters()), lr=1e-3, eps=1e-6, swa_decay=0.9)
    iteration, sha = init_from_checkpoint(str(path), model, opt)
    assert iteration == ITERATION
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref["alphafold_state_dict"][name]), name
    assert all(torch.equal(s, p.detach()) for s, p in zip(opt.swa_views(), model.parameters()))
    assert opt.num_steps == 3

    # continue both optimizers with the same gradient
    twin = AlphaFold(build_model_config(cfg), activation_checkpointing=False)
    twin.load_state_dict(ref["alphafold_state_dict"])
    adam = torch.optim.Adam(twin.parameters(), lr=1e-3, eps=1e-6)
    adam.load_state_dict(ref["optimizer_state_dict"])
    gen = torch.Generator().manual_seed(11)
    opt.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        g = torch.randn(p.shape, generator=gen) * 0.01
        p.grad.copy_(g)
        q.grad = g.clone()
    # the reference's SWA: torch AveragedModel of the loaded model, EMA decay 0.9, updated after each step
    swa = AveragedModel(twin, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=False)
    opt.step()
    adam.step()
    swa.update_parameters(twin)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=name)
    for (name, _), s, q in zip(model.named_parameters(), opt.swa_views(), swa.module.parameters()):
        torch.testing.assert_close(s, q.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_training_run_from_a_reference_checkpoint_logs_its_sha256(tmp_path, tiny_store):
    """`scalefold train --init-from` trains from the file and logs init_checkpoint_sha256sum (before init_stop)."""
    path = tmp_path / "ref.pt"
    _reference_checkpoint(path)
    out = tmp_path / "run"
    rc = main(["train", "--preset", "tiny", "--out", str(out), "--store", str(tiny_store), "--init-from", str(path),
               "--max-steps", "1", "--eval-every", "0", "--checkpoint-every", "1"])  # fmt: skip
    assert rc == 0
    recs = [json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in (out / "mlperf.log").read_text().splitlines()]
    keys = [r["key"] for r in recs]
    assert keys.index("init_checkpoint_sha256sum") < keys.index("init_stop")
    logged = next(r["value"] for r in recs if r["key"] == "init_checkpoint_sha256sum")
    assert logged == hashlib.sha256(path.read_bytes()).hexdigest()
    ckpt = torch.load(out / "checkpoints" / "checkpoint_00000001.pt", weights_only=True)
    assert float(ckpt["optimizer_state_dict"]["state"][0]["step"]) == 4.0  # 3 reference steps + 1


def _refused(path: Path) -> str:
    cfg = _tiny_cfg()
    model = build_model(cfg, build_model_config(cfg), torch.device("cpu"), torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = FlatAdamSWA(list(model.named_parameters()), lr=1e-3, eps=1e-6)
    with pytest.raises(CheckpointError) as info:
        init_from_checkpoint(str(path), model, opt)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing half-loaded
    assert opt.num_steps == 0
    return str(info.value)


def test_checkpoint_of_another_config_is_refused_listing_the_mismatches(tmp_path):
    """A checkpoint of the demo model, a reshaped tensor, or a dropped tensor: refused, names listed."""
    demo = AlphaFold(AlphaFoldConfig.from_preset("demo"), activation_checkpointing=False)
    torch.save({"alphafold_state_dict": demo.state_dict(), "iteration": 0}, tmp_path / "demo.pt")
    message = _refused(tmp_path / "demo.pt")
    assert "demo.pt" in message and "do not match" in message and "mis-shaped" in message

    ref = _reference_checkpoint(tmp_path / "ref.pt")
    name = next(iter(ref["alphafold_state_dict"]))
    bad = dict(ref)
    bad["alphafold_state_dict"] = {**ref["alphafold_state_dict"], name: torch.zeros(3, 3)}
    torch.save(bad, tmp_path / "reshaped.pt")
    assert f"{name} (3, 3) vs" in _refused(tmp_path / "reshaped.pt")

    bad["alphafold_state_dict"] = {k: v for k, v in ref["alphafold_state_dict"].items() if k != name}
    torch.save(bad, tmp_path / "dropped.pt")
    message = _refused(tmp_path / "dropped.pt")
    assert "1 missing" in message and name in message

    moments = {**ref["optimizer_state_dict"], "state": dict(ref["optimizer_state_dict"]["state"])}
    moments["state"][0] = {**moments["state"][0], "exp_avg": torch.zeros(2)}
    torch.save({**ref, "optimizer_state_dict": moments}, tmp_path / "moments.pt")
    assert "param 0 exp_avg (2,)" in _refused(tmp_path / "moments.pt")


def test_corrupt_or_foreign_files_are_refused(tmp_path, tiny_store):
    """Truncated files, non-checkpoints and missing files: a clear error naming the file; the CLI exits 3."""
    _reference_checkpoint(tmp_path / "ref.pt")
    data = (tmp_path / "ref.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 3])
    assert "cut.pt" in _refused(tmp_path / "cut.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    assert "not a reference checkpoint" in _refused(tmp_path / "other.pt")
    assert "not found" in _refused(tmp_path / "missing.pt")
    rc = main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--store", str(tiny_store),
               "--init-from", str(tmp_path / "cut.pt"), "--max-steps", "1", "--eval-every", "0"])  # fmt: skip
    assert rc == EXIT_USER_ERROR


def test_only_the_logging_rank_hashes_the_checkpoint(tmp_path, monkeypatch):
    """init_from_checkpoint(hash_file=False) loads without hashing (the loop hashes on the logging rank only
    and broadcasts the hash to the other training ranks)."""
    from scalefold.train import run_checkpoints as checkpointing

    path = tmp_path / "ref.pt"
    _reference_checkpoint(path)
    calls = []
    real = checkpointing.sha256sum
    monkeypatch.setattr(checkpointing, "sha256sum", lambda p: (calls.append(p), real(p))[1])
    cfg = _tiny_cfg()
    model = build_model(cfg, build_model_config(cfg), torch.device("cpu"), torch.float32)
    opt = FlatAdamSWA(list(model.named_parameters()), lr=1e-3, eps=1e-6)
    assert init_from_checkpoint(str(path), model, opt, hash_file=False) == (ITERATION, None)
    assert calls == []
    assert init_from_checkpoint(str(path), model, opt)[1] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(calls) == 1


@pytest.mark.distributed
def test_two_training_ranks_share_the_logging_ranks_hash(tmp_path, tiny_store):
    """2 data-parallel ranks (torch.distributed.run, gloo) with --init-from: the logging rank hashes the file
    and broadcasts the hash over the training group; the run ends and logs the file's sha256."""
    import os
    import socket
    import subprocess
    import sys

    path = tmp_path / "ref.pt"
    _reference_checkpoint(path)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DGXSYSTEM"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "scalefold", "train", "--preset", "tiny", "--out", str(out), "--store", str(tiny_store),
           "--init-from", str(path), "--max-steps", "1", "--eval-every", "0", "--checkpoint-every", "0"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in (out / "mlperf.log").read_text().splitlines()]
    logged = next(r["value"] for r in recs if r["key"] == "init_checkpoint_sha256sum")
    assert logged == hashlib.sha256(path.read_bytes()).hexdigest()
    assert proc.stdout.count(f"sha256 {logged}") == 1  # printed by the logging rank
