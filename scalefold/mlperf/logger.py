"""MLPerf HPC logging (``mlperf_logging.mllog``) for the OpenFold benchmark, and its compliance check.

One :class:`MLPerfLogger` per run writes ``:::MLLOG`` lines to a per-run file (and optionally
stdout); only the designated rank(s) log, every other rank holds a disabled logger whose calls are
no-ops. :meth:`MLPerfLogger.log_init_block` emits every key of the benchmark's init block in the
order of the MLPerf HPC OpenFold rules (the reference's ``mllog`` sequence), with values from an :class:`MLPerfRunInfo` (defaults are
the closed-division values). In throughput mode every event carries ``instance`` metadata.

:func:`run_compliance_checker` runs the official checker
(``python -m mlperf_logging.compliance_checker --usage hpc --ruleset 3.0.0 LOG``) and parses which
rules failed, so a test can assert that the only failures of a small run are the ones a small run
cannot meet (dataset counts, parameter count, checkpoint hash, accuracy >= 0.8, changed
hyper-parameters).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from mlperf_logging.mllog.mllog import MLLogger as _MLLogger

from scalefold.diskspace import LineAppender, describe_free

BENCHMARK = "openfold"
USAGE = "hpc"
RULESET = "3.0.0"
STATUS_SUCCESS = "success"
STATUS_ABORTED = "aborted"

_logger_ids = itertools.count()


class _LineFileHandler(logging.Handler):
    """The log file, through a :class:`~scalefold.diskspace.LineAppender`: a full file system never tears a
    line (the log stays parseable) and costs one line on standard error; the lines wait in memory and are
    written in order once there is space. Lines still unwritten at :meth:`close` are printed on standard
    output, where the Slurm log keeps them (MLPerf's own capture), after one line saying so."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.appender = LineAppender(path, label=f"the MLPerf log {path}")

    def emit(self, record: logging.LogRecord) -> None:
        self.appender.write(self.format(record))

    def flush(self) -> None:
        self.appender.flush()

    def close(self) -> None:
        left = self.appender.close()
        if left:
            print(f"scalefold: {len(left)} line(s) of the MLPerf log {self.appender.path} could not be written "
                  f"({describe_free(self.appender.path)}); they follow on standard output", file=sys.stderr, flush=True)  # fmt: skip
            sys.stdout.write("".join(line + "\n" for line in left))
            sys.stdout.flush()
        super().close()


class _BufferHandler(logging.Handler):
    """Keeps the records of a deferred :class:`MLPerfLogger` until its file is known."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class MLPerfRunInfo:
    """Values of the init-block keys. Defaults: the MLPerf HPC OpenFold closed-division values."""

    # submission
    submission_org: str = "ScaleFold"
    submission_platform: str = "cpu"  # logged as "{number_of_nodes}x{submission_platform}"
    submission_division: str = "closed"
    submission_status: str = "onprem"
    seed: int = 1234567890
    # scale
    number_of_ranks: int = 1
    number_of_nodes: int = 1
    accelerators_per_node: int = 0
    global_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    # benchmark definition
    target_avg_lddt_ca_value: float = 0.8
    train_max_pdb_release_date: str = "2021-09-16"
    val_min_cameo_submission_date: str = "2021-09-17"
    val_max_cameo_submission_date: str = "2021-12-11"
    val_max_sequence_length: int = 700
    val_every_iters: int = 40
    precision: str = "fp32"
    # data / model
    train_sequence_crop_size: int = 256
    num_recycling_iters: int = 3
    max_msa_clusters: int = 124
    max_extra_msa: int = 1024
    templates_enabled: bool = True
    max_templates: int = 4
    # loss weights
    fape_loss_weight: float = 1.0
    fape_loss_backbone_weight: float = 0.5
    fape_loss_sidechain_weight: float = 0.5
    supervised_chi_loss_weight: float = 1.0
    distogram_loss_weight: float = 0.3
    masked_msa_loss_weight: float = 2.0
    plddt_loss_weight: float = 0.01
    # optimizer
    opt_name: str = "Adam"
    opt_base_learning_rate: float = 1e-3
    opt_adam_beta_1: float = 0.9
    opt_adam_beta_2: float = 0.999
    opt_adam_epsilon: float = 1e-6
    opt_weight_decay: float = 0.0
    opt_amsgrad: bool = False
    opt_gradient_clipping: bool = True
    opt_gradient_clip_norm: float = 0.1
    opt_learning_rate_warmup_init: float = 1e-5
    opt_learning_rate_warmup_steps: int = 0
    init_checkpoint_sha256sum: str | None = None  # logged only when training starts from a checkpoint
    swa_enabled: bool = True
    swa_decay_rate: float = 0.9
    model_parameters_count: int = 93229082

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> MLPerfRunInfo:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise KeyError(f"unknown MLPerf init keys: {sorted(unknown)}")
        return cls(**dict(values))


def caches_cleared(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher dropped the page cache before this run (``SCALEFOLD_CACHE_CLEARED``)."""
    return (os.environ if env is None else env).get("SCALEFOLD_CACHE_CLEARED", "0").strip().lower() in ("1", "true", "yes")


# Keys in log order, grouped as the MLPerf HPC OpenFold rules list them (init_start and cache_clear precede).
INIT_BLOCK_KEYS: tuple[str, ...] = (
    "submission_benchmark", "submission_org", "submission_division", "submission_status", "submission_platform",
    "seed",
    "number_of_ranks", "number_of_nodes", "accelerators_per_node",
    "global_batch_size", "gradient_accumulation_steps",
    "target_avg_lddt_ca_value", "train_max_pdb_release_date", "val_min_cameo_submission_date",
    "val_max_cameo_submission_date", "val_max_sequence_length", "val_every_iters",
    "precision",
    "train_sequence_crop_size", "num_recycling_iters", "max_msa_clusters", "max_extra_msa", "templates_enabled",
    "max_templates",
    "fape_loss_weight", "fape_loss_backbone_weight", "fape_loss_sidechain_weight", "supervised_chi_loss_weight",
    "distogram_loss_weight", "masked_msa_loss_weight", "plddt_loss_weight",
    "opt_name", "opt_base_learning_rate", "opt_adam_beta_1", "opt_adam_beta_2", "opt_adam_epsilon",
    "opt_weight_decay", "opt_amsgrad", "opt_gradient_clipping", "opt_gradient_clip_norm",
    "opt_learning_rate_warmup_init", "opt_learning_rate_warmup_steps",
    "init_checkpoint_sha256sum",
    "swa_enabled", "swa_decay_rate",
    "model_parameters_count",
)  # fmt: skip


def epoch_num(cycle: int, global_batch_size: int, val_every_iters: int) -> int:
    """``epoch_num`` of train-eval cycle ``cycle`` (1-based): training samples seen at its end."""
    return cycle * global_batch_size * val_every_iters


def cycle_of_iteration(iteration: int, val_every_iters: int) -> int:
    """1-based train-eval cycle that 1-based ``iteration`` belongs to."""
    return (iteration - 1) // val_every_iters + 1


INSTANCE_ENV = "SCALEFOLD_MLPERF_INSTANCE"


def throughput_instance(env: dict[str, str] | None = None) -> int | None:
    """The throughput-mode instance id ``run.sub`` gives each concurrent training (``None``: not set)."""
    value = (os.environ if env is None else env).get(INSTANCE_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{INSTANCE_ENV}={value!r}: expected a non-negative integer (the throughput instance id)")
    return int(value)


class MLPerfLogger:
    """Per-run MLLOG writer.

    Args:
        log_path: file the ``:::MLLOG`` lines are appended to (``None``: no file).
        enabled: whether this process logs (the designated rank); disabled loggers do nothing.
        instance: throughput-mode instance id, added as ``instance`` metadata to every event.
        echo: also print the lines to stdout (what the Slurm log captures).
        deferred: the file is not known yet (``log_path`` must be ``None``): lines are kept in memory,
            with their own timestamps, until :meth:`open_file` names it (e.g. a resumed run's log is
            named after the checkpoint that loads, which is known only after ``init_start``).
    """

    def __init__(
        self,
        log_path: Union[str, Path] | None = None,
        enabled: bool = True,
        instance: int | None = None,
        echo: bool = False,
        deferred: bool = False,
    ) -> None:
        if deferred and log_path is not None:
            raise ValueError("a deferred MLPerfLogger gets its file from open_file(), not log_path")
        self.enabled = enabled
        self.instance = instance
        self.log_path = Path(log_path) if log_path is not None else None
        self._handlers: list[logging.Handler] = []
        self._init_started = False
        self._run_stopped = False
        self._mllogger: _MLLogger | None = None
        self._pylogger: logging.Logger | None = None
        self._buffer: _BufferHandler | None = None
        if not enabled:
            return
        pylogger = logging.getLogger(f"scalefold.mllog.{next(_logger_ids)}")
        pylogger.propagate = False
        pylogger.setLevel(logging.INFO)
        self._pylogger = pylogger
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._handlers.append(_LineFileHandler(self.log_path))
        if deferred:
            self._buffer = _BufferHandler()
            self._handlers.append(self._buffer)
        if echo:
            self._handlers.append(logging.StreamHandler(sys.stdout))
        for handler in self._handlers:
            handler.setLevel(logging.INFO)
            pylogger.addHandler(handler)
        self._mllogger = _MLLogger(logger=pylogger)

    def open_file(self, log_path: Union[str, Path]) -> None:
        """Name the file of a ``deferred`` logger: the lines kept so far are appended to it first, then
        every later line. (Disabled loggers only record the path.)"""
        if self.log_path is not None:
            raise RuntimeError(f"the MLPerf log file is already {self.log_path}")
        self.log_path = Path(log_path)
        if self._buffer is None or self._pylogger is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        handler = _LineFileHandler(self.log_path)
        handler.setLevel(logging.INFO)
        for record in self._buffer.records:
            handler.handle(record)
        handler.flush()
        self._pylogger.removeHandler(self._buffer)
        self._handlers.remove(self._buffer)
        self._buffer = None
        self._pylogger.addHandler(handler)
        self._handlers.append(handler)

    @classmethod
    def for_rank(
        cls, rank: int, log_ranks: tuple[int, ...] = (0,), log_path: Union[str, Path] | None = None, **kwargs: Any
    ) -> MLPerfLogger:
        """A logger enabled only on ``log_ranks`` (training rank 0, plus the first eval rank if async)."""
        return cls(log_path=log_path, enabled=rank in log_ranks, **kwargs)

    # -- primitives -------------------------------------------------------------------------------

    def _metadata(self, metadata: dict | None) -> dict | None:
        if self.instance is None:
            return metadata
        return {**(metadata or {}), "instance": self.instance}

    def _emit(self, kind: str, key: str, value: Any, metadata: dict | None, depth: int) -> None:
        if self._mllogger is None:
            return
        # stack offset: report the first caller outside this module in the line's "file" metadata
        getattr(self._mllogger, kind)(key=key, value=value, metadata=self._metadata(metadata), stack_offset=depth)

    def event(self, key: str, value: Any = None, metadata: dict | None = None, _depth: int = 3) -> None:
        self._emit("event", key, value, metadata, _depth)

    def start(self, key: str, value: Any = None, metadata: dict | None = None, _depth: int = 3) -> None:
        self._emit("start", key, value, metadata, _depth)

    def end(self, key: str, value: Any = None, metadata: dict | None = None, _depth: int = 3) -> None:
        self._emit("end", key, value, metadata, _depth)

    # -- init block -------------------------------------------------------------------------------

    def init_start(self) -> None:
        """``init_start`` then ``cache_clear`` (call before anything expensive).

        ``cache_clear`` is true only when the launcher dropped the page cache before this run and
        says so: ``run.sub`` exports ``SCALEFOLD_CACHE_CLEARED=1`` after ``CLEAR_CACHES=1`` succeeded
        (``0`` otherwise); a run started any other way did not clear caches and logs false."""
        self.start("init_start", _depth=4)
        self.event("cache_clear", caches_cleared(), _depth=4)
        self._init_started = True

    def log_init_block(self, info: Union[MLPerfRunInfo, Mapping[str, Any]]) -> None:
        """Every init-block key in order (``init_start``/``cache_clear`` first if not yet logged)."""
        if not isinstance(info, MLPerfRunInfo):
            info = MLPerfRunInfo.from_mapping(info)
        if not self._init_started:
            self.init_start()
        for key in INIT_BLOCK_KEYS:
            if key == "submission_benchmark":
                value: Any = BENCHMARK
            elif key == "submission_platform":
                value = f"{info.number_of_nodes}x{info.submission_platform}"
            else:
                value = getattr(info, key)
            if key == "init_checkpoint_sha256sum" and value is None:
                continue
            self.event(key, value, _depth=4)

    def staging_start(self) -> None:
        self.event("staging_start", _depth=4)

    def staging_stop(self, duration_s: float | None = None) -> None:
        self.event("staging_stop", metadata=None if duration_s is None else {"staging_duration": duration_s}, _depth=4)

    def init_stop_run_start(self) -> None:
        """End of the untimed init phase, start of time-to-train."""
        self.end("init_stop", _depth=4)
        self.start("run_start", _depth=4)

    def dataset_info(self, train_samples: int, eval_samples: int, dataloader_type: str) -> None:
        """``train_samples``, ``eval_samples`` and ``initial_training_dataloader_type`` (after run_start)."""
        self.event("train_samples", train_samples, _depth=4)
        self.event("eval_samples", eval_samples, _depth=4)
        self.event("initial_training_dataloader_type", dataloader_type, _depth=4)

    # -- train / eval cycles -------------------------------------------------------------------------

    def epoch_start(self, epoch_num: int) -> None:
        self.start("epoch_start", metadata={"epoch_num": epoch_num}, _depth=4)

    def epoch_stop(self, epoch_num: int) -> None:
        self.end("epoch_stop", metadata={"epoch_num": epoch_num}, _depth=4)

    def eval_start(self, epoch_num: int) -> None:
        self.start("eval_start", metadata={"epoch_num": epoch_num}, _depth=4)

    def eval_accuracy(self, value: float, epoch_num: int) -> None:
        self.event("eval_accuracy", float(value), metadata={"epoch_num": epoch_num}, _depth=4)

    def eval_stop(self, epoch_num: int) -> None:
        self.end("eval_stop", metadata={"epoch_num": epoch_num}, _depth=4)

    def tracked_stats(self, values: dict, step: int) -> None:
        self.event("tracked_stats", values, metadata={"step": step}, _depth=4)

    def run_stop(self, status: str) -> None:
        """``run_stop`` with ``status`` "success" (target reached) or "aborted"; logged at most once."""
        if status not in (STATUS_SUCCESS, STATUS_ABORTED):
            raise ValueError(f"run_stop status must be {STATUS_SUCCESS!r} or {STATUS_ABORTED!r}, got {status!r}")
        if self._run_stopped:
            return
        self.end("run_stop", metadata={"status": status}, _depth=4)
        self._run_stopped = True

    def close(self) -> None:
        for handler in self._handlers:
            handler.flush()
            handler.close()
        self._handlers.clear()
        self._mllogger = None

    def __enter__(self) -> MLPerfLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# Compliance checker
# ----------------------------------------------------------------------------------------------


@dataclass
class ComplianceReport:
    ok: bool
    failed_rules: list[str]
    warnings: list[str] = field(default_factory=list)
    output: str = ""


_KEY = r"'([A-Za-z0-9_]+)'"
_PATTERNS: tuple[tuple[re.Pattern, str | None], ...] = (
    (re.compile(rf"CHECK for {_KEY} failed"), None),
    (re.compile(rf"Required AT_LEAST_ONE occurrence of {_KEY} but found"), None),
    (re.compile(rf"Required AT_LEAST\(\d+\) occurrence of {_KEY}"), None),
    (re.compile(r"Failed checks for ([A-Za-z0-9_]+) :"), None),
    (re.compile(r"Log lines had parsing errors"), "parsing_errors"),
    (re.compile(r"No log lines detected"), "no_log_lines"),
    (re.compile(r"Could not find config file"), "missing_config"),
)
_EXACTLY_ONE = re.compile(rf"Required EXACTLY_ONE occurrence of {_KEY} but found (\d+)( with different values)?")
_ALTERNATIVES = re.compile(r"Required AT_LEAST_ONE occurrence of ('[A-Za-z0-9_]+'(?: or '[A-Za-z0-9_]+')+)")
_FAILED_CODE = re.compile(r"Failed executing (?:CHECK )?code.*?\"key\": \"([A-Za-z0-9_]+)\"", re.DOTALL)


def parse_checker_output(text: str) -> tuple[list[str], list[str]]:
    """(failed rule keys, warning keys) named in the compliance checker's output."""
    failed: set[str] = set()
    warnings: set[str] = set()
    for pattern, fixed in _PATTERNS:
        for match in pattern.finditer(text):
            failed.add(fixed or match.group(1))
    for match in _EXACTLY_ONE.finditer(text):
        key, count, different = match.group(1), int(match.group(2)), match.group(3)
        (failed if different or count == 0 else warnings).add(key)
    for match in _ALTERNATIVES.finditer(text):
        failed.add("|".join(k.strip("'") for k in match.group(1).split(" or ")))
    for chunk in re.split(r"\n-{30}\n", text):
        match = _FAILED_CODE.search(chunk)
        if match:
            failed.add(match.group(1))
    return sorted(failed), sorted(warnings - failed)


def check_log(log_path: Union[str, Path], usage: str = USAGE, ruleset: str = RULESET, timeout_s: float = 120) -> ComplianceReport:
    """Run the official compliance checker on ``log_path`` and parse its verdict."""
    cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", usage, "--ruleset", ruleset]
    # the checker insists on writing its own log file: keep it out of the working directory
    with tempfile.TemporaryDirectory(prefix="compliance_") as tmp:
        proc = subprocess.run(
            cmd + ["--log_output", str(Path(tmp) / "checker.log"), str(log_path)],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
    output = proc.stdout + proc.stderr
    failed, warnings = parse_checker_output(output)
    ok = proc.returncode == 0
    if not ok and not failed:
        failed = ["unparsed_failure"]
    return ComplianceReport(ok=ok, failed_rules=failed, warnings=warnings, output=output)


def run_compliance_checker(log_path: Union[str, Path], usage: str = USAGE, ruleset: str = RULESET) -> tuple[bool, list[str]]:
    """``(ok, failed_rules)`` of ``python -m mlperf_logging.compliance_checker --usage hpc --ruleset 3.0.0 LOG``."""
    report = check_log(log_path, usage=usage, ruleset=ruleset)
    return report.ok, report.failed_rules
