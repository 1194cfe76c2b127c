"""End-to-end ``scalefold train`` on the ``tiny`` preset: a tiny synthetic store, 3 steps, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scalefold.cli import main
from scalefold.train.config import TrainConfig
from scalefold.train.loop import recycling_count, train


def _records(path):
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in lines if "loss" in r], [r for r in lines if "eval_lddt_ca" in r]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    store = root / "store.h5"
    cfg = TrainConfig.from_preset("tiny", overrides={"out": str(root / "run"), "store": str(store)}, env={})
    return cfg, train(cfg)


def test_tiny_run_writes_metrics_log_and_plot(tiny_run):
    """3 steps on a synthesised store: metrics.jsonl has steps 1..3 with finite losses, eval records
    carry eval_lddt_ca, and the MLPerf log (run_start .. run_stop) and the PNG curves exist."""
    cfg, result = tiny_run
    out = result.out
    train_recs, eval_recs = _records(out / "metrics.jsonl")
    assert [r["step"] for r in train_recs] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train_recs)
    assert all(0 <= r["recycling_iters"] <= cfg.num_recycling_iters for r in train_recs)
    assert [r["step"] for r in eval_recs] == [0, 2]
    assert all(0.0 <= r["eval_lddt_ca"] <= 1.0 for r in eval_recs)
    log = (out / "mlperf.log").read_text()
    for key in ("init_start", "run_start", "epoch_start", "eval_accuracy", "run_stop"):
        assert f'"key": "{key}"' in log, key
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "checkpoints" / "checkpoint_00000002.pt").exists()


def test_resume_continues_from_checkpoint(tiny_run):
    """--resume (via the CLI) restarts after the step-2 checkpoint: steps 1..2 are kept, 3..4 are
    trained again/anew, and the run ends at --max-steps 4."""
    cfg, _ = tiny_run
    rc = main(["train", "--preset", "tiny", "--out", cfg.out, "--store", cfg.store, "--resume", "--max-steps", "4"])
    assert rc == 0
    train_recs, _ = _records(Path(cfg.out) / "metrics.jsonl")
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in train_recs)


def test_recycling_count_is_seeded_and_in_range():
    """The per-step recycling count is a pure function of (seed, step), uniform over {0..R-1}."""
    draws = [recycling_count(7, s, 4) for s in range(1, 401)]
    assert draws == [recycling_count(7, s, 4) for s in range(1, 401)]
    assert set(draws) == {0, 1, 2, 3}


def test_env_and_flags_override_preset():
    """Precedence: preset < SCALEFOLD_* environment < explicit overrides."""
    cfg = TrainConfig.from_preset("tiny", overrides={"seed": 5}, env={"SCALEFOLD_MAX_STEPS": "7", "SCALEFOLD_SEED": "3"})
    assert (cfg.max_steps, cfg.seed) == (7, 5)
