"""The finished runs a submission is built from: each run directory's MLPerf log, read once, and the rules
a set of them must meet before anything is written (:func:`load_runs`, :func:`check_run_set`).

A run directory is what ``scalefold train --out`` (or ``run.sub``: ``run_<DATESTAMP>_<run>[_<instance>]``)
writes: ``mlperf.log`` (a resumed run adds ``mlperf_resumed_<step>.log``; the first log is the run's
start) and ``provenance.json``. A path to an MLPerf log file is taken as it is (another implementation's
results, e.g. a folder of ``result_*.txt``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlperf_logging.benchmark_meta import get_result_file_counts

from scalefold.errors import UserError
from scalefold.mlperf.logger import BENCHMARK, INIT_BLOCK_KEYS, STATUS_SUCCESS
from scalefold.mlperf.provenance import read_provenance

#: runs the HPC rules ask for per benchmark (``mlperf_logging.benchmark_meta``: ``openfold: 10``)
REQUIRED_RUNS = get_result_file_counts("hpc")[BENCHMARK]
#: init-block keys every run of one package must log with one value (the seed must differ instead)
SAME_IN_EVERY_RUN = tuple(key for key in INIT_BLOCK_KEYS if key != "seed")
_LOG_NAMES = ("mlperf.log", "mlperf_*.log", "result_*.txt", "*.log")


class SubmissionError(UserError):
    """A run set or an output folder a submission cannot be built from (the message names the input)."""

    label = "submission error"


@dataclass
class RunLog:
    """One run's MLPerf log, read."""

    run_dir: Path
    log: Path
    init: dict[str, Any]  # init-block key -> value (first occurrence)
    run_stop_status: str | None  # None: no run_stop (the run did not finish)
    provenance: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.run_dir.name if self.log.parent == self.run_dir else self.log.name

    @property
    def seed(self) -> Any:
        return self.init.get("seed")

    @property
    def not_converged(self) -> str | None:
        """Why the result summarizer keeps this run out of the score, or None."""
        if self.run_stop_status is None:
            return "its MLPerf log has no run_stop (the run did not finish)"
        if self.run_stop_status != STATUS_SUCCESS:
            return f"run_stop status={self.run_stop_status}"
        return None

    @property
    def code(self) -> str | None:
        """The code's identity (sources' sha256) from provenance.json, None when the run recorded none."""
        return ((self.provenance or {}).get("code") or {}).get("code_sha256")


def natural_key(path: Path) -> list:
    """Sort key that orders numbers by value: ``run_x_2`` before ``run_x_10`` (how ``pack`` numbers results)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_log(run: Path) -> Path:
    """The MLPerf log of a run directory (or ``run`` itself when it is a log file)."""
    if run.is_file():
        return run
    if not run.is_dir():
        raise SubmissionError(f"run {run} does not exist (expected a finished run directory or its MLPerf log)")
    for pattern in _LOG_NAMES:
        found = sorted((p for p in run.glob(pattern) if p.is_file() and _has_mllog(p)), key=natural_key)
        if found:
            return found[0]
    raise SubmissionError(f"run directory {run} holds no MLPerf log (mlperf.log with :::MLLOG lines): "
                          "not a finished `scalefold train` run")  # fmt: skip


def _has_mllog(path: Path) -> bool:
    with path.open(errors="replace") as fh:
        return any(":::MLLOG" in line for line in fh)


def read_run(run: Path) -> RunLog:
    """Read one run (a directory or a log file): its init block, run_stop status and provenance."""
    run = Path(run)
    log = find_log(run)
    init: dict[str, Any] = {}
    status: str | None = None
    for number, line in enumerate(log.read_text(errors="replace").splitlines(), 1):
        if ":::MLLOG" not in line:
            continue
        try:
            record = json.loads(line.split(":::MLLOG", 1)[1])
        except ValueError as exc:
            raise SubmissionError(f"{log}:{number}: not a valid MLPerf log line ({exc})") from exc
        key = record.get("key")
        if key in INIT_BLOCK_KEYS and key not in init:
            init[key] = record.get("value")
        elif key == "run_stop":
            status = str((record.get("metadata") or {}).get("status", "unknown"))
    if not init:
        raise SubmissionError(f"{log}: an MLPerf log without its init block (no seed, no hyperparameters)")
    benchmark = init.get("submission_benchmark")
    if benchmark != BENCHMARK:
        raise SubmissionError(f"{log}: submission_benchmark is {benchmark!r}, expected {BENCHMARK!r}")
    run_dir = log.parent if run.is_file() else run
    return RunLog(run_dir, log, init, status, read_provenance(run_dir))


def load_runs(paths: list[Path]) -> list[RunLog]:
    """Every given run, read, in natural order of its path (``run_…_2`` before ``run_…_10``)."""
    if not paths:
        raise SubmissionError("no run directories given")
    unique = sorted({Path(p).resolve(): Path(p) for p in paths}.values(), key=natural_key)
    if len(unique) != len(paths):
        raise SubmissionError("a run directory is given twice")
    return [read_run(p) for p in unique]


def check_run_set(runs: list[RunLog], scaling: str) -> list[str]:
    """Refuse (one line naming the runs) a set that cannot be one submission: too few (or, for strong
    scaling, too many) runs, a seed used twice, hyperparameters or code that differ between runs. Returns
    the warnings: one line per run the summarizer will keep out of the score."""
    count = len(runs)
    if scaling == "strong" and count != REQUIRED_RUNS:
        raise SubmissionError(f"{count} run(s) given: strong scaling of {BENCHMARK} takes exactly {REQUIRED_RUNS} "
                              "runs (mlperf_logging benchmark_meta)")  # fmt: skip
    if scaling == "weak" and count < REQUIRED_RUNS:
        raise SubmissionError(f"{count} run(s) given: weak scaling of {BENCHMARK} takes at least {REQUIRED_RUNS} "
                              "runs (mlperf_logging benchmark_meta)")  # fmt: skip
    _check_seeds(runs)
    _check_same(runs, "hyperparameter", lambda run: {k: run.init.get(k) for k in SAME_IN_EVERY_RUN})
    _check_same(runs, "code", lambda run: {"code_sha256": run.code} if run.code else {})
    warnings = [f"{run.name}: {run.not_converged}: kept in the package, out of the score (the result summarizer "
                "drops it; olympic scoring allows one)" for run in runs if run.not_converged]  # fmt: skip
    if scaling == "strong" and len(warnings) > 1:
        warnings.append(f"{len(warnings)} of {count} runs did not converge: the result summarizer will give this "
                        "package no score (it drops at most one)")  # fmt: skip
    return warnings


def _check_seeds(runs: list[RunLog]) -> None:
    seen: dict[str, RunLog] = {}
    for run in runs:
        if run.seed is None:
            raise SubmissionError(f"{run.log}: logs no seed")
        key = str(run.seed)
        if key in seen:
            raise SubmissionError(f"{seen[key].name} and {run.name} use the same seed {key}: every run of a "
                                  "submission needs its own seed")  # fmt: skip
        seen[key] = run


def _check_same(runs: list[RunLog], what: str, values) -> None:
    """Every run that records ``values`` records the same ones as the first that does."""
    first: tuple[RunLog, dict] | None = None
    for run in runs:
        mine = values(run)
        if not mine:
            continue
        if first is None:
            first = (run, mine)
            continue
        for key, value in first[1].items():
            if mine.get(key) != value:
                raise SubmissionError(f"{first[0].name} and {run.name} differ in {what} {key} ({value!r} vs "
                                      f"{mine.get(key)!r}): one package holds runs of one configuration and code")  # fmt: skip
