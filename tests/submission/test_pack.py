"""``scalefold submission pack`` on ten real short CPU runs (the ``ten_runs`` fixture), then ``check``: the
official package checker refuses the package only for the rules a one-step run of the tiny model cannot
meet, each named; and every bad input of a pack is refused in one line with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

from scalefold.cli import main
from scalefold.mlperf.provenance import code_identity

# What the MLPerf HPC OpenFold compliance checker (3.0.0) refuses in a tiny CPU run's log, and why: the dataset
# counts (594,595 / 180), the 93,229,082-parameter model, the reference checkpoint's sha256 (a run from scratch
# logs none), lDDT-Ca >= 0.8, and the data sizes / evaluation interval the tiny preset shrinks.
SMALL_RUN_FAILURES = (
    "eval_accuracy, eval_samples, init_checkpoint_sha256sum, max_extra_msa, max_msa_clusters, max_templates, "
    "model_parameters_count, num_recycling_iters, train_samples, train_sequence_crop_size, val_every_iters"
)
PACK = ["submission", "pack", "--submitter", "ScaleFold", "--system", "cpu_box_n1"]


def _pack(runs, out: Path, *extra: str) -> list[str]:
    return [*PACK, *map(str, runs), "--out", str(out), *extra]


def _copy_run(run: Path, dest: Path, edit=None) -> Path:
    """A copy of a real run; ``edit(text) -> text`` rewrites its MLPerf log."""
    shutil.copytree(run, dest)
    if edit is not None:
        log = dest / "mlperf.log"
        log.write_text(edit(log.read_text()))
    return dest


@pytest.mark.slow
def test_ten_tiny_runs_packed_and_checked(ten_runs, tmp_path, capsys):
    """The runs in run order (run_t_10 last), the system description the official checker accepts, the code
    reference; then the check: every log fails exactly the small-run rules, the RCP checker finds no
    convergence, the summarizer drops every run and gives no score -- nothing else."""
    out = tmp_path / "sub"
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"status": "research", "cooling": "air", "host_storage_type": "SSD"}))
    assert main([*_pack(ten_runs, out), "--system-json", str(given)]) == 0
    captured = capsys.readouterr()
    root = out / "ScaleFold"
    results = root / "results" / "cpu_box_n1" / "strong" / "openfold"
    assert sorted(p.name for p in results.iterdir()) == sorted(f"result_{i}.txt" for i in range(10))
    for index, run in enumerate(ten_runs):  # result_<i> is the i-th run in natural order
        assert (results / f"result_{index}.txt").read_bytes() == (run / "mlperf.log").read_bytes()
    assert f"result_9.txt <- {ten_runs[9] / 'mlperf.log'} (seed 1010)" in captured.out
    assert f"next: scalefold submission check {root}" in captured.out

    system = root / "systems" / "cpu_box_n1.json"
    desc = json.loads(system.read_text())
    assert check_system_desc(str(system), "hpc", "3.0.0")[0]  # the official system-description checker
    assert (desc["status"], desc["cooling"], desc["host_storage_type"]) == ("research", "air", "SSD")  # given wins
    assert desc["number_of_nodes"] == "1" and desc["accelerators_per_node"] == "0"
    assert desc["framework"].startswith("PyTorch ") and desc["other_software_stack"]["mlperf-logging"]
    assert desc["host_processor_vcpu_count"] and desc["operating_system"] and desc["host_memory_capacity"].endswith("GiB")
    named = [ln for ln in captured.err.splitlines() if "only the submitter knows it" in ln]
    assert {ln.split(": ")[2].split(" is empty")[0] for ln in named} == {
        "host_processor_frequency", "host_processor_caches", "host_processor_interconnect", "host_storage_capacity",
        "host_networking", "host_networking_topology", "host_memory_configuration",
    }  # fmt: skip
    aborted = [ln for ln in captured.err.splitlines() if "run_stop status=aborted" in ln]
    assert len(aborted) == 10  # each named: a tiny run does not reach lDDT-Ca 0.8
    code = root / "benchmarks" / "openfold" / "implementations" / "scalefold"
    assert json.loads((code / "CODE.json").read_text()) == code_identity()
    assert (code / "scalefold" / "submission" / "pack.py").is_file()

    assert main(["submission", "check", str(root), "--json"]) == 1
    (check,) = json.loads(capsys.readouterr().out)
    assert (check["system"], check["scaling"], check["benchmark"], check["division"]) == ("cpu_box_n1", "strong", "openfold", "closed")
    assert check["package_checker"] == "failed"
    expected = {f"result_{i}.txt": SMALL_RUN_FAILURES.split(", ") for i in range(10)}
    assert check["run_failures"] == expected  # exactly the small-run rules, every log
    assert check["rcp_checker"] == "failed" and check["rcp_message"] == "Insufficient convergence"
    assert check["runs_minutes"] == {f"result_{i}.txt": None for i in range(10)}
    assert set(check["dropped_runs"].values()) == {"Compliance check failed"}
    assert check["score_minutes"] is None
    rest = [e for e in check["errors"] if "compliance checker failed" not in e]
    assert rest == [
        "10 files do not comply, directory cannot be accepted",
        "RCP Test Failed: Insufficient convergence",
        "result summarizer: CRITICAL ERROR: Too many non-converging runs for ScaleFold cpu_box_n1/openfold",
        "result summarizer: ** CRITICAL ERROR ** Results in the table for ScaleFold cpu_box_n1/openfold are NOT correct",
        "result summarizer: ERROR: RCP Test Failed on ScaleFold/cpu_box_n1/openfold with message: Insufficient convergence.",
    ]  # nothing else: the seed checker and the system description pass


def _refused(argv: list[str], out: Path, capsys, *words: str) -> None:
    before = sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None
    assert main(argv) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scalefold submission pack: submission error: "), err
    assert all(word in err[0] for word in words), err[0]
    after = sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None
    assert after == before  # nothing written


@pytest.mark.slow
def test_bad_run_sets_are_refused_in_one_line_with_nothing_written(ten_runs, tmp_path, capsys):
    out = tmp_path / "sub"
    nine = ten_runs[:9]
    _refused(_pack(nine, out), out, capsys, "9 run(s) given", "exactly 10")
    empty = tmp_path / "run_t_empty"
    empty.mkdir()
    _refused(_pack([*nine, empty], out), out, capsys, str(empty), "no MLPerf log")
    twin = _copy_run(ten_runs[0], tmp_path / "run_t_twin")
    _refused(_pack([*nine, twin], out), out, capsys, "run_t_1 and run_t_twin use the same seed 1001")
    lr = _copy_run(ten_runs[9], tmp_path / "run_t_lr", lambda t: t.replace('"opt_base_learning_rate", "value": 0.001', '"opt_base_learning_rate", "value": 0.002'))
    _refused(_pack([*nine, lr], out), out, capsys, "run_t_1 and run_t_lr differ in hyperparameter opt_base_learning_rate")
    code = _copy_run(ten_runs[9], tmp_path / "run_t_code")
    prov = json.loads((code / "provenance.json").read_text())
    prov["code"]["code_sha256"] = "0" * 64
    (code / "provenance.json").write_text(json.dumps(prov))
    _refused(_pack([*nine, code], out), out, capsys, "run_t_1 and run_t_code differ in code code_sha256")
    _refused([*PACK[:5], "cpu box/1", *map(str, ten_runs), "--out", str(out)], out, capsys,
             "--system 'cpu box/1'", "folder name")  # fmt: skip
    _refused([*_pack(ten_runs, out, "--division", "open")], out, capsys, "submission_division 'closed'")
    assert not out.exists()


@pytest.mark.slow
def test_an_unfinished_run_is_kept_named_and_a_second_pack_needs_force(ten_runs, tmp_path, capsys):
    """A log without run_stop (the run died) goes in, named (the summarizer keeps it out of the score); a
    folder that already holds this system's submission is refused unless --force, which replaces it."""
    died = _copy_run(ten_runs[9], tmp_path / "run_t_died", lambda t: "".join(
        ln for ln in t.splitlines(keepends=True) if '"key": "run_stop"' not in ln))  # fmt: skip
    out = tmp_path / "sub"
    assert main(_pack([*ten_runs[:9], died], out)) == 0
    err = capsys.readouterr().err
    assert "warning: run_t_died: its MLPerf log has no run_stop (the run did not finish): kept in the package, out of the score" in err
    results = out / "ScaleFold" / "results" / "cpu_box_n1" / "strong" / "openfold"
    _refused(_pack(ten_runs, out), out, capsys, "already holds a submission for cpu_box_n1", "--force")
    assert main([*_pack(ten_runs, out), "--force"]) == 0
    assert (results / "result_9.txt").read_bytes() == (ten_runs[9] / "mlperf.log").read_bytes()
    assert not list((out / "ScaleFold").glob(".pack-*"))  # no staging folder left


