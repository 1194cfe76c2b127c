"""Evaluation of the SWA weights at the end of each train-eval cycle, synchronous (on the main training rank).

The :class:`~scalefold.train.trainer.Trainer` holds one of two components with the same calls
(``keep_start`` before ``run_start``, ``prepare`` after it, ``ready`` before each cycle's evaluation,
``after_cycle`` at the end of each cycle, ``close`` at the end, ``score_start`` for the starting point after
``run_stop``; ``target_step`` / ``run_stop_at`` for the run's time account):

* :class:`SyncEvaluation` -- the main training rank scores the validation batches it keeps in host
  DRAM (:class:`~scalefold.evaluation.cache.EvalCache`, built in the background while the first cycle
  trains) and broadcasts the score, so every training rank stops together when it reaches the target;
  it also scores the starting weights after the run (step 0, for the curves only: not in the MLPerf log;
  skipped on resume and with ``eval_baseline`` off);
* :class:`~scalefold.evaluation.client.AsyncEvaluation` -- the SWA weights go to the last
  ``num_async_eval_ranks`` ranks (:mod:`scalefold.evaluation.server`), training goes on.

:func:`~scalefold.evaluation.scoring.score_batches` is the score both compute (mean chain-level
lDDT-Cα over all recycling passes). :class:`EvalContext` is what both report to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from scalefold.distributed.agreement import broadcast_float
from scalefold.evaluation.cache import EvalCache
from scalefold.evaluation.scoring import score_batches
from scalefold.mlperf import logger as mll


@dataclass
class EvalContext:
    """What an evaluation component reports to: the run's records (main training rank) and its numerics."""

    metrics: Any  # the run's metrics.jsonl writer: write(record), flush()
    result: Any  # the run's result: status, eval_history
    progress: Any  # the tqdm bar (its ``write`` keeps the bar intact)
    mllog: mll.MLPerfLogger
    device: torch.device
    dtype: torch.dtype
    autocast: bool
    target_lddt: float


class SyncEvaluation:
    """Evaluation on the main training rank, the score broadcast to every training rank."""

    def __init__(self, ctx: EvalContext, runtime: Any, eval_model: torch.nn.Module | None,
                 make_cache: Callable[[], EvalCache], enabled: bool) -> None:  # fmt: skip
        self.ctx, self.eval_model, self.make_cache, self.enabled = ctx, eval_model, make_cache, enabled
        self.main = runtime.parallel.is_main_train_rank
        self.src, self.group = runtime.parallel.main_train_rank, runtime.parallel.train_group
        self.collective = runtime.distributed and runtime.parallel.num_train_ranks > 1
        self.cache: EvalCache | None = None
        self._building: threading.Thread | None = None  # the cache's background build (prepare -> ready)
        self._build_error: BaseException | None = None
        self._start: list[torch.Tensor] | None = None  # the starting weights (keep_start), scored after run_stop

    def prepare(self) -> None:
        """Start building the validation cache (after run_start: timed) in a background thread: the first
        cycle trains meanwhile (with loader workers the features are built in their processes), and the
        first evaluation waits only for what is left (:meth:`ready`)."""
        if self.main and self.enabled:
            self._building = threading.Thread(target=self._build, name="scalefold-eval-cache", daemon=True)
            self._building.start()

    def _build(self) -> None:
        try:
            self.cache = self.make_cache()
        except BaseException as exc:  # noqa: BLE001 -- raised on the training thread by ready()
            self._build_error = exc

    def ready(self) -> None:
        """Wait until the validation cache is built (raises what its build raised)."""
        if self._building is not None:
            self._building.join()
            self._building = None
        if self._build_error is not None:
            error, self._build_error = self._build_error, None
            raise error

    def keep_start(self) -> None:
        """Keep a copy of the starting weights (the evaluation model's: the SWA weights before the first
        step) for :meth:`score_start` after the run (before ``run_start``; one copy of the parameters)."""
        if self.main and self.enabled and self.eval_model is not None:
            self._start = [p.detach().clone() for p in self.eval_model.parameters()]

    def score_start(self, what: str = "untrained model") -> None:
        """Score the starting weights (``what``: the untrained model or the initial checkpoint; step 0, for
        the curves and the lDDT-Cα before training, not in the MLPerf log): those :meth:`keep_start` kept,
        swapped in for the scoring and out again (after ``run_stop``: untimed), else the current ones.
        The record goes first in ``metrics.jsonl`` and in the history (step order)."""
        if not (self.main and self.enabled) or (self._building is None and self.cache is None):
            return  # nothing to score with: evaluation off, or the cache's build failed (reported already)
        params = list(self.eval_model.parameters()) if self._start is not None else []
        now = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, start in zip(params, self._start or []):
                p.copy_(start)
            try:
                score = self._score()
            finally:
                for p, current in zip(params, now):
                    p.copy_(current)
        self.ctx.metrics.write_first({"step": 0, "eval_lddt_ca": score, "epoch_num": 0})
        self.ctx.result.eval_history.insert(0, (0, score))
        print(f"step 0: eval lDDT-Cα {score:.4f} ({what}; scored after run_stop, untimed; not in the MLPerf log)",
              flush=True)  # fmt: skip

    def _score(self) -> float:
        self.ready()
        return score_batches(self.eval_model, self.cache.batches(self.ctx.device, self.ctx.dtype), self.ctx.autocast)

    def after_cycle(self, step: int, epoch: int) -> bool:
        """Score the SWA weights of ``step``; ``True`` when the target is reached (every rank)."""
        ctx, score = self.ctx, float("nan")
        if self.main:
            ctx.mllog.eval_start(epoch)
            ctx.progress.set_description(f"evaluating step {step} (SWA weights)", refresh=True)  # no frozen bar
            score = self._score()
            ctx.progress.set_description("train", refresh=False)
            ctx.mllog.eval_accuracy(score, epoch)
            ctx.mllog.eval_stop(epoch)
            ctx.metrics.write({"step": step, "eval_lddt_ca": score, "epoch_num": epoch})
            ctx.progress.write(f"step {step}: eval lDDT-Cα {score:.4f}")
        score = broadcast_float(score, self.src, self.group, ctx.device, self.collective)
        ctx.result.eval_history.append((step, score))
        if score >= ctx.target_lddt:
            ctx.result.status = mll.STATUS_SUCCESS
            return True
        return False

    def close(self) -> RuntimeError | None:
        """A run that ends before its first evaluation still waits for the cache's build (no thread left)."""
        if self._building is not None:
            self._building.join()
            self._building = None
        return None

    @property
    def failed(self) -> bool:
        return False

    @property
    def run_stop_logged(self) -> bool:
        """Training logs ``run_stop`` itself (its own evaluation decides the status)."""
        return False

    #: logged by training itself: no step or wall time of another process's ``run_stop``
    target_step = run_stop_at = None


__all__ = ["EvalContext", "SyncEvaluation"]
