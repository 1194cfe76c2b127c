"""The MLPerf side of a training run: which file, the init block, and the train-eval cycles.

The logger itself (:mod:`.logger`) writes events; this component knows the run: the log is
named once the starting point is known (a resumed run logs its own init..run_stop sequence to
``mlperf_resumed_<iteration>.log``, as the compliance checker expects one run per file), the init block
is filled from the run's options, and a cycle of ``eval_every`` steps opens with ``epoch_start`` and
closes with ``epoch_stop`` (also when the run ends inside one). ``run_stop`` is logged by the loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalefold.checkpoint.files import CHECKPOINT_PREFIX
from scalefold.config.training import TrainConfig
from scalefold.mlperf import logger as mll


def mlperf_log_path(cfg: TrainConfig, resumed_from: Path | None = None) -> Path:
    """``<out>/mlperf.log``; a run resumed from checkpoint ``resumed_from`` (the one that loaded) logs its
    own init..run_stop sequence to ``<out>/mlperf_resumed_<iteration>.log`` (one run per file, as the
    compliance checker expects)."""
    out = Path(cfg.out)
    if resumed_from is None:
        return out / "mlperf.log"
    return out / f"mlperf_resumed_{Path(resumed_from).stem[len(CHECKPOINT_PREFIX):]}.log"


def run_info(cfg: TrainConfig, runtime: Any, features: Any, *, eval_every: int, num_params: int,
             init_sha: str | None, train_max_pdb_release_date: str) -> mll.MLPerfRunInfo:  # fmt: skip
    """The init block's values: the run's options, its layout and its data-pipeline sizes."""
    device = runtime.device
    return mll.MLPerfRunInfo(
        seed=cfg.seed, number_of_ranks=runtime.world_size, number_of_nodes=runtime.num_nodes,
        accelerators_per_node=runtime.local_world_size if device.type == "cuda" else 0,
        submission_platform=cfg.submission_platform or device.type, submission_org=cfg.submission_org,
        global_batch_size=runtime.parallel.dp_size,
        val_every_iters=eval_every, precision=cfg.precision,
        target_avg_lddt_ca_value=cfg.target_lddt, val_min_cameo_submission_date=cfg.val_min_date,
        val_max_cameo_submission_date=cfg.val_max_date, train_max_pdb_release_date=train_max_pdb_release_date,
        val_max_sequence_length=cfg.val_max_sequence_length,
        train_sequence_crop_size=features.train_sequence_crop_size,
        num_recycling_iters=features.num_recycling_iters, max_msa_clusters=features.max_msa_clusters,
        max_extra_msa=features.max_extra_msa, max_templates=features.max_templates,
        opt_base_learning_rate=cfg.lr, opt_gradient_clip_norm=cfg.clip_grad_max_norm,
        opt_learning_rate_warmup_init=cfg.warmup_lr_init, opt_learning_rate_warmup_steps=cfg.warmup_steps,
        init_checkpoint_sha256sum=init_sha, swa_decay_rate=cfg.swa_decay, model_parameters_count=num_params,
    )  # fmt: skip


class MLPerfCycles:
    """``epoch_start`` / ``epoch_stop`` of the train-eval cycles (``eval_every`` steps of ``global_batch``
    samples each); :meth:`close` ends a cycle the run stopped inside (samples seen so far)."""

    def __init__(self, log: mll.MLPerfLogger, eval_every: int, global_batch: int, start_step: int) -> None:
        self.log, self.eval_every, self.global_batch, self.start_step = log, eval_every, global_batch, start_step
        self._open_samples: int | None = None  # samples seen by the end of the open cycle (None: none open)

    def step(self, step: int) -> None:
        """Step ``step`` begins (a cycle starts, or a resumed run re-opens its cycle)."""
        if (step - 1) % self.eval_every == 0 or step == self.start_step + 1:
            self.log.epoch_start(self.epoch_before(step))
        self._open_samples = step * self.global_batch

    def epoch_before(self, step: int) -> int:
        """The epoch number (samples) at the start of ``step``'s cycle."""
        return mll.epoch_num(mll.cycle_of_iteration(step, self.eval_every) - 1, self.global_batch, self.eval_every)

    def end(self, step: int) -> int:
        """The cycle of ``step`` ends (its evaluation follows); returns its epoch number."""
        epoch = mll.epoch_num(mll.cycle_of_iteration(step, self.eval_every), self.global_batch, self.eval_every)
        epoch = min(epoch, step * self.global_batch)  # the run's last cycle may be short: samples seen
        self.log.epoch_stop(epoch)
        self._open_samples = None
        return epoch

    def close(self) -> None:
        if self._open_samples is not None:
            self.log.epoch_stop(self._open_samples)
            self._open_samples = None


__all__ = ["MLPerfCycles", "mlperf_log_path", "run_info"]
