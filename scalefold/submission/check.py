"""``scalefold submission check``: a submitter's folder judged by the official tools of the installed
``mlperf-logging``, for HPC 3.0.0 -- nothing here recomputes what they decide.

1. ``python -m mlperf_logging.package_checker FOLDER hpc 3.0.0``: the system descriptions, the compliance
   checker on every log, the seed checker and the RCP checker. Its verdict is its last line (``PACKAGE
   CHECKER FOUND NO ERRORS`` / ``FOUND ERRORS``; its exit status is 0 either way); its ``ERROR`` lines and
   each log's failed rules are split by the ``Running compliance checks in dir`` section they fall in.
2. ``python -m mlperf_logging.result_summarizer FOLDER hpc 3.0.0 --csv summary.csv``: the score (strong
   scaling: the olympic mean of the times to train, times the RCP normalisation the package checker wrote
   to ``scaling.json``; weak scaling: time to train all models, number of models, instance scale) and the
   RCP verdict, read from the CSV files it writes.
3. Each run's time to train as the summarizer takes it (its own ``_read_result_file`` and
   ``_query_run_start_stop``: ``None`` for a run it drops, with its reason).

The tools run, in that order (the official one: the checker's RCP normalisation feeds the summarizer), on
a copy of the folder in a temporary directory: the checker writes ``scaling.json`` files and the summarizer
its CSV/JSON files into the working directory, and the submitter's folder stays as it was.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scalefold.errors import UserError, require_dir
from scalefold.mlperf.logger import parse_checker_output
from scalefold.submission.runs import natural_key

USAGE, RULESET = "hpc", "3.0.0"
PASSED, FAILED = "passed", "failed"
WEAK_FIELDS = ("time_to_train_all", "number_of_models", "instance_scale")
_SECTION = re.compile(r"Running compliance checks in dir (\S+)\s*$")
_RUN_FILE = re.compile(r"Running compliance on file: (\S+)\s*$")
_RCP = re.compile(r"RCP Test (Passed|Failed): (.*)$")
_NORMALISATION = re.compile(r"Results scaling set to normalization factor of ([0-9.]+)")
_LEVEL = re.compile(r"^(INFO|WARNING|ERROR|CRITICAL) - ?(.*)$")


@dataclass
class BenchmarkCheck:
    """The official tools' word on one ``results/<system>/<scaling>/<benchmark>`` folder."""

    system: str
    benchmark: str
    scaling: str
    division: str
    package_checker: str = PASSED
    errors: list[str] = field(default_factory=list)
    runs_minutes: dict[str, float | None] = field(default_factory=dict)
    dropped_runs: dict[str, str] = field(default_factory=dict)  # result file -> the summarizer's reason
    run_failures: dict[str, list[str]] = field(default_factory=dict)  # result file -> compliance rules failed
    rcp: str | None = None  # the summarizer's RCP column (Pass / Fail / Missing / No RCP ...)
    rcp_checker: str | None = None  # the package checker's RCP test: passed / failed (None: not run, e.g. open)
    rcp_message: str | None = None  # its message ("RCP found", "Cannot find any RCPs", ...)
    rcp_scaling_factor: float | None = None
    global_batch_size: float | None = None
    samples_to_converge: float | None = None
    score_minutes: float | None = None  # strong scaling
    weak: dict[str, float | None] = field(default_factory=dict)  # weak scaling: the summarizer's fields

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        weak = data.pop("weak")
        if self.scaling == "weak":
            data.pop("score_minutes")
            data.update(weak)
        return data


@dataclass
class CheckReport:
    """Every benchmark folder's check, the package checker's own verdict line, and both tools' output."""

    checks: list[BenchmarkCheck]
    verdict_line: str
    package_checker_output: str
    summarizer_output: str

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.package_checker == PASSED for c in self.checks) and "NO ERRORS" in self.verdict_line


# -- running the tools ------------------------------------------------------------------------------------


def _official(module: str, args: list[str], cwd: Path, timeout_s: float) -> str:
    cmd = [sys.executable, "-m", module, *args]
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"{module} did not finish within {timeout_s:.0f} s") from exc
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and "Traceback" in output:
        last = output.strip().splitlines()[-1]
        raise UserError(f"{module} failed on this folder: {last}")
    return output


def check_folder_layout(folder: Path) -> Path:
    """``folder`` if it is a submitter's folder (``results/`` and ``systems/`` inside), else a UserError."""
    folder = require_dir(folder, "submission folder", "a submitter's folder holding results/ and systems/")
    for sub in ("results", "systems"):
        if not (folder / sub).is_dir():
            raise UserError(f"submission folder {folder} has no {sub}/ (expected a submitter's folder: "
                            f"<submitter>/results/<system>/<strong|weak>/<benchmark>/result_<i>.txt and "
                            f"<submitter>/systems/<system>.json)")  # fmt: skip
    return folder


