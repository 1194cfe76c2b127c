"""Where a run starts from and what it keeps: ``--init-from``, ``--resume`` and the checkpoint policy.

* ``--init-from``: a reference-format checkpoint (MLPerf's), weights strictly and Adam moments onto the
  flat buffers, SWA restarting from the loaded weights (:func:`init_from_checkpoint`);
* ``--resume``: the newest of our own checkpoints that loads, chosen by the main training rank and
  announced to every rank (:func:`choose_resume_checkpoint`), restored by :func:`resume_from_checkpoint`;
* :class:`CheckpointPolicy`: every ``checkpoint_every`` steps and at a requested stop, written by the main
  training rank (atomic, the newest ``keep_last`` kept: :class:`~scalefold.checkpoint.files.CheckpointManager`).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scalefold.checkpoint.files import (
    CheckpointError,
    CheckpointManager,
    build_checkpoint,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    sha256sum,
)
from scalefold.config.training import TrainConfig
from scalefold.diskspace import write_failure
from scalefold.distributed.runtime import Runtime
from scalefold.mlperf.clock import RunClock
from scalefold.mlperf.cycles import mlperf_log_path
from scalefold.model import AlphaFold
from scalefold.model.factory import model_options
from scalefold.optim.adam_swa import FlatAdamSWA


def _run_checkpoint_error(fn):
    """A checkpoint the run cannot start from is reported as ``scalefold train: checkpoint error: ...``, every
    line of it (``--resume`` names each file it could not load)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CheckpointError as exc:
            exc.label, exc.max_lines = "checkpoint error", None
            raise

    return wrapper


