"""Cα-trace pictures (superposition) and the shipped-initial-checkpoint export / verification."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scalefold.checkpoint.shipped import (
    Manifest,
    ShippedCheckpointError,
    export_init_checkpoint,
    manifest_path,
    verify_shipped,
)
from scalefold.config.training import TrainConfig
from scalefold.inference.trace_plot import kabsch_superpose, plot_checkpoints_on_chain, rmsd
from scalefold.train.trainer import train


def _rotation(seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def test_kabsch_recovers_a_rigid_motion_and_never_reflects():
    rng = np.random.default_rng(0)
    target = rng.normal(scale=10.0, size=(40, 3))
    mobile = target @ _rotation(1).T + np.array([5.0, -3.0, 12.0])
    mask = np.ones(40, bool)
    mask[::7] = False  # unresolved rows are ignored for the fit but moved too
    moved = kabsch_superpose(mobile, target, mask)
    np.testing.assert_allclose(moved, target, atol=1e-9)
    mirror = target * np.array([1.0, 1.0, -1.0])  # a mirror image cannot be superposed exactly
    assert rmsd(kabsch_superpose(mirror, target), target, np.ones(40, bool)) > 1.0
    with pytest.raises(ValueError, match="at least 3"):
        kabsch_superpose(mobile, target, np.eye(1, 40, dtype=bool)[0])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace")
    overrides = {"out": str(root / "run"), "store": str(root / "store.h5"), "max_steps": 2, "checkpoint_every": 2}
    cfg = TrainConfig.from_preset("tiny", overrides=overrides, env={})
    result = train(cfg)
    return cfg, result.out / "checkpoints" / "checkpoint_00000002.pt"


def test_export_verify_and_refuse_a_corrupted_shipped_checkpoint(tiny_run, tmp_path):
    cfg, source = tiny_run
    out = tmp_path / "init.pt"
    manifest = export_init_checkpoint(source, out, eval_lddt_ca=0.123, eval_chains=["x"],
                                      source_command="scalefold train ...", export_command="scalefold export ...")  # fmt: skip
    assert Manifest.read(manifest_path(out)) == manifest
    assert verify_shipped(out).sha256 == manifest.sha256
    shipped = torch.load(out, weights_only=True)
    assert set(shipped) >= {"alphafold_state_dict", "optimizer_state_dict", "iteration"} and shipped["iteration"] == 2
    swa = torch.load(source, weights_only=True)["swa_state_dict"]
    name, value = next(iter(shipped["alphafold_state_dict"].items()))
    assert torch.equal(value, swa["averaged_model.module." + name])  # the SWA weights were shipped

    out.write_bytes(out.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(ShippedCheckpointError, match=f"(?s)does not match the manifest's {manifest.sha256}.*scalefold train"):
        verify_shipped(out)
    out.unlink()
    with pytest.raises(ShippedCheckpointError, match=f"missing \\(expected sha256 {manifest.sha256}\\)"):
        verify_shipped(out)


def test_trace_picture_scores_like_evaluation(tiny_run, tmp_path):
    from scalefold.inference.evaluate import evaluate, validation_chains

    cfg, checkpoint = tiny_run
    chain = validation_chains(cfg.store, "tiny", max_chains=0)[0]
    png, traces = plot_checkpoints_on_chain(
        cfg.store, chain, [("model", checkpoint), ("swa", checkpoint)], tmp_path / "trace.png", weights=["model", "swa"]
    )
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    report = evaluate(cfg.store, checkpoint, chains=[chain], weights="swa", progress=False)
    assert traces[1].lddt_ca == pytest.approx(report.targets[0].lddt_ca, abs=1e-6)
    assert [t.label for t in traces] == ["model", "swa"]


def test_training_from_a_shipped_checkpoint_checks_it_and_refuses_a_met_target(tiny_run, tmp_path, capsys):
    """--init-from a checkpoint with a manifest: a corrupted file and a target the checkpoint already
    meets are refused before anything runs (exit 3, the expected sha256 / the starting lDDT-Cα named);
    an intact one trains, prints `init checkpoint: PATH` and the time to train."""
    from scalefold.cli import main

    cfg, source = tiny_run
    init = tmp_path / "init.pt"
    export_init_checkpoint(source, init, eval_lddt_ca=0.5, eval_chains=[], source_command="scalefold train X")
    base = ["train", "--preset", "tiny", "--store", cfg.store, "--init-from", str(init), "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "met"), "--target-lddt", "0.4"]) == 3
    assert "already met by the starting checkpoint" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "ok"), "--target-lddt", "0.9", "--max-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert f"init checkpoint: {init}\n" in out and "time to train: " in out
    good = init.read_bytes()
    init.write_bytes(good[:-4] + b"\0\0\0\0")
    assert main([*base, "--out", str(tmp_path / "bad"), "--target-lddt", "0.9"]) == 3
    err = capsys.readouterr().err
    assert "does not match the manifest's" in err and "scalefold train X" in err


def test_export_init_checkpoint_command_measures_the_written_file(tiny_run, tmp_path, capsys):
    """`scalefold export-init-checkpoint` (the command that regenerates the shipped checkpoint, at small
    scale): the manifest's lDDT-Cα and chains are an evaluation of the exported file itself."""
    from scalefold.cli import main
    from scalefold.inference.evaluate import evaluate

    cfg, source = tiny_run
    out = tmp_path / "init.pt"
    assert main(["export-init-checkpoint", "--from", str(source), "--store", cfg.store, "--out", str(out),
                 "--source-command", "scalefold train --preset tiny"]) == 0  # fmt: skip
    manifest = verify_shipped(out)
    report = evaluate(cfg.store, out, weights="model", progress=False)
    assert manifest.eval_lddt_ca == pytest.approx(report.mean_lddt_ca, abs=1e-12)
    assert manifest.eval_chains == [t.chain_id for t in report.targets] and manifest.eval_chains
    assert manifest.source_command == "scalefold train --preset tiny"
    assert manifest.export_command.startswith(f"scalefold export-init-checkpoint --from {source} --store ")
    assert f"lDDT-Cα {manifest.eval_lddt_ca:.4f}" in capsys.readouterr().out