def check_submission(folder: Path, timeout_s: float = 900) -> CheckReport:
    """Run the package checker, then the result summarizer, on a copy of ``folder``; one
    :class:`BenchmarkCheck` per benchmark folder the package checker visited."""
    folder = check_folder_layout(Path(folder))
    with tempfile.TemporaryDirectory(prefix="scalefold-check-") as tmp:
        work = Path(tmp)
        copy = work / folder.resolve().name
        shutil.copytree(folder, copy, symlinks=False)
        checker = _official("mlperf_logging.package_checker",
                            [copy.name, USAGE, RULESET, "--log_output", str(work / "package_checker.log")], work,
                            timeout_s)  # fmt: skip
        summarizer = _official("mlperf_logging.result_summarizer",
                               [copy.name, USAGE, RULESET, "--csv", str(work / "summary.csv")], work, timeout_s)  # fmt: skip
        checks, verdict = parse_package_checker(checker, copy)
        tables = read_summary_tables(work / "summary.csv", work / "summary_detailed.csv")
        for check in checks:
            results = copy / "results" / check.system / check.scaling / check.benchmark
            # the RCP normalisation the package checker wrote (its log rounds it); the summarizer's wins below
            check.rcp_scaling_factor = _scaling_factor(results / "scaling.json") or check.rcp_scaling_factor
            apply_summary(check, tables, summarizer)
            check.runs_minutes, dropped = run_times(results)
            check.dropped_runs = dict(sorted({**check.dropped_runs, **dropped}.items(),
                                             key=lambda kv: natural_key(Path(kv[0]))))  # fmt: skip
    return CheckReport(checks, verdict, checker, summarizer)


# -- the package checker's output ---------------------------------------------------------------------------


def _division(copy: Path, system: str) -> str:
    try:
        return str(json.loads((copy / "systems" / f"{system}.json").read_text()).get("division", ""))
    except (OSError, ValueError):
        return ""


def parse_package_checker(output: str, copy: Path) -> tuple[list[BenchmarkCheck], str]:
    """Split the package checker's log into its benchmark sections (errors before the first section, e.g.
    of a system description, count for every benchmark)."""
    checks: list[BenchmarkCheck] = []
    common: list[str] = []
    current: BenchmarkCheck | None = None
    run_file, run_text = None, []
    verdict = ""

    def close_run() -> None:
        if current is not None and run_file is not None:
            failed, _ = parse_checker_output("\n".join(run_text))
            if failed:
                current.run_failures[run_file] = failed

    for line in output.splitlines():
        level = _LEVEL.match(line)
        text = level.group(2).strip() if level else line
        section = _SECTION.search(line)
        if section:
            close_run()
            run_file, run_text = None, []
            parts = Path(section.group(1)).parts
            system, scaling, benchmark = parts[-3], parts[-2], parts[-1]
            current = BenchmarkCheck(system, benchmark, scaling, _division(copy, system))
            checks.append(current)
            continue
        match = _RUN_FILE.search(line)
        if match:
            close_run()
            run_file, run_text = Path(match.group(1)).name, []
            continue
        if level and level.group(1) == "INFO" and text.startswith(("Running Seed Checker", "Running RCP Checker")):
            close_run()
            run_file = None
        if "PACKAGE CHECKER FOUND" in line:
            verdict = text
        elif run_file is not None:
            run_text.append(line)
        if level and level.group(1) in ("ERROR", "CRITICAL"):
            (current.errors if current is not None else common).append(text)
        rcp, factor = _RCP.search(line), _NORMALISATION.search(line)
        if current is not None and rcp:
            current.rcp_checker = PASSED if rcp.group(1) == "Passed" else FAILED
            current.rcp_message = rcp.group(2).strip()
        if current is not None and factor:
            current.rcp_scaling_factor = float(factor.group(1))
    close_run()
    for check in checks:  # the verdict: an ERROR line in the section or before any (a warning passes)
        check.errors = common + check.errors
        check.package_checker = FAILED if check.errors else PASSED
        check.errors += [f"{name}: compliance checker failed {', '.join(rules)}" for name, rules in
                         sorted(check.run_failures.items(), key=lambda kv: natural_key(Path(kv[0])))]  # fmt: skip
    return checks, verdict


# -- the result summarizer's output -------------------------------------------------------------------------


def _tables(path: Path) -> list[list[dict[str, str]]]:
    """The CSV tables in ``path`` (the summarizer appends the weak-scaling table, header and all)."""
    if not path.is_file():
        return []
    tables: list[list[dict[str, str]]] = []
    header: list[str] | None = None
    for row in csv.reader(io.StringIO(path.read_text())):
        if row and row[0] == "division":
            header = row
            tables.append([])
        elif header is not None and row:
            tables[-1].append(dict(zip(header, row)))
    return tables


def _system_of(row: dict[str, str]) -> str:
    """The system folder of a summary row (its details_url names systems/<system>.json)."""
    return Path(row.get("details_url", "")).stem


