"""``scalefold submission check`` on NVIDIA's public MLPerf HPC v3.0 OpenFold results (data/README.md) gives the
verdict and the score the official tools give: ``python -m mlperf_logging.package_checker`` then ``python -m
mlperf_logging.result_summarizer`` (the official order: the checker writes the RCP normalisation the
summarizer applies), run here by hand on a second copy of the folder."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from submission_helpers import NVIDIA_STRONG, unpack_nvidia

from scalefold.cli import main


def _official(folder: Path, work: Path) -> tuple[str, dict[str, dict[str, str]]]:
    """(the package checker's verdict line, the summarizer's CSV rows by system folder)."""
    run = dict(cwd=work, capture_output=True, text=True, timeout=600, check=True)
    checker = subprocess.run([sys.executable, "-m", "mlperf_logging.package_checker", str(folder), "hpc", "3.0.0",
                              "--log_output", str(work / "pc.log")], **run)  # fmt: skip
    verdict = [ln for ln in (checker.stdout + checker.stderr).splitlines() if "PACKAGE CHECKER FOUND" in ln]
    subprocess.run([sys.executable, "-m", "mlperf_logging.result_summarizer", str(folder), "hpc", "3.0.0",
                    "--csv", str(work / "official.csv")], **run)  # fmt: skip
    rows: dict[str, dict[str, str]] = {}
    for block in ("division," + b for b in (work / "official.csv").read_text().split("division,") if b):
        for row in csv.DictReader(io.StringIO(block)):
            rows[Path(row["details_url"]).stem] = row
    return verdict[-1], rows


@pytest.mark.slow
def test_check_gives_the_official_verdict_and_score_on_nvidias_results(tmp_path, capsys):
    ours = unpack_nvidia(tmp_path / "ours")
    assert main(["submission", "check", str(ours), "--json"]) == 0
    checks = {(c["system"], c["scaling"], c["benchmark"]): c for c in json.loads(capsys.readouterr().out)}
    assert not list(ours.rglob("scaling.json"))  # the tools ran on a copy: the folder is as it was

    (tmp_path / "official").mkdir()
    verdict, rows = _official(unpack_nvidia(tmp_path / "official"), tmp_path / "official")
    assert "PACKAGE CHECKER FOUND NO ERRORS" in verdict

    strong = checks[NVIDIA_STRONG]
    assert strong["package_checker"] == "passed" and strong["errors"] == [] and strong["division"] == "closed"
    assert strong["score_minutes"] == float(rows["eos_n260_ngc23.09_pytorch"]["openfold"])  # to the last bit
    assert strong["rcp"] == "Pass" and strong["rcp_checker"] == "passed"
    assert strong["rcp_scaling_factor"] == pytest.approx(133120.0 / 124160.0, rel=1e-12)  # RCP mean / ours
    times = sorted(strong["runs_minutes"].values())
    assert len(times) == 10 and strong["dropped_runs"] == {}
    # the olympic mean (best and worst dropped) times the normalisation: what the summarizer is documented to do
    assert strong["score_minutes"] == pytest.approx(sum(times[1:-1]) / 8 * strong["rcp_scaling_factor"], rel=1e-12)
    assert strong["score_minutes"] == pytest.approx(8.0544, abs=1e-4)

    weak = checks[("eos_n256_ngc23.09_pytorch", "weak", "openfold")]
    official_weak = rows["eos_n256_ngc23.09_pytorch"]
    assert weak["package_checker"] == "passed" and len(weak["runs_minutes"]) == 16
    for name in ("time_to_train_all", "number_of_models", "instance_scale"):
        assert weak[name] == float(official_weak[f"openfold:{name}"]), name
    assert (weak["number_of_models"], weak["instance_scale"]) == (16, 2048)
    assert "score_minutes" not in weak


@pytest.mark.slow
def test_check_names_the_logs_the_checker_refuses(tmp_path, capsys):
    """Two of the ten strong-scaling logs altered (a dataset count off): the package checker refuses the folder
    (olympic scoring tolerates one), both logs and the rule are named, the summarizer gives no score."""
    folder = unpack_nvidia(tmp_path, keep=(NVIDIA_STRONG,))
    logs = folder / "results" / NVIDIA_STRONG[0] / "strong" / "openfold"
    for name in ("result_1.txt", "result_2.txt"):
        path = logs / name
        path.write_text(path.read_text().replace('"key": "train_samples", "value": 594595', '"key": "train_samples", "value": 5'))
    assert main(["submission", "check", str(folder)]) == 1
    out = capsys.readouterr().out
    assert f"{NVIDIA_STRONG[0]} / strong / openfold (closed): package checker failed" in out
    assert "error: 2 files do not comply, directory cannot be accepted" in out
    assert "error: result_1.txt: compliance checker failed train_samples" in out
    assert "error: result_2.txt: compliance checker failed train_samples" in out
    assert "result_1 dropped, result_2 dropped" in out and "score (result summarizer: olympic mean x RCP normalisation): none" in out
    assert "PACKAGE CHECKER FOUND ERRORS" in out.splitlines()[-1]


@pytest.mark.parametrize("layout", ["missing", "no_results"])
def test_check_refuses_a_folder_that_is_not_a_submission_in_one_line(tmp_path, capsys, layout):
    folder = tmp_path / "sub"
    if layout == "no_results":
        (folder / "systems").mkdir(parents=True)
    assert main(["submission", "check", str(folder)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(folder) in err[0] and err[0].startswith("scalefold submission check: error:"), err


@pytest.mark.slow
def test_pack_rebuilds_nvidias_strong_result_the_checker_accepts(tmp_path, capsys):
    """NVIDIA's ten strong-scaling logs (another implementation's: no provenance.json) and its system file as
    --system-json, packed anew: the package checker accepts the package and the summarizer gives NVIDIA's score."""
    source = unpack_nvidia(tmp_path / "source", keep=(NVIDIA_STRONG,))
    system, scaling, benchmark = NVIDIA_STRONG
    logs = sorted((source / "results" / system / scaling / benchmark).glob("result_*.txt"))
    out = tmp_path / "packed"
    argv = ["submission", "pack", *map(str, logs), "--out", str(out), "--submitter", "NVIDIA", "--system", system,
            "--system-json", str(source / "systems" / f"{system}.json")]  # fmt: skip
    assert main(argv) == 0
    packed = out / "NVIDIA" / "results" / system / scaling / benchmark
    for log in logs:  # result_<i> in natural order: the same file names as NVIDIA's
        assert (packed / log.name).read_bytes() == log.read_bytes()
    capsys.readouterr()
    assert main(["submission", "check", str(out / "NVIDIA"), "--json"]) == 0
    (check,) = json.loads(capsys.readouterr().out)
    assert check["package_checker"] == "passed" and check["errors"] == []
    assert check["score_minutes"] == pytest.approx(8.054357731958763, rel=1e-15)