@pytest.mark.slow
def test_weak_scaling_takes_at_least_ten_runs(ten_runs, tmp_path, capsys):
    """--scaling weak: the logs go under weak/ (the throughput mode's instances; at least ten, so nine are refused)."""
    out = tmp_path / "sub"
    _refused(_pack(ten_runs[:9], out, "--scaling", "weak"), out, capsys, "9 run(s) given", "at least 10")
    assert main(_pack(ten_runs, out, "--scaling", "weak")) == 0
    weak = out / "ScaleFold" / "results" / "cpu_box_n1" / "weak" / "openfold"
    assert len(list(weak.glob("result_*.txt"))) == 10 and not (weak.parent.parent / "strong").exists()


@pytest.mark.parametrize("case", ["missing_run", "system_json_not_json", "system_json_a_list", "bad_submitter"])
def test_inputs_refused_before_any_run_is_read(tmp_path, capsys, case):
    out, given = tmp_path / "sub", tmp_path / "given.json"
    given.write_text({"system_json_not_json": "{status: onprem", "system_json_a_list": "[1, 2]"}.get(case, "{}"))
    argv = _pack([tmp_path / "run_t_1"], out, "--system-json", str(given))
    if case == "bad_submitter":
        argv[argv.index("ScaleFold")] = ".hidden"
    words = {"missing_run": (str(tmp_path / "run_t_1"), "does not exist"),
             "system_json_not_json": (str(given), "not valid JSON"),
             "system_json_a_list": (str(given), "expected a JSON object"),
             "bad_submitter": ("--submitter '.hidden'",)}[case]  # fmt: skip
    _refused(argv, out, capsys, *words)
