"""Bit-for-bit resume in deterministic mode: 2 steps + ``--resume`` to 4 == 4 steps straight."""

from __future__ import annotations

import json

import pytest
import torch

from scalefold.checkpoint.files import load_checkpoint
from scalefold.config.training import TrainConfig
from scalefold.train.trainer import train


def _losses(path):
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r], [r for r in records if "eval_lddt_ca" in r]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("resume") / "store.h5"


def _cfg(out, store, **kw):
    overrides = {
        "out": str(out), "store": str(store), "deterministic": True, "precision": "fp64", "eval_every": 2,
        "checkpoint_every": 2, "num_workers": 1, **kw,
    }  # fmt: skip
    return TrainConfig.from_preset("tiny", overrides=overrides, env={})


def test_resume_is_bit_for_bit(tmp_path, store, capsys):
    """Per-step losses (exact float equality), eval scores and the final weights, SWA and Adam state agree;
    the time to train of the resumed run is summed over both segments."""
    straight = train(_cfg(tmp_path / "straight", store, max_steps=4))
    assert straight.steps == 4
    first = train(_cfg(tmp_path / "split", store, max_steps=2))
    assert first.steps == 2
    carried = load_checkpoint(tmp_path / "split" / "checkpoints" / "checkpoint_00000002.pt")["time_to_train"]
    assert carried["segments"] == 1 and 0 < carried["seconds"] <= first.time_to_train_s
    capsys.readouterr()
    resumed = train(_cfg(tmp_path / "split", store, max_steps=4, resume=True))
    assert resumed.steps == 4
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("time to train:"))
    assert f"2 segments: {carried['seconds']:.1f} s up to the checkpoint of step 2 + " in line
    assert resumed.time_to_train_s > carried["seconds"]
    total, segment = float(line.split()[3]), float(line.split(" + ")[1].split()[0])
    assert total == pytest.approx(carried["seconds"] + segment, abs=0.11)  # printed to 0.1 s
    # the "before" of the resumed run's lDDT-Cα is the run's first evaluation, not the segment's
    assert "eval lDDT-Cα" in line and "at step 0 ->" in line
    final = load_checkpoint(tmp_path / "split" / "checkpoints" / "checkpoint_00000004.pt")["time_to_train"]
    assert final["segments"] == 2 and final["seconds"] > carried["seconds"]

    losses_a, evals_a = _losses(tmp_path / "straight" / "metrics.jsonl")
    losses_b, evals_b = _losses(tmp_path / "split" / "metrics.jsonl")
    assert [s for s, _ in losses_a] == [1, 2, 3, 4]
    assert losses_a == losses_b  # exact
    assert [(r["step"], r["eval_lddt_ca"]) for r in evals_a] == [(r["step"], r["eval_lddt_ca"]) for r in evals_b]

    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "checkpoint_00000004.pt")
    b = load_checkpoint(tmp_path / "split" / "checkpoints" / "checkpoint_00000004.pt")
    for key in ("alphafold_state_dict", "swa_state_dict"):
        assert a[key].keys() == b[key].keys()
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    for i, st in a["optimizer_state_dict"]["state"].items():
        other = b["optimizer_state_dict"]["state"][i]
        assert torch.equal(st["exp_avg"], other["exp_avg"]) and torch.equal(st["exp_avg_sq"], other["exp_avg_sq"])
    assert a["data_position"] == b["data_position"] == {"samples_consumed": 4}


def test_sample_stream_does_not_depend_on_max_steps():
    """Position p of a rank's stream is the same whatever the run length or resume point."""
    from scalefold.train.training_data import STREAM_BLOCK, sample_pairs

    weights = [1.0, 2.0, 3.0, 0.5, 4.0]
    whole = sample_pairs(weights, 7, 0, STREAM_BLOCK + 10, rank=1, world_size=2)
    assert sample_pairs(weights, 7, 0, 5, rank=1, world_size=2) == whole[:5]
    assert sample_pairs(weights, 7, STREAM_BLOCK - 3, STREAM_BLOCK + 10, rank=1, world_size=2) == whole[STREAM_BLOCK - 3 :]
    other_rank = sample_pairs(weights, 7, 0, STREAM_BLOCK + 10, rank=0, world_size=2)
    assert other_rank != whole  # each data-parallel rank draws its own samples
    assert sample_pairs(weights, 8, 0, 50) != sample_pairs(weights, 7, 0, 50)
    with pytest.raises(ValueError):
        sample_pairs(weights, 7, 5, 3)


def test_model_options_travel_with_the_checkpoint(tmp_path, store):
    """A run's structure-module iterations (no parameter shape shows them) are recorded in its checkpoints:
    inference rebuilds that model, an export keeps them, and a resume with other options is refused."""
    from scalefold.checkpoint.adapters import CheckpointError
    from scalefold.checkpoint.shipped import export_init_checkpoint
    from scalefold.inference.weights import load_model

    train(_cfg(tmp_path / "sm3", store, max_steps=2, structure_module_iterations=3))
    path = tmp_path / "sm3" / "checkpoints" / "checkpoint_00000002.pt"
    assert load_checkpoint(path)["model_options"]["structure_module_iterations"] == 3
    assert load_model(path).config.structure_module_config.num_blocks == 3
    exported = tmp_path / "init.pt"
    export_init_checkpoint(path, exported, eval_lddt_ca=0.1, eval_chains=[])
    assert load_model(exported).config.structure_module_config.num_blocks == 3
    with pytest.raises(CheckpointError, match="model options"):
        train(_cfg(tmp_path / "sm3", store, max_steps=4, resume=True))  # the preset's 2 iterations


def test_resume_with_another_model_preset_is_refused_with_a_hint(tmp_path, store, capsys, monkeypatch):
    """A checkpoint of other widths (another model preset) is refused (exit 3): a checkpoint that records its
    model preset by name, and one that does not (written before the record existed) with the mismatching
    shapes and a line naming the model preset this run builds and SCALEFOLD_MODEL_PRESET."""
    from scalefold.checkpoint.files import save_atomic
    from scalefold.cli import main

    train(_cfg(tmp_path / "run", store, max_steps=2))
    capsys.readouterr()
    argv = ["train", "--preset", "tiny", "--no-progress", "--store", str(store), "--out", str(tmp_path / "run"),
            "--max-steps", "4", "--resume"]  # fmt: skip
    monkeypatch.setenv("SCALEFOLD_MODEL_PRESET", "demo")
    assert main(argv) == 3
    assert "checkpoint of model preset 'tiny', this run builds 'demo'" in capsys.readouterr().err
    path = tmp_path / "run" / "checkpoints" / "checkpoint_00000002.pt"
    ckpt = load_checkpoint(path)
    del ckpt["model_preset"]
    save_atomic(ckpt, path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 3 and "mis-shaped" in err
    assert "this run builds the 'demo' model preset" in err and "SCALEFOLD_MODEL_PRESET" in err
