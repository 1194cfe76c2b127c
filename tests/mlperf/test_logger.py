"""MLPerf log: key order and values, rank gating, instance metadata, official compliance checker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scalefold.mlperf.logger import (
    INIT_BLOCK_KEYS,
    MLPerfLogger,
    MLPerfRunInfo,
    check_log,
    cycle_of_iteration,
    epoch_num,
    parse_checker_output,
    run_compliance_checker,
)

REFERENCE_SHA = "b518be4677048f2c0f94889c91e2da73655a73b825a8aa7f8b6f5e580d8ffbed"
GLOBAL_BATCH = 2
VAL_EVERY = 40

# What a small CPU run cannot meet: dataset sizes, the full model, the reference checkpoint, the
# 0.8 target, and the crop size the tiny preset changes.
SMALL_RUN_FAILURES = [
    "eval_accuracy",
    "eval_samples",
    "init_checkpoint_sha256sum",
    "model_parameters_count",
    "train_samples",
    "train_sequence_crop_size",
]


def _records(path: Path) -> list[dict]:
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith(":::MLLOG")]
    return [json.loads(ln[len(":::MLLOG ") :]) for ln in lines]


def _write_run(path: Path, info: MLPerfRunInfo, accuracies: list[float], counts: tuple[int, int], status: str):
    with MLPerfLogger(path) as log:
        log.init_start()
        log.log_init_block(info)
        log.staging_start()
        log.staging_stop(0.1)
        log.init_stop_run_start()
        log.dataset_info(counts[0], counts[1], "InitialTrainingDataloaderPQ")
        for cycle, acc in enumerate(accuracies, start=1):
            n = epoch_num(cycle, info.global_batch_size, info.val_every_iters)
            log.epoch_start(n)
            log.epoch_stop(n)
            log.eval_start(n)
            log.eval_accuracy(acc, n)
            log.eval_stop(n)
        log.run_stop(status)


def _small_info() -> MLPerfRunInfo:
    return MLPerfRunInfo(global_batch_size=GLOBAL_BATCH, train_sequence_crop_size=16, model_parameters_count=1234,
                         init_checkpoint_sha256sum="0" * 64)  # fmt: skip


def test_log_order_and_values(tmp_path):
    """Keys appear in the MLPerf rules' order with the configured values;
    epoch_num counts samples (cycle x global batch x 40)."""
    path = tmp_path / "run.log"
    _write_run(path, _small_info(), [0.5, 0.6], (10, 3), "aborted")
    recs = _records(path)
    keys = [r["key"] for r in recs]
    init = ["init_start", "cache_clear", *INIT_BLOCK_KEYS, "staging_start", "staging_stop", "init_stop", "run_start"]
    cycle = ["epoch_start", "epoch_stop", "eval_start", "eval_accuracy", "eval_stop"]
    tail = ["train_samples", "eval_samples", "initial_training_dataloader_type", *cycle, *cycle, "run_stop"]
    assert keys == init + tail
    by_key = {r["key"]: r for r in recs}
    assert by_key["submission_benchmark"]["value"] == "openfold"
    assert by_key["submission_platform"]["value"] == "1xcpu"
    assert by_key["opt_adam_epsilon"]["value"] == 1e-6 and by_key["swa_decay_rate"]["value"] == 0.9
    assert by_key["run_stop"]["metadata"]["status"] == "aborted"
    evals = [r for r in recs if r["key"] == "eval_accuracy"]
    assert [r["metadata"]["epoch_num"] for r in evals] == [GLOBAL_BATCH * VAL_EVERY, 2 * GLOBAL_BATCH * VAL_EVERY]
    assert cycle_of_iteration(40, 40) == 1 and cycle_of_iteration(41, 40) == 2


def test_compliance_checker_lists_exactly_the_rules_a_small_run_cannot_meet(tmp_path):
    """The official checker (hpc 3.0.0) rejects a small run's log only for the listed rules."""
    path = tmp_path / "small.log"
    _write_run(path, _small_info(), [0.5, 0.6], (10, 3), "aborted")
    ok, failed = run_compliance_checker(path)
    assert not ok
    assert failed == SMALL_RUN_FAILURES


def test_compliance_checker_accepts_a_benchmark_shaped_log(tmp_path):
    """With benchmark values (dataset counts, 93,229,082 parameters, reference checkpoint hash,
    accuracy >= 0.8, status success) the same writer produces a log the checker accepts."""
    path = tmp_path / "full.log"
    info = MLPerfRunInfo(global_batch_size=256, number_of_ranks=2080, number_of_nodes=260, accelerators_per_node=8,
                         precision="bf16", init_checkpoint_sha256sum=REFERENCE_SHA)  # fmt: skip
    _write_run(path, info, [0.75, 0.81], (594595, 180), "success")
    report = check_log(path)
    assert report.ok, report.output
    assert report.failed_rules == []