def test_the_two_stage_recipe_at_small_scale(tiny_run, tmp_path):
    """The shipped checkpoint's recipe (docs/demo.md, 'The shipped initial checkpoint'), at small scale: stage 1's
    export starts a run with more structure-module iterations (what the ``demo`` preset does), whose own
    export carries those iterations, so its manifest's lDDT-Cα is the score stage 2 measured."""
    from scalefold.cli import main

    cfg, stage1 = tiny_run
    init = tmp_path / "stage1.pt"
    assert main(["export-init-checkpoint", "--from", str(stage1), "--store", cfg.store, "--out", str(init)]) == 0
    overrides = {"out": str(tmp_path / "stage2"), "store": cfg.store, "init_from": str(init), "target_lddt": 1.0,
                 "structure_module_iterations": 4, "warmup_steps": 0, "max_steps": 2, "eval_every": 2,
                 "checkpoint_every": 2}  # fmt: skip
    result = train(TrainConfig.from_preset("tiny", overrides=overrides, env={}))
    assert result.status == "aborted" and result.steps == 2  # target 1: a run that never stops early
    stage2 = result.out / "checkpoints" / "checkpoint_00000002.pt"
    out = tmp_path / "shipped.pt"
    assert main(["export-init-checkpoint", "--from", str(stage2), "--store", cfg.store, "--out", str(out)]) == 0
    shipped = torch.load(out, weights_only=True)
    assert shipped["model_options"]["structure_module_iterations"] == 4
    assert verify_shipped(out).eval_lddt_ca == pytest.approx(result.eval_history[-1][1], abs=1e-9)
