"""The evaluation ranks' end of asynchronous evaluation: cache the validation set, serve submissions.

:func:`serve_evaluations` is what an asynchronous evaluation rank runs from the start of a training run;
:func:`run_eval_rank` serves the requests of :mod:`scalefold.evaluation.protocol` until training's
end-of-training sentinel (the first evaluation rank receives and replies; the group scores its LPT
shares of the targets and sums them).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from scalefold.data.batch import move_batch
from scalefold.distributed.runtime import Runtime
from scalefold.evaluation.cache import EvalCache, assign_lpt
from scalefold.evaluation.protocol import (
    _DTYPES,
    _HEADER,
    _REJECTED,
    _TAG_HEADER,
    _TAG_PAYLOAD,
    _TAG_REPLY,
    DONE,
    FAILED,
    RESULT,
    SENTINEL,
    SKIPPED,
    SUBMIT,
    EvalResult,
    bind_flat_parameters,
    encode_reply,
)
from scalefold.evaluation.scoring import score_batches
from scalefold.mlperf import logger as mll
from scalefold.optim.adam_swa import DEFAULT_ALIGN_NUMEL


class _EvalShard:
    """This evaluation rank's validation targets, kept in host memory: ``(target index, batch)``."""

    def __init__(self, eval_batches: Callable[[list[int]], list[dict]] | EvalCache,
                 target_lengths: Sequence[int] | None, rank: int, num_ranks: int) -> None:  # fmt: skip
        if isinstance(eval_batches, EvalCache):
            eval_batches.fill()
            self.indices = list(eval_batches.assigned)
            self._cache: EvalCache | None = eval_batches
            self._batches: list[dict] = []
        else:
            if target_lengths is None:
                raise ValueError("run_eval_rank: a callable eval_batches needs target_lengths (for the LPT assignment)")
            self.indices = assign_lpt(list(target_lengths), num_ranks)[rank]
            self._batches = list(eval_batches(list(self.indices)))
            self._cache = None
            if len(self._batches) != len(self.indices):
                raise ValueError(f"eval_batches returned {len(self._batches)} batches for {len(self.indices)} targets")
        self.num_targets = 0  # over the whole evaluation group (set after the setup reduction)

    def on(self, device: torch.device):
        """``(target index, batch)`` with each batch a fresh copy on ``device`` (one copy: the cache's
        own host-to-device copy, asynchronous from pinned memory)."""
        if self._cache is not None:
            return zip(self.indices, self._cache.batches(device))
        return ((i, move_batch(b, device, copy=True)) for i, b in zip(self.indices, self._batches))


def store_eval_cache(store_path: str, chain_ids: Sequence[str], features: Any, runtime: Runtime,
                     num_workers: int = 0) -> EvalCache:  # fmt: skip
    """This evaluation rank's :class:`EvalCache` of the validation chains ``chain_ids`` of a store.

    Targets are spread over the evaluation group by LPT with cost L² (residue counts from the
    store's chain table); each target keeps the reference's fixed validation seed
    (:class:`~scalefold.data.dataset.StoreSample` in ``"eval"`` mode). Nothing is computed here:
    :func:`run_eval_rank` builds the features once at its start, while training runs its first
    cycle (``num_workers`` loader workers), and every evaluation replays them from host memory.
    """
    from scalefold.evaluation.cache import validation_cache

    if not runtime.parallel.is_eval_rank:
        raise ValueError(f"rank {runtime.rank} is not an evaluation rank")
    return validation_cache(store_path, list(chain_ids), features, rank=runtime.parallel.eval_ranks.index(runtime.rank),
                            num_ranks=len(runtime.parallel.eval_ranks), num_workers=num_workers,
                            pin_memory=runtime.device.type == "cuda")  # fmt: skip


def _say(line: str) -> None:
    """One console line, written at once (ranks share the launcher's stdout)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _gather_errors(runtime: Runtime, local_error: str | None) -> str:
    """Every evaluation rank's error message (collective over the evaluation group)."""
    messages: list[str | None] = [None] * len(runtime.parallel.eval_ranks)
    dist.all_gather_object(messages, local_error, group=runtime.parallel.eval_group)
    return "; ".join(f"evaluation rank {r}: {m}" for r, m in zip(runtime.parallel.eval_ranks, messages) if m)


