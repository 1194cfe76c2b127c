"""``scalefold evaluate``: the training validation split, per-target scores, reports, bad input."""

from __future__ import annotations

import csv
import json

import pytest

from scalefold.cli import main
from scalefold.config.training import TrainConfig
from scalefold.evaluation.scoring import score_batches as loop_evaluate
from scalefold.inference.evaluate import evaluate, validation_chains
from scalefold.inference.weights import InferenceError, load_model
from scalefold.train.trainer import train


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step ``tiny`` training run (synthesises its store) with a step-2 checkpoint and evaluation."""
    root = tmp_path_factory.mktemp("evaluate")
    overrides = {"out": str(root / "run"), "store": str(root / "store.h5"), "max_steps": 2}
    cfg = TrainConfig.from_preset("tiny", overrides=overrides, env={})
    result = train(cfg)
    return cfg, result, result.out / "checkpoints" / "checkpoint_00000002.pt"


def test_evaluate_reproduces_the_training_evaluation(tiny_run):
    """The default targets are the training run's validation chains, and the SWA weights of the
    step-2 checkpoint score exactly the eval_lddt_ca training logged at step 2."""
    cfg, result, checkpoint = tiny_run
    report = evaluate(cfg.store, checkpoint, progress=False)
    assert (report.preset, report.weights, report.iteration) == ("tiny", "swa", 2)
    assert [t.chain_id for t in report.targets] == validation_chains(cfg.store, "tiny")
    assert len(report.targets) == cfg.eval_max_chains
    assert report.num_recycling_iters == cfg.num_recycling_iters
    logged = dict(result.eval_history)[2]
    assert report.mean_lddt_ca == pytest.approx(logged, abs=1e-6)


def test_per_target_scores_equal_the_loop_evaluator(tiny_run):
    """Every target's lDDT-Cα equals the training loop's evaluator on that target alone, and the
    mean over the whole validation window (--max-chains 0) equals the evaluator's mean."""
    from scalefold.data.dataset import StoreSample
    from scalefold.data.pipeline import FeatureConfig

    cfg, _, checkpoint = tiny_run
    chains = validation_chains(cfg.store, "tiny", max_chains=0)
    assert len(chains) >= 2
    report = evaluate(cfg.store, checkpoint, max_chains=0, weights="model", progress=False)
    assert [t.chain_id for t in report.targets] == chains
    loaded = load_model(checkpoint, weights="model")
    sample = StoreSample(cfg.store, chains, FeatureConfig.from_reference_config(loaded.config.to_dict()), mode="eval")
    batches = [sample(i, 0) for i in range(len(chains))]
    for target, batch in zip(report.targets, batches):
        assert target.lddt_ca == pytest.approx(loop_evaluate(loaded.model, [batch], autocast=False), abs=1e-6)
        assert target.length == batch["aatype"].shape[1] and 0.0 <= target.mean_plddt <= 100.0
    assert report.mean_lddt_ca == pytest.approx(loop_evaluate(loaded.model, batches, autocast=False), abs=1e-6)


def test_cli_table_and_reports(tiny_run, tmp_path, capsys):
    cfg, _, checkpoint = tiny_run
    chains = validation_chains(cfg.store, "tiny", max_chains=0)[:2]
    args = ["evaluate", "--store", cfg.store, "--checkpoint", str(checkpoint), "--no-progress", "--chains", *chains]
    assert main([*args, "--out", str(tmp_path / "r.json")]) == 0
    stdout = capsys.readouterr().out
    assert all(c in stdout for c in chains) and "mean lDDT-Cα:" in stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert [t["chain_id"] for t in data["targets"]] == chains and data["num_targets"] == 2
    mean = sum(t["lddt_ca"] for t in data["targets"]) / 2
    assert data["mean_lddt_ca"] == pytest.approx(mean) and f"{mean:.4f}" in stdout
    assert main([*args, "--out", str(tmp_path / "r.csv")]) == 0
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert [r["chain_id"] for r in rows] == [*chains, "mean"]
    assert float(rows[-1]["lddt_ca"]) == pytest.approx(mean, abs=1e-6)


def test_bad_input_is_refused(tiny_run, tmp_path, capsys):
    cfg, _, checkpoint = tiny_run
    with pytest.raises(InferenceError, match=r"unknown chain ids \['nope_A'\]"):
        evaluate(cfg.store, checkpoint, chains=["nope_A"], progress=False)
    base = ["evaluate", "--checkpoint", str(checkpoint), "--no-progress"]
    cases = [
        (["--store", str(tmp_path / "missing.h5")], "missing.h5 does not exist"),
        (["--store", cfg.store, "--out", str(tmp_path / "r.txt")], "expected a file name ending in .json or .csv"),
        (["--store", cfg.store, "--preset", "demo"], "does not fit the 'demo' preset"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 3
        assert message in capsys.readouterr().err
