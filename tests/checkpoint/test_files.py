"""Checkpoint files: atomic writes, keep-last-k, refusing damaged files, RNG round trip, sha256."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from scalefold.checkpoint.files import (
    CheckpointError,
    CheckpointManager,
    build_checkpoint,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_atomic,
    sha256sum,
)
from scalefold.optim.adam_swa import FlatAdamSWA


def _checkpoint(iteration: int) -> dict:
    torch.manual_seed(iteration)
    model = nn.Linear(4, 3)
    opt = FlatAdamSWA(list(model.named_parameters()))
    model.weight.grad.fill_(0.1)
    opt.step()
    return build_checkpoint(
        model.state_dict(), opt.state_dict(), iteration, swa_state=opt.swa_state_dict(),
        rng_state=capture_rng_state(), data_position={"sample_index": 17 * iteration, "epoch": 0},
    )  # fmt: skip


def test_round_trip_with_weights_only_loading(tmp_path):
    """A checkpoint (model, Adam-layout optimizer, SWA, RNG, data position, iteration) loads back with
    torch.load(weights_only=True) and keeps the reference keys."""
    ckpt = _checkpoint(3)
    path = save_atomic(ckpt, tmp_path / "c.pt")
    loaded = load_checkpoint(path)
    assert {"alphafold_state_dict", "optimizer_state_dict", "iteration"} <= loaded.keys()
    assert loaded["iteration"] == 3 and loaded["data_position"] == {"sample_index": 51, "epoch": 0}
    for k, v in ckpt["alphafold_state_dict"].items():
        assert torch.equal(loaded["alphafold_state_dict"][k], v)
    assert int(loaded["swa_state_dict"]["averaged_model.n_averaged"]) == 1
    assert float(loaded["optimizer_state_dict"]["state"][0]["step"]) == 1.0


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    """A write that dies midway (after writing part of the bytes) leaves the previous checkpoint intact
    and no temporary file behind."""
    path = tmp_path / "c.pt"
    save_atomic(_checkpoint(1), path)
    before = sha256sum(path)

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial bytes")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="simulated"):
        save_atomic(_checkpoint(2), path)
    assert sha256sum(path) == before
    assert load_checkpoint(path)["iteration"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_damaged_files_are_refused_with_clear_error(tmp_path, damage):
    """Truncated, empty or garbage files raise CheckpointError naming the file (never a half-load)."""
    path = save_atomic(_checkpoint(1), tmp_path / "c.pt")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "empty": b"", "garbage": b"\x00not a checkpoint" * 10}[damage])
    with pytest.raises(CheckpointError, match="c.pt"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_keep_last_k_and_fallback_to_older(tmp_path):
    """The manager keeps the newest k checkpoints; a damaged newest one is skipped on load."""
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=2)
    for it in (10, 20, 30):
        manager.save(_checkpoint(it))
    assert [it for it, _ in manager.checkpoints()] == [20, 30]
    manager.latest().write_bytes(b"torn")
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        assert manager.load_latest()["iteration"] == 20
    assert CheckpointManager(tmp_path / "none").load_latest() is None


def test_rng_state_round_trip():
    """torch, numpy and Python RNG states restore exactly (deterministic resume)."""
    state = capture_rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_sha256_is_streamed_and_correct(tmp_path):
    """sha256sum equals hashlib over the whole file for sizes spanning several chunks."""
    path = tmp_path / "blob"
    payload = bytes(range(256)) * 5000
    path.write_bytes(payload)
    assert sha256sum(path, chunk_bytes=4096) == hashlib.sha256(payload).hexdigest()


def test_load_resumable_falls_back_or_refuses_listing_every_file(tmp_path):
    """load_resumable: None without checkpoint files; the newest that loads (with the errors of the newer
    ones); CheckpointError listing every file when none loads."""
    manager = CheckpointManager(tmp_path / "ckpts", keep_last=None)
    assert manager.load_resumable() is None
    manager.save(_checkpoint(10))
    manager.save(_checkpoint(20))
    newest = manager.path_for(20)
    newest.write_bytes(newest.read_bytes()[:50])
    path, ckpt, skipped = manager.load_resumable()
    assert path == manager.path_for(10) and ckpt["iteration"] == 10
    assert len(skipped) == 1 and "checkpoint_00000020.pt" in skipped[0]
    manager.path_for(10).write_bytes(b"")
    with pytest.raises(CheckpointError, match="none of the 2 checkpoint file") as info:
        manager.load_resumable()
    assert "checkpoint_00000010.pt is empty" in str(info.value) and "checkpoint_00000020.pt" in str(info.value)