def run_eval_rank(
    cfg: Any,
    runtime: Runtime,
    build_model: Callable[[], nn.Module],
    eval_batches: Callable[[list[int]], list[dict]] | EvalCache,
    score_fn: Callable[[nn.Module, dict], float],
    mllog: mll.MLPerfLogger | None,
    *,
    target_lengths: Sequence[int] | None = None,
    align_numel: int = DEFAULT_ALIGN_NUMEL,
) -> list[EvalResult]:
    """Serve evaluations until training sends the end-of-training sentinel (every evaluation rank).

    Args:
        cfg: anything with ``target_lddt`` (the training config).
        build_model: builds the evaluation model (same architecture as the trained one).
        eval_batches: an :class:`EvalCache` built for this rank (``rank`` = index in the evaluation
            group), or a callable returning the batches of the target indices it is given (this
            rank's LPT share of ``target_lengths``); either way built once, kept in host memory.
        score_fn: ``(model, batch) -> lDDT-Cα`` of one target (called under ``torch.no_grad()``).
        mllog: the first evaluation rank's MLPerf logger (``None``: no MLPerf lines).
        target_lengths: residue counts of all validation targets (callable ``eval_batches`` only).
        align_numel: the training optimizer's ``align_numel`` (flat layout of the weights).

    Returns the evaluations done (same list on every evaluation rank). Raises ``RuntimeError``
    after reporting a failure of any evaluation rank to training.
    """
    if not runtime.parallel.is_eval_rank:
        raise ValueError(f"rank {runtime.rank} is not an evaluation rank")
    model, weights, shard, error = _setup_eval_rank(runtime, build_model, eval_batches, target_lengths, align_numel)
    inbox = _Inbox(runtime) if runtime.parallel.is_main_eval_rank else None
    if error is not None:  # the same on every evaluation rank
        _report_setup_failure(runtime, inbox, error)
    _say(f"scalefold: evaluation rank {runtime.rank}: {len(shard.indices)} of {shard.num_targets} validation "
         f"targets (LPT, cost ~ L^2), features cached in host memory")  # fmt: skip
    served = _Submission(runtime, model, weights, shard, score_fn, mllog, inbox, float(cfg.target_lddt))
    results: list[EvalResult] = []
    stopped = False
    header = torch.zeros(len(_HEADER), dtype=torch.int64, device=runtime.device)
    while True:
        try:
            kind, step, epoch = _next_request(runtime, inbox, header, weights.numel())
            if kind == SENTINEL:
                if inbox is not None:
                    inbox.reply(encode_reply(DONE))
                break
            if stopped:  # target already reached: received and dropped, nothing logged after run_stop
                if inbox is not None:
                    inbox.reply(encode_reply(SKIPPED, step, epoch))
                continue
            results.append(served.evaluate(step, epoch))
            stopped = results[-1].target_reached
        except _GroupFailure as exc:
            if inbox is not None:
                inbox.reply_failure(str(exc))
            _await_end_of_training(runtime, inbox)
            raise RuntimeError(f"asynchronous evaluation failed: {exc}") from None
        except Exception as exc:
            if inbox is not None:
                inbox.reply_failure(_error_text(exc))
            raise
    return results


def _report_setup_failure(runtime: Runtime, inbox: _Inbox | None, error: str) -> None:
    """A failed set-up (known to the whole group): answer training's next request with it, wait for the
    end of training, raise."""
    if inbox is not None:  # answer training's next request with the failure
        inbox.receive()
        inbox.reply(encode_reply(FAILED, inbox.step, inbox.epoch, message=error))
    ended = inbox is not None and int(inbox.header[0]) == SENTINEL  # that request was the sentinel
    _await_end_of_training(runtime, inbox, sentinel_seen=ended)
    raise RuntimeError(f"asynchronous evaluation failed: {error}")


def _next_request(runtime: Runtime, inbox: _Inbox | None, header: torch.Tensor, numel: int) -> tuple[int, int, int]:
    """``(kind, step, epoch)`` of training's next request, the same on every evaluation rank (the first
    receives it and broadcasts the header); raises :class:`_GroupFailure` for unusable weights."""
    if inbox is not None:
        header.copy_(inbox.receive(expected_numel=numel))
    dist.broadcast(header, src=runtime.parallel.main_eval_rank, group=runtime.parallel.eval_group)
    kind, step, epoch = int(header[0]), int(header[1]), int(header[2])
    if kind == _REJECTED:
        raise _GroupFailure(inbox.error if inbox is not None else "the first evaluation rank rejected the weights")
    return kind, step, epoch


