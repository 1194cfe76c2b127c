"""Evaluation of the SWA weights at the end of each train-eval cycle: synchronous or asynchronous.

The :class:`~scalefold.train.loop.Trainer` holds one of two components with the same three calls
(``prepare`` after ``run_start``, ``after_cycle`` at the end of each cycle, ``close`` at the end):

* :class:`SyncEvaluation` -- the main training rank scores the validation batches it keeps in host
  DRAM (:class:`~scalefold.data.eval_cache.EvalCache`) and broadcasts the score, so every training rank
  stops together when it reaches the target; it also scores the untrained model (step 0, for the curves
  only: not in the MLPerf log; skipped with ``--init-from``, on resume and with ``eval_baseline`` off);
* :class:`AsyncEvaluation` -- the SWA weights go to the last ``num_async_eval_ranks`` ranks
  (:mod:`.async_eval`), training goes on; those ranks run :func:`serve_evaluations` from the start.

:func:`evaluate` is the score both compute (mean chain-level lDDT-Cα over all recycling passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scalefold.data.eval_cache import EvalCache
from scalefold.metrics import validation_lddt_ca
from scalefold.train import mlperf_logging as mll
from scalefold.train.run_log import MetricsLog, TrainResult
from scalefold.train.steps import broadcast_float, to_device


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], autocast: bool) -> float:
    """Mean chain-level lDDT-Cα of ``model`` over the validation ``batches`` (all recycling passes)."""
    model.eval()
    scores = []
    for batch in batches:
        device_type = batch["aatype"].device.type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            out = model(batch)
        score = validation_lddt_ca(
            out["final_atom_positions"].float(),  # [1, N_res, 37, 3]
            batch["all_atom_positions"][..., -1].float(),
            batch["all_atom_mask"][..., -1].float(),
        )
        scores.append(float(score.mean()))
    return float(np.mean(scores)) if scores else float("nan")


class EvaluationRanksFailed(RuntimeError):
    """The asynchronous evaluation ranks failed, are stuck or were lost (the run aborts)."""


@dataclass
class EvalContext:
    """What an evaluation component reports to: the run's records (main training rank) and its numerics."""

    metrics: MetricsLog
    result: TrainResult
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

    def prepare(self, baseline: bool, what: str = "untrained model") -> None:
        """Build the validation cache (after run_start: timed) and, with ``baseline``, score the starting
        weights (``what``: the untrained model or the initial checkpoint; step 0, for the curves and the
        lDDT-Cα before training, not in the MLPerf log)."""
        if not (self.main and self.enabled):
            return
        self.cache = self.make_cache()
        if baseline:
            score = self._score()
            self.ctx.metrics.write({"step": 0, "eval_lddt_ca": score, "epoch_num": 0})
            self.ctx.metrics.flush()
            self.ctx.result.eval_history.append((0, score))
            print(f"step 0: eval lDDT-Cα {score:.4f} ({what}; not in the MLPerf log)", flush=True)

    def _score(self) -> float:
        return evaluate(self.eval_model, self.cache.batches(self.ctx.device, self.ctx.dtype), self.ctx.autocast)

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
        return None

    @property
    def failed(self) -> bool:
        return False

    @property
    def run_stop_logged(self) -> bool:
        """Training logs ``run_stop`` itself (its own evaluation decides the status)."""
        return False


class AsyncEvaluation:
    """The SWA weights handed to the evaluation ranks at the end of each cycle; training goes on."""

    def __init__(self, ctx: EvalContext, runtime: Any, opt: Any, timeout_s: float) -> None:
        from scalefold.train.async_eval import AsyncEvalClient, swa_flat_buffer

        self.ctx = ctx
        self.swa_flat = swa_flat_buffer(opt)  # sent as is: the evaluation model's layout
        self.client = AsyncEvalClient(runtime, self.swa_flat.numel(), self.swa_flat.dtype, timeout_s=timeout_s)

    def prepare(self, baseline: bool, what: str = "") -> None:
        """Nothing to build here: the evaluation ranks cache their share of the validation set."""

    def after_cycle(self, step: int, epoch: int) -> bool:
        """Submit ``step``'s weights; ``True`` when an earlier evaluation reached the target. Raises
        :class:`EvaluationRanksFailed` when the evaluation ranks failed or are stuck."""
        self.client.submit(step, epoch, self.swa_flat)
        try:
            done = self.client.should_stop()
        except RuntimeError as exc:
            raise EvaluationRanksFailed(str(exc)) from exc
        self._record()
        if done:
            self.ctx.result.status = mll.STATUS_SUCCESS
        return done

    def _record(self) -> None:
        """Evaluations the evaluation ranks finished since the last call -> metrics, console."""
        ctx = self.ctx
        for r in self.client.take_results():
            ctx.metrics.write({"step": r.step, "eval_lddt_ca": r.score, "epoch_num": r.epoch})
            ctx.result.eval_history.append((r.step, r.score))
            ctx.progress.write(f"step {r.step}: eval lDDT-Cα {r.score:.4f} (evaluation ranks)")

    @property
    def failed(self) -> bool:
        return self.client.failed

    @property
    def run_stop_logged(self) -> bool:
        """The main evaluation rank logged ``run_stop success`` (training does not log run_stop then)."""
        return self.client.target_reached

    def close(self) -> RuntimeError | None:
        """Wait for the pending evaluations (in order) and record them; returns a failure, if any."""
        failure = None
        try:
            self.client.close()
        except RuntimeError as exc:
            failure = exc
        self._record()
        if self.client.target_reached:
            self.ctx.result.status = mll.STATUS_SUCCESS
        return failure


def serve_evaluations(cfg: Any, runtime: Any, build_model: Callable[[], torch.nn.Module], features: Any,
                      mllog_path: Any, autocast: bool, dtype: torch.dtype) -> None:  # fmt: skip
    """An asynchronous evaluation rank, after training's ``run_start``: cache its share of the validation
    set (timed), then serve evaluations until training's end-of-training sentinel (the first evaluation
    rank logs eval_* and run_stop success)."""
    from scalefold.data.store import Store
    from scalefold.train import async_eval
    from scalefold.train.run_data import validation_chain_ids

    device, store_path = runtime.device, str(Path(cfg.store))
    with Store.open(store_path) as store:
        val_ids = validation_chain_ids(store, cfg)
    cache = async_eval.store_eval_cache(store_path, val_ids, features, runtime, cfg.num_workers)
    eval_log = mll.MLPerfLogger(mllog_path, enabled=runtime.parallel.is_main_eval_rank,
                                instance=mll.throughput_instance())  # fmt: skip
    try:
        async_eval.run_eval_rank(
            cfg, runtime, build_model, cache, lambda m, b: evaluate(m, [to_device(b, device, dtype)], autocast), eval_log,
        )  # fmt: skip
    finally:
        eval_log.close()


__all__ = ["AsyncEvaluation", "EvalContext", "EvaluationRanksFailed", "SyncEvaluation", "evaluate", "serve_evaluations"]
