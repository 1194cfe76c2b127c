"""``tflops`` / ``mfu`` in every step's record: the FLOP table ``scalefold train`` counts once per
configuration (cached on disk), and the Trainer's arithmetic with a known device peak."""

from __future__ import annotations

import json

import pytest

from scalefold.cli import main
from scalefold.config.training import TrainConfig
from scalefold.train.trainer import RunHooks, train


def _steps(path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def test_a_cpu_run_logs_tflops_and_the_count_is_cached(tmp_path, monkeypatch, capsys):
    """The CLI counts the tiny step's FLOPs (no GPU: no peak, so tflops without mfu), prints the median in
    the summary, and a second run of the same configuration reads the count from the cache."""
    monkeypatch.setenv("SCALEFOLD_COUNT_FLOPS", "1")
    monkeypatch.setenv("SCALEFOLD_FLOPS_CACHE", str(tmp_path / "flops"))
    args = ["train", "--preset", "tiny", "--store", str(tmp_path / "store.h5"), "--max-steps", "2",
            "--eval-every", "0", "--checkpoint-every", "0", "--no-progress"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    records = _steps(tmp_path / "a" / "metrics.jsonl")
    assert len(records) == 2 and all(r["tflops"] > 0 and "mfu" not in r for r in records)
    assert "step throughput:" in capsys.readouterr().out
    assert len(list((tmp_path / "flops").glob("*.json"))) == 1

    from scalefold.perf import flops

    def no_count(*args, **kwargs):
        raise AssertionError("counted again instead of reading the cache")

    monkeypatch.setattr(flops, "count_step", no_count)
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert all(r["tflops"] > 0 for r in _steps(tmp_path / "b" / "metrics.jsonl"))


def test_mfu_is_model_flops_over_the_peak(tmp_path):
    """With a FLOP table and a device peak the Trainer logs tflops (executed FLOPs), mfu (model FLOPs) and
    hfu (executed) of each step from its own step time."""
    cfg = TrainConfig.from_preset("tiny", overrides={"out": str(tmp_path / "run"), "store": str(tmp_path / "s.h5"),
                                                     "max_steps": 2, "eval_every": 0, "checkpoint_every": 0}, env={})  # fmt: skip
    table = {0: (3e9, 2e9), 1: (5e9, 4e9)}
    result = train(cfg, RunHooks(flops=table, peak_flops=1e12, device_name="a test GPU"))
    for r in _steps(tmp_path / "run" / "metrics.jsonl"):
        executed, model = table[r["recycling_iters"]]
        seconds = executed / r["tflops"] / 1e12
        assert r["mfu"] == pytest.approx(model / seconds / 1e12) and r["hfu"] == pytest.approx(executed / seconds / 1e12)
    assert [m for _, m in result.throughput] and result.device_name == "a test GPU"