def test_missing_required_key_is_reported(tmp_path):
    """Dropping a required key (swa_decay_rate) makes the checker fail on exactly that key (+ small-run ones)."""
    path = tmp_path / "missing.log"
    _write_run(path, _small_info(), [0.5], (10, 3), "aborted")
    lines = [ln for ln in path.read_text().splitlines() if '"key": "swa_decay_rate"' not in ln]
    path.write_text("\n".join(lines) + "\n")
    ok, failed = run_compliance_checker(path)
    assert not ok
    assert failed == sorted(SMALL_RUN_FAILURES + ["swa_decay_rate"])


def test_only_designated_rank_logs_and_instance_metadata(tmp_path):
    """A logger for a non-logging rank writes nothing; throughput mode tags events with the instance."""
    quiet = MLPerfLogger.for_rank(3, log_ranks=(0,), log_path=tmp_path / "r3.log")
    quiet.init_start()
    quiet.run_stop("aborted")
    quiet.close()
    assert not (tmp_path / "r3.log").exists()
    with MLPerfLogger.for_rank(0, log_path=tmp_path / "r0.log", instance=5) as log:
        log.epoch_start(80)
        log.run_stop("success")
        log.run_stop("aborted")  # ignored: run_stop is logged once
    recs = _records(tmp_path / "r0.log")
    assert [r["key"] for r in recs] == ["epoch_start", "run_stop"]
    assert all(r["metadata"]["instance"] == 5 for r in recs)
    with pytest.raises(ValueError):
        MLPerfLogger(None).run_stop("done")


def test_parse_checker_output_distinguishes_warnings():
    """Duplicate identical EXACTLY_ONE keys are warnings, missing / conflicting ones are failures."""
    text = (
        "WARNING -  Required EXACTLY_ONE occurrence of 'seed' but found 2\n------------------------------\n"
        "Required EXACTLY_ONE occurrence of 'opt_name' but found 0\n------------------------------\n"
        "Required EXACTLY_ONE occurrence of 'precision' but found 2 with different values: [a, b]\n"
        "Failed checks for eval_accuracy : v['value'] >= 0.8\n"
        "Required AT_LEAST_ONE occurrence of 'epoch_start' or 'block_start'\n"
    )
    failed, warnings = parse_checker_output(text)
    assert failed == ["epoch_start|block_start", "eval_accuracy", "opt_name", "precision"]
    assert warnings == ["seed"]


def test_deferred_logger_writes_its_early_lines_once_the_file_is_named(tmp_path):
    """A deferred logger keeps init_start etc. (with their own timestamps) in memory until open_file()
    names the file; disabled deferred loggers only record the path."""
    log = MLPerfLogger(enabled=True, deferred=True)
    log.init_start()
    assert log.log_path is None and not list(tmp_path.iterdir())
    path = tmp_path / "mlperf_resumed_00000002.log"
    log.open_file(path)
    log.init_stop_run_start()
    log.run_stop("aborted")
    log.close()
    records = _records(path)
    assert [r["key"] for r in records] == ["init_start", "cache_clear", "init_stop", "run_start", "run_stop"]
    assert records[0]["time_ms"] <= records[2]["time_ms"]
    with pytest.raises(RuntimeError, match="already"):
        log.open_file(path)
    off = MLPerfLogger(enabled=False, deferred=True)
    off.init_start()
    off.open_file(tmp_path / "other.log")
    assert off.log_path == tmp_path / "other.log" and not (tmp_path / "other.log").exists()
    with pytest.raises(ValueError):
        MLPerfLogger(tmp_path / "x.log", deferred=True)


def test_cache_clear_is_true_only_when_the_launcher_dropped_the_caches(tmp_path, monkeypatch):
    """run.sub exports SCALEFOLD_CACHE_CLEARED=1 after a successful CLEAR_CACHES=1 drop; any other
    start (the demo, a test, CLEAR_CACHES=0) logs cache_clear false rather than claiming it."""
    from scalefold.mlperf.logger import caches_cleared

    assert caches_cleared({}) is False and caches_cleared({"SCALEFOLD_CACHE_CLEARED": "0"}) is False
    assert caches_cleared({"SCALEFOLD_CACHE_CLEARED": "1"}) is True
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("SCALEFOLD_CACHE_CLEARED", value)
        path = tmp_path / f"cache_{value}.log"
        log = MLPerfLogger(path, enabled=True)
        log.init_start()
        log.close()
        records = _records(path)
        assert records[1]["key"] == "cache_clear" and records[1]["value"] is expected