def read_summary_tables(summary: Path, detailed: Path) -> dict[str, dict[str, dict[str, str]]]:
    """``{"strong"|"weak"|"detailed": {system: row}}`` from the summarizer's CSV files."""
    out: dict[str, dict[str, dict[str, str]]] = {"strong": {}, "weak": {}, "detailed": {}}
    for table in _tables(summary):
        for row in table:
            kind = "weak" if any(k.endswith(":time_to_train_all") for k in row) else "strong"
            out[kind][_system_of(row)] = row
    for table in _tables(detailed):
        for row in table:
            out["detailed"][_system_of(row)] = row
    return out


def _scaling_factor(path: Path) -> float | None:
    try:
        return float(json.loads(path.read_text())["scaling_factor"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def apply_summary(check: BenchmarkCheck, tables: dict, output: str) -> None:
    """The summarizer's score, RCP verdict and notes for ``check``'s system and benchmark."""
    b = check.benchmark
    if check.scaling == "strong":
        row = tables["strong"].get(check.system, {})
        check.score_minutes = _number(row.get(b))
        detail = tables["detailed"].get(check.system, {})
        check.rcp = detail.get(f"{b}:RCP") or None
        check.global_batch_size = _number(detail.get(f"{b}:GBS"))
        check.samples_to_converge = _number(detail.get(f"{b}:samples_to_converge"))
        factor = _number(detail.get(f"{b}:rcp_scaling_factor"))
        check.rcp_scaling_factor = factor if factor is not None else check.rcp_scaling_factor
    else:
        row = tables["weak"].get(check.system, {})
        check.weak = {name: _number(row.get(f"{b}:{name}")) for name in WEAK_FIELDS}
    where = f"/{check.system}/{check.scaling}/{b}"
    for line in output.splitlines():
        if ("CRITICAL ERROR" in line or "ERROR: RCP" in line) and f"{check.system}/{b}" in line:
            check.errors.append(f"result summarizer: {line.strip()}")
        elif where in line and " in " in line:
            reason, _, path = line.rpartition(" in ")
            check.dropped_runs[Path(path.strip()).name] = reason.strip()


def run_times(benchmark_folder: Path) -> tuple[dict[str, float | None], dict[str, str]]:
    """Each result file's time to train in minutes as the summarizer takes it (None: dropped), and why the
    dropped ones are dropped -- through the summarizer's own functions."""
    from mlperf_logging.result_summarizer import result_summarizer as rs

    times: dict[str, float | None] = {}
    dropped: dict[str, str] = {}
    for path in sorted(benchmark_folder.glob("result_*.txt"), key=natural_key):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                start, stop = rs._query_run_start_stop(rs._read_result_file(str(path), USAGE, RULESET))
            except ValueError as exc:
                times[path.name], dropped[path.name] = None, str(exc)
                continue
        times[path.name] = (stop - start) / 60 / 1000
    return times, dropped


# -- the report ---------------------------------------------------------------------------------------------


def _minutes(value: float | None) -> str:
    return "dropped" if value is None else f"{value:.3f}"


def format_check(check: BenchmarkCheck) -> list[str]:
    """One benchmark's lines of the text report."""
    lines = [f"{check.system} / {check.scaling} / {check.benchmark} ({check.division or 'division unknown'}): "
             f"package checker {check.package_checker}"]  # fmt: skip
    runs = ", ".join(f"{Path(name).stem} {_minutes(v)}" for name, v in check.runs_minutes.items())
    lines.append(f"  runs (minutes to train): {runs or 'none'}")
    for name, reason in check.dropped_runs.items():
        lines.append(f"  {Path(name).stem} kept out of the score by the result summarizer: {reason}")
    rcp = f"RCP checker {check.rcp_checker or 'not run'}" + (f" ({check.rcp_message})" if check.rcp_message else "")
    if check.rcp_scaling_factor:
        rcp += f", normalisation x{check.rcp_scaling_factor:.4f}"
    if check.rcp:
        rcp += f"; summarizer's RCP column: {check.rcp}"
    lines.append(f"  {rcp}")
    if check.scaling == "strong":
        score = "none" if check.score_minutes is None else f"{check.score_minutes:.4f} minutes"
        lines.append(f"  score (result summarizer: olympic mean x RCP normalisation): {score}")
    else:
        fields = ", ".join(f"{k} {'none' if v is None else f'{v:g}'}" for k, v in check.weak.items())
        lines.append(f"  weak-scaling score (result summarizer): {fields}")
    lines += [f"  error: {message}" for message in check.errors]
    return lines


def format_report(report: CheckReport) -> str:
    lines = [line for check in report.checks for line in format_check(check)]
    if not report.checks:
        lines.append("the package checker found no benchmark folder (results/<system>/<strong|weak>/<benchmark>/)")
    lines.append(f"package checker (mlperf-logging {USAGE} {RULESET}): {report.verdict_line or 'no verdict line'}")
    return "\n".join(lines)
