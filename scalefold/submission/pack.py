"""``scalefold submission pack``: an MLPerf HPC v3.0 submission folder from finished runs.

The layout the package checker reads (``mlperf_logging.package_checker FOLDER hpc 3.0.0``)::

    OUT/<submitter>/
      results/<system>/<strong|weak>/openfold/result_<i>.txt   every run's MLPerf log, in run order
      systems/<system>.json                                    the system description (scalefold.submission.system)
      benchmarks/openfold/implementations/scalefold/           the code reference: the sources, launch scripts,
                                                               CODE.json (version, git commit, sources' sha256)

Everything is checked before anything is written (:func:`plan_pack`), then built in a staging folder
beside the result and moved into place, so a refused or failed pack leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalefold.errors import require_writable_output
from scalefold.mlperf.logger import BENCHMARK
from scalefold.mlperf.provenance import code_identity, package_root, source_files
from scalefold.submission.runs import RunLog, SubmissionError, check_run_set, load_runs
from scalefold.submission.system import read_system_json, system_description

#: names the package checker and the results site take as folder / file names
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
IMPLEMENTATION = "scalefold"
#: files of the checkout (beside the package) that belong to the code reference, when present
CHECKOUT_FILES = ("run.sub", "Dockerfile", "pyproject.toml", "LICENSE", "README.md")
CHECKOUT_DIRS = ("launch",)


@dataclass
class PackPlan:
    """A checked pack: what goes where."""

    runs: list[RunLog]
    root: Path  # OUT/<submitter>
    system: str
    scaling: str
    description: dict[str, Any]
    missing_fields: list[str]
    warnings: list[str] = field(default_factory=list)
    force: bool = False

    @property
    def result_dir(self) -> Path:
        return self.root / "results" / self.system / self.scaling / BENCHMARK

    @property
    def system_file(self) -> Path:
        return self.root / "systems" / f"{self.system}.json"

    @property
    def code_dir(self) -> Path:
        return self.root / "benchmarks" / BENCHMARK / "implementations" / IMPLEMENTATION


def check_name(value: str, option: str) -> str:
    if not NAME.match(value or ""):
        raise SubmissionError(f"{option} {value!r}: use letters, digits, '.', '_' and '-' only, not starting with "
                              "'.', '_' or '-' (the package checker reads it as a folder name)")  # fmt: skip
    return value


def plan_pack(run_paths: list[Path], out: Path, submitter: str, system: str, scaling: str = "strong",
              division: str = "closed", system_json: Path | None = None, force: bool = False) -> PackPlan:  # fmt: skip
    """Every check of a pack, nothing written: names, runs, the output folder."""
    check_name(submitter, "--submitter")
    check_name(system, "--system")
    given = read_system_json(system_json) if system_json else None
    runs = load_runs([Path(p) for p in run_paths])
    warnings = check_run_set(runs, scaling)
    logged = runs[0].init.get("submission_division")
    if logged and logged != division:
        raise SubmissionError(f"the runs log submission_division {logged!r} but --division is {division!r}")
    org = runs[0].init.get("submission_org")
    if org and org != submitter:
        warnings.append(f"the runs log submission_org {org!r}, the package is for --submitter {submitter!r} "
                        "(SUBMISSION_ORG / --submission-org sets the logged one)")  # fmt: skip
    description, missing = system_description(runs, submitter, system, division, given)
    root = Path(out) / submitter
    plan = PackPlan(runs, root, system, scaling, description, missing, warnings, force)
    _check_output(plan, Path(out))
    mine = code_identity()["code_sha256"]
    ran = {run.code for run in runs if run.code}
    if ran and ran != {mine}:
        warnings.append(f"the runs ran code {ran.pop()[:12]}, this installation is {mine[:12]}: the package's "
                        "code reference is this installation's sources")  # fmt: skip
    return plan


def _check_output(plan: PackPlan, out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise SubmissionError(f"--out {out} is a file, expected a folder")
    require_writable_output(out / ".scalefold-pack-probe", "--out")
    if plan.force:
        return
    for existing in (plan.result_dir, plan.system_file):
        if existing.exists():
            raise SubmissionError(f"--out {out} already holds a submission for {plan.system} ({existing}); "
                                  "--force replaces it")  # fmt: skip
    code = plan.code_dir / "CODE.json"
    if code.is_file():
        try:
            theirs = json.loads(code.read_text()).get("code_sha256")
        except ValueError:
            theirs = None
        if theirs != code_identity()["code_sha256"]:
            raise SubmissionError(f"--out {out} already holds another version of the code ({code}); --force "
                                  "replaces it")  # fmt: skip


def _write_code_reference(dest: Path) -> None:
    """The package's sources, the checkout's launch files (when beside it) and CODE.json."""
    package = package_root()
    for path in source_files(package):
        target = dest / "scalefold" / path.relative_to(package)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file():
        for name in CHECKOUT_FILES:
            if (checkout / name).is_file():
                shutil.copy2(checkout / name, dest / name)
        for name in CHECKOUT_DIRS:
            if (checkout / name).is_dir():
                shutil.copytree(checkout / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "CODE.json").write_text(json.dumps(code_identity(), indent=2) + "\n")


def _stage(plan: PackPlan, staging: Path) -> None:
    results = staging / "results"
    results.mkdir(parents=True)
    for index, run in enumerate(plan.runs):
        shutil.copy2(run.log, results / f"result_{index}.txt")
    (staging / "system.json").write_text(json.dumps(plan.description, indent=4) + "\n")
    _write_code_reference(staging / "code")


def _move_into_place(staging: Path, plan: PackPlan) -> None:
    for source, target in ((staging / "results", plan.result_dir), (staging / "system.json", plan.system_file),
                           (staging / "code", plan.code_dir)):  # fmt: skip
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(source, target)


def write_pack(plan: PackPlan) -> None:
    """Build the package in a staging folder inside ``OUT`` and move its parts into place (a failure while
    staging leaves ``OUT`` as it was: the staging folder, and the submitter's folder if this pack made it,
    are removed)."""
    created = not plan.root.exists()
    plan.root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".pack-", dir=plan.root))
    try:
        _stage(plan, staging)
        _move_into_place(staging, plan)
    except BaseException:
        if created:
            shutil.rmtree(plan.root, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def pack(run_paths: list[Path], out: Path, submitter: str, system: str, **options: Any) -> PackPlan:
    """:func:`plan_pack` then :func:`write_pack`; returns the plan (what was written, the warnings)."""
    plan = plan_pack(run_paths, out, submitter, system, **options)
    write_pack(plan)
    return plan