class _Submission:
    """Scoring one submission: this rank's share of the targets with the received SWA weights, summed
    over the group; the first evaluation rank logs and replies."""

    def __init__(self, runtime: Runtime, model: nn.Module, weights: torch.Tensor, shard: _EvalShard,
                 score_fn: Callable[[nn.Module, dict], float], mllog: mll.MLPerfLogger | None,
                 inbox: _Inbox | None, target: float) -> None:  # fmt: skip
        self.runtime, self.model, self.weights, self.shard, self.score_fn = runtime, model, weights, shard, score_fn
        self.mllog, self.inbox, self.target = mllog, inbox, target

    def evaluate(self, step: int, epoch: int) -> EvalResult:
        runtime, inbox, mllog = self.runtime, self.inbox, self.mllog
        if inbox is not None:
            self.weights.copy_(inbox.payload)
            if mllog is not None:
                mllog.eval_start(epoch)
        dist.broadcast(self.weights, src=runtime.parallel.main_eval_rank, group=runtime.parallel.eval_group)
        t0 = time.perf_counter()
        score = _evaluate(runtime, self.model, self.shard, self.score_fn)
        stopped = score >= self.target
        if runtime.parallel.is_main_eval_rank:
            _say(f"scalefold: evaluated the SWA weights of step {step}: lDDT-Cα {score:.4f} in "
                 f"{time.perf_counter() - t0:.2f} s" + (f" (target {self.target:g} reached)" if stopped else ""))  # fmt: skip
        at = time.time()  # the reply's wall time: run_stop's, when the target is reached (the run's time account)
        if inbox is not None:
            if mllog is not None:
                mllog.eval_accuracy(score, epoch)
                mllog.eval_stop(epoch)
                if stopped:
                    mllog.run_stop(mll.STATUS_SUCCESS)
                    at = time.time()
            inbox.reply(encode_reply(RESULT, step, epoch, score, stopped, at=at))
        return EvalResult(step, epoch, score, stopped, at)


class _GroupFailure(Exception):
    """An evaluation rank failed; every rank of the evaluation group knows it."""


class _Inbox:
    """The first evaluation rank's end of the bridge: one request at a time, one reply each."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.header = torch.zeros(len(_HEADER), dtype=torch.int64)
        self.payload: torch.Tensor | None = None
        self.error = ""
        self.step = self.epoch = 0
        self._replied = True

    def _send(self, reply: torch.Tensor) -> None:
        dist.send(reply, dst=self.runtime.parallel.main_train_rank, group=self.runtime.parallel.bridge_group, tag=_TAG_REPLY)

    def receive(self, expected_numel: int | None = None) -> torch.Tensor:
        """The next request's header (its weights in :attr:`payload`); kind ``_REJECTED`` if unusable."""
        src, bridge = self.runtime.parallel.main_train_rank, self.runtime.parallel.bridge_group
        dist.recv(self.header, src=src, group=bridge, tag=_TAG_HEADER)
        self._replied = False
        kind, self.step, self.epoch, numel, code = (int(x) for x in self.header)
        if kind == SUBMIT:
            dtype = _DTYPES[code]
            if self.payload is None or self.payload.numel() != numel or self.payload.dtype != dtype:
                self.payload = torch.empty(numel, dtype=dtype)
            dist.recv(self.payload, src=src, group=bridge, tag=_TAG_PAYLOAD)
            if expected_numel is not None and numel != expected_numel:
                self.error = (
                    f"training sends {numel} weight elements, the evaluation model's flat layout has "
                    f"{expected_numel} (a different model config or align_numel?)"
                )
                header = self.header.clone()
                header[0] = _REJECTED
                return header
        return self.header

    def reply(self, reply: torch.Tensor) -> None:
        self._send(reply)
        self._replied = True

    def reply_failure(self, message: str) -> None:
        """Best effort: tell training that evaluation failed (it may be gone already)."""
        if self._replied:
            return
        try:
            self.reply(encode_reply(FAILED, self.step, self.epoch, message=message))
        except Exception:  # noqa: BLE001 -- the training side then sees the broken connection
            pass


def _await_end_of_training(runtime: Runtime, inbox: _Inbox | None, sentinel_seen: bool = False) -> None:
    """After a failure the whole evaluation group knows: drop training's requests until its
    end-of-training sentinel, then wait for the main training process to end, then release the
    other evaluation ranks.

    So no evaluation process exits (which makes a launcher such as torchrun tear the job down)
    before training has seen the failure, ended its run, logged ``run_stop status=aborted`` and
    printed its report and its ``scalefold train: aborted`` line: after its sentinel training sends
    nothing more on the bridge, so the last receive ends when its process exits and gloo closes the
    bridge ("Connection closed by peer"). Best effort: if training or a peer is gone, there is
    nothing left to wait for.
    """
    try:
        if inbox is not None:
            while not sentinel_seen:
                sentinel_seen = int(inbox.receive()[0]) == SENTINEL
            try:
                inbox.receive()  # returns (raises) when the main training process has ended
            except Exception:  # noqa: BLE001, S110 -- the expected end: training closed the bridge
                pass
        dist.barrier(group=runtime.parallel.eval_group)
    except Exception:  # noqa: BLE001 -- the caller raises the failure anyway
        pass