@_run_checkpoint_error
def init_from_checkpoint(path: str, model: AlphaFold, opt: FlatAdamSWA, hash_file: bool = True,
                         say=None) -> tuple[int, str | None]:  # fmt: skip
    """Load a reference-format checkpoint (weights strictly, Adam moments onto the flat buffers).

    AlphaFold2's ``.npz`` parameters and OpenFold checkpoints are imported on the way
    (:func:`scalefold.checkpoint.af2_import.read_init_source`; ``say`` gets its one-line summary).

    The MLPerf reference layout: ``alphafold_state_dict`` (reference parameter names),
    ``optimizer_state_dict`` (``torch.optim.Adam``: per-parameter ``step``/``exp_avg``/``exp_avg_sq``
    indexed in parameter order) and ``iteration``. Everything is checked before anything is loaded:
    a corrupt file, mismatching names/shapes or Adam moments raise
    :class:`~scalefold.checkpoint.adapters.CheckpointError` naming the file and listing the
    mismatches. SWA restarts from the loaded weights. Returns ``(stored iteration, sha256 of the file)``
    (``None`` instead of the hash with ``hash_file=False``: the training loop hashes on the logging
    rank only and broadcasts the result).
    """
    from scalefold.checkpoint.adapters import (
        CheckpointError,
        _check_adam_state,
        compare_state_dict,
        extract_model_state_dict,
        load_reference_checkpoint,
    )
    from scalefold.checkpoint.af2_import import read_init_source

    ckpt = read_init_source(path, model, say)  # torch.load(weights_only=True); unreadable -> CheckpointError
    for key in ("alphafold_state_dict", "iteration"):
        if key not in ckpt:
            raise CheckpointError(f"{path}: not a reference checkpoint, no {key!r} (keys: {sorted(ckpt)[:10]})")
    report = compare_state_dict(model, extract_model_state_dict(ckpt))
    if not report.ok:
        raise CheckpointError(f"{path}: parameters do not match the model config: {report.describe()}")
    params = list(model.parameters())
    if "optimizer_state_dict" in ckpt:
        try:
            _check_adam_state(ckpt["optimizer_state_dict"], params)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
    iteration = load_reference_checkpoint(ckpt, model, optimizer=None)  # weights -> the flat master views
    if "optimizer_state_dict" in ckpt:
        try:
            opt.load_state_dict(ckpt["optimizer_state_dict"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: optimizer state does not fit the model: {exc}") from exc
    opt.sync_compute_from_master()
    opt.reset_swa()
    return iteration, sha256sum(path) if hash_file else None


def save_checkpoint(
    checkpoints: CheckpointManager, model: AlphaFold, opt: FlatAdamSWA, step: int, model_preset: str | None = None,
    run_clock: RunClock | None = None, model_options: dict[str, int] | None = None,
) -> Path:
    """Reference keys (weights, Adam state, iteration) plus SWA state, RNG state, data position, the
    model preset name, the run's model options that no parameter shape shows (``model_options``, e.g. the
    structure-module iterations: inference rebuilds that model) and the time to train so far
    (``run_clock``: a resumed run carries it on)."""
    ckpt = build_checkpoint(
        model.state_dict(), opt.state_dict(), step, swa_state=opt.swa_state_dict(),
        rng_state=capture_rng_state(), data_position={"samples_consumed": step}, model_preset=model_preset,
    )  # fmt: skip
    if model_options:
        ckpt["model_options"] = dict(model_options)
    if run_clock is not None and run_clock.running:
        ckpt["time_to_train"] = run_clock.state()
    return checkpoints.save(ckpt)


@_run_checkpoint_error
def resume_from_checkpoint(ckpt: dict[str, Any], cfg: TrainConfig, model: AlphaFold, opt: FlatAdamSWA,
                           source: Any = "checkpoint") -> int:  # fmt: skip
    """Restore weights, Adam and SWA state and RNG state of one of our checkpoints; returns its step.

    A checkpoint of another model preset, or whose parameters do not match the model, is refused
    (:class:`~scalefold.checkpoint.adapters.CheckpointError` listing the mismatches) before anything is
    loaded.
    """
    from scalefold.checkpoint.adapters import CheckpointError, StateDictMismatchError, compare_state_dict

    preset = ckpt.get("model_preset")
    if preset is not None and preset != cfg.model_preset:
        raise CheckpointError(
            f"{source}: checkpoint of model preset {preset!r}, this run builds {cfg.model_preset!r}"
        )
    saved, run = ckpt.get("model_options"), model_options(cfg)
    if saved is not None and dict(saved) != run:  # e.g. another --structure-module-iterations (same shapes);
        # checkpoints written before the options were recorded carry none and are taken as they are
        raise CheckpointError(f"{source}: checkpoint trained with model options {saved or 'the preset defaults'}, "
                              f"this run has {run or 'the preset defaults'}")  # fmt: skip
    missing = [k for k in ("alphafold_state_dict", "optimizer_state_dict", "iteration", "swa_state_dict",
                           "rng_state") if k not in ckpt]  # fmt: skip
    if missing:
        raise CheckpointError(f"{source}: not a resumable ScaleFold checkpoint, missing {missing}")
    report = compare_state_dict(model, ckpt["alphafold_state_dict"])
    if not report.ok:
        error = StateDictMismatchError(report)
        if report.mismatched:  # other widths: another model
            error.hint = (f"this run builds the {cfg.model_preset!r} model preset; a checkpoint of another one (e.g. "
                          "the narrow demo) needs SCALEFOLD_MODEL_PRESET set as for the run that wrote it")  # fmt: skip
        raise error
    model.load_state_dict(ckpt["alphafold_state_dict"])  # copies into the flat master views
    opt.load_state_dict(ckpt["optimizer_state_dict"])
    opt.load_swa_state_dict(ckpt["swa_state_dict"])
    opt.sync_compute_from_master()
    restore_rng_state(ckpt["rng_state"])
    step = int(ckpt["iteration"])
    consumed = int(ckpt.get("data_position", {}).get("samples_consumed", step))
    if consumed != step:
        raise CheckpointError(f"{source}: data position {consumed} != iteration {step}")
    return step


@_run_checkpoint_error
def choose_resume_checkpoint(cfg: TrainConfig, runtime: Runtime, checkpoints: CheckpointManager) -> tuple[Path | None, dict | None]:
    """``--resume``: (path, content) of the newest checkpoint that loads, ``(None, None)`` when there is no
    checkpoint at all (a fresh start). The main training rank chooses and tells every rank (collective
    over all ranks): the other training ranks load the same file, evaluation ranks only need its name
    (the MLPerf log's). Raises :class:`CheckpointError` on every rank, listing each file's error, when
    checkpoint files exist but none of them loads."""
    main = runtime.parallel.is_main_train_rank
    choice: list[Any] = [None]
    ckpt = None
    if main:
        checkpoints.prune()  # temporary files of a killed writer go; complete checkpoints stay
        try:
            found = checkpoints.load_resumable()
        except CheckpointError as exc:
            choice[0] = ("error", str(exc))
        else:
            if found is None:
                choice[0] = ("none", str(checkpoints.directory))
            else:
                path, ckpt, skipped = found
                for error in skipped:
                    print(f"scalefold train: --resume: skipping a checkpoint that does not load: {error}", flush=True)
                choice[0] = ("path", str(path))
    if runtime.distributed:
        dist.broadcast_object_list(choice, src=runtime.parallel.main_train_rank)
    kind, value = choice[0]
    if kind == "error":
        raise CheckpointError(f"--resume: {value}")
    if kind == "none":
        if main:
            print(f"scalefold train: --resume: no checkpoint in {value}; starting from step 0 (metrics.jsonl "
                  f"restarted, MLPerf log {mlperf_log_path(cfg).name})", flush=True)  # fmt: skip
        return None, None
    path = Path(value)
    if ckpt is None and runtime.parallel.is_train_rank:
        ckpt = load_checkpoint(path)
    return path, ckpt


#: exit status of a run whose last checkpoint could not be written (``scalefold train``)
EXIT_CHECKPOINT_NOT_WRITTEN = 5


class CheckpointNotWritten(RuntimeError):
    """The run ended but its last checkpoint could not be written (a full disk): the steps after the newest
    good checkpoint are not kept. ``scalefold train`` prints the message and exits with :attr:`exit_status`."""

    exit_status = EXIT_CHECKPOINT_NOT_WRITTEN


class CheckpointPolicy:
    """When the main training rank writes a checkpoint: every ``cfg.checkpoint_every`` steps, at the last
    step and at a requested stop (pre-emption); the other ranks only take part in the timing.

    A checkpoint the file system refuses (full, over quota, an I/O error) costs one line naming the path,
    the free space and the newest good checkpoint; training goes on and the next due checkpoint is the
    retry. The atomic write leaves the previous checkpoints as they were (none pruned), so the newest
    file is always a complete one. :attr:`unsaved` says whether the last due checkpoint is missing."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, out: Path) -> None:
        self.every, self.model_preset = cfg.checkpoint_every, cfg.model_preset
        self.model_options = model_options(cfg)
        self.main = runtime.parallel.is_main_train_rank
        self.heartbeat = runtime.heartbeat
        self.manager = CheckpointManager(out / "checkpoints", keep_last=cfg.keep_last)
        self.failed_step: int | None = None  # the last due checkpoint failed (None: written, or none due yet)
        self._final = False
        self.episode_start = 0  # the first failed step of the current episode
        self.failure: str = ""

    def due(self, step: int, stop: bool, last: bool = False) -> bool:
        """Every ``checkpoint_every`` steps and at the run's last step (when checkpointing is on), and
        at a requested stop."""
        due = bool(self.every and (step % self.every == 0 or last)) or stop
        self._final = due and (last or stop)  # the run's last checkpoint: no later one retries it
        return due

    def save(self, model: AlphaFold, opt: FlatAdamSWA, step: int, timings: dict[str, float],
             run_clock: RunClock | None = None) -> Path | None:  # fmt: skip
        """The checkpoint of ``step`` (main training rank); ``None`` elsewhere and when it could not be written."""
        t_ckpt = time.perf_counter()
        path = None
        if self.main:
            with self.heartbeat.busy("checkpoint"):  # peers waiting meanwhile are not stalled
                path = self._save(model, opt, step, run_clock)
        timings["checkpoint"] += time.perf_counter() - t_ckpt
        return path

    def _save(self, model: AlphaFold, opt: FlatAdamSWA, step: int, run_clock: RunClock | None) -> Path | None:
        try:
            path = save_checkpoint(self.manager, model, opt, step, model_preset=self.model_preset,
                                   run_clock=run_clock, model_options=self.model_options)  # fmt: skip
        except OSError as exc:
            self._failed(step, exc)
            return None
        if self.failed_step is not None:
            _say(f"scalefold train: checkpoint of step {step} written ({path}); the failed one(s) since step "
                 f"{self.episode_start} are superseded")  # fmt: skip
        self.failed_step = None
        return path

    def _failed(self, step: int, exc: OSError) -> None:
        """Record the failure; one line for the first of an episode (and for the run's last checkpoint)."""
        first = self.failed_step is None
        if first:
            self.episode_start = step
        newest = self.manager.latest()
        if self._final:
            nxt = f"the run's last checkpoint: it ends with exit status {EXIT_CHECKPOINT_NOT_WRITTEN}"
        elif self.every:
            nxt = f"training goes on, retried at step {step + self.every - step % self.every}"
        else:
            nxt = "training goes on, retried at the next stop"
        self.failed_step = step
        self.failure = (f"checkpoint of step {step} not written to {self.manager.path_for(step)}: "
                        f"{write_failure(self.manager.directory, exc)}; newest good checkpoint: "
                        f"{newest if newest is not None else 'none'}")  # fmt: skip
        if first or self._final:
            _say(f"scalefold train: {self.failure} ({nxt})")

    @property
    def unsaved(self) -> str | None:
        """Why the last due checkpoint is missing (``None``: it was written, or none was due)."""
        return self.failure if self.failed_step is not None else None

    def raise_if_unsaved(self, resume_hint: str = "") -> None:
        """:class:`CheckpointNotWritten` when the run's last due checkpoint is missing (main training rank)."""
        if self.unsaved is not None:
            raise CheckpointNotWritten(f"the run's last {self.unsaved}. {resume_hint}".rstrip())


def resume_args(cfg: TrainConfig) -> list[str]:
    """``scalefold train`` arguments that resume ``cfg``'s run, for a run not started from the command line."""
    return ["train", "--preset", cfg.preset, "--out", str(cfg.out), "--store", str(cfg.store), "--resume"]


def _say(line: str) -> None:
    """One line on standard error, in one write (ranks share the launcher's pipe)."""
    sys.stderr.flush()
    print(line, file=sys.stderr, flush=True)


__all__ = [
    "EXIT_CHECKPOINT_NOT_WRITTEN", "CheckpointNotWritten", "CheckpointPolicy", "choose_resume_checkpoint",
    "init_from_checkpoint", "resume_args", "resume_from_checkpoint", "save_checkpoint",
]  # fmt: skip