def _setup_eval_rank(runtime: Runtime, build_model: Callable[[], nn.Module],
                     eval_batches: Callable[[list[int]], list[dict]] | EvalCache,
                     target_lengths: Sequence[int] | None, align_numel: int):  # fmt: skip
    """Model bound to a flat weight buffer and this rank's targets in host memory, plus an error
    message that is the same on every evaluation rank (``None``: all ranks ready)."""
    error: str | None = None
    model = weights = shard = None
    try:
        model = build_model().to(runtime.device)
        model.eval()
        weights = bind_flat_parameters(model, align_numel)
        shard = _EvalShard(
            eval_batches, target_lengths, runtime.parallel.eval_ranks.index(runtime.rank), len(runtime.parallel.eval_ranks)
        )
    except Exception as exc:  # noqa: BLE001 -- shared with the group, reported to training
        error = _error_text(exc)
    indices = shard.indices if shard is not None else []
    counts = torch.tensor([len(indices), error is not None], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(counts, group=runtime.parallel.eval_group)
    top = torch.tensor([max(indices, default=-1)], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=runtime.parallel.eval_group)
    num_targets, failed, top_index = int(counts[0]), int(counts[1]), int(top[0])
    if failed:
        error = _gather_errors(runtime, error)
    elif num_targets == 0:
        error = "no validation targets on any evaluation rank"
    elif top_index >= num_targets:
        error = f"target index {top_index} but only {num_targets} targets over the evaluation group (EvalCache rank/num_ranks?)"
    if shard is not None:
        shard.num_targets = num_targets
    return model, weights, shard, error


def _evaluate(
    runtime: Runtime, model: nn.Module, shard: _EvalShard, score_fn: Callable[[nn.Module, dict], float]
) -> float:
    """Mean score over all targets of the evaluation group (collective)."""
    n = shard.num_targets
    sums, local_error = _score_shard(model, shard, score_fn, runtime.device)
    dist.all_reduce(sums, group=runtime.parallel.eval_group)
    if int(sums[-1]):
        raise _GroupFailure(_gather_errors(runtime, local_error))
    scores, covered = sums[:n].cpu().numpy(), sums[n : 2 * n].cpu().numpy()
    if not np.all(covered == 1):
        wrong = [i for i, c in enumerate(covered) if c != 1]
        raise _GroupFailure(f"validation targets {wrong[:10]} not evaluated exactly once (overlapping LPT shares?)")
    return float(np.mean(scores))  # in target order: equals a synchronous evaluation of the same targets


@torch.no_grad()
def _score_shard(model: nn.Module, shard: _EvalShard, score_fn: Callable[[nn.Module, dict], float],
                 device: torch.device) -> tuple[torch.Tensor, str | None]:  # fmt: skip
    """``[scores (num_targets) | evaluated flags (num_targets) | failed]`` of this rank's targets."""
    num_targets = shard.num_targets
    sums = torch.zeros(2 * num_targets + 1, dtype=torch.float64)
    error = None
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for index, batch in shard.on(device):
            sums[index] = float(score_fn(model, batch))
            sums[num_targets + index] = 1.0
    except Exception as exc:  # noqa: BLE001 -- shared with the group, reported to training
        error = _error_text(exc)
        sums[-1] = 1.0
    finally:
        if gc_was_enabled:
            gc.enable()
    return sums.to(device), error


def serve_evaluations(cfg: Any, runtime: Any, build_model: Callable[[], torch.nn.Module], features: Any,
                      val_ids: Sequence[str], mllog_path: Any, autocast: bool, dtype: torch.dtype) -> None:  # fmt: skip
    """An asynchronous evaluation rank, after training's ``run_start``: cache its share of the validation
    set (timed), then serve evaluations until training's end-of-training sentinel (the first evaluation
    rank logs eval_* and run_stop success). ``val_ids``: the run's validation chains."""
    device, store_path = runtime.device, str(Path(cfg.store))
    cache = store_eval_cache(store_path, val_ids, features, runtime, cfg.num_workers)
    eval_log = mll.MLPerfLogger(mllog_path, enabled=runtime.parallel.is_main_eval_rank,
                                instance=mll.throughput_instance())  # fmt: skip
    try:
        run_eval_rank(
            cfg, runtime, build_model, cache, lambda m, b: score_batches(m, [move_batch(b, device, dtype)], autocast), eval_log,
        )  # fmt: skip
    finally:
        eval_log.close()


__all__ = ["run_eval_rank", "serve_evaluations", "store_eval_cache"]
