"""The training ranks' end of asynchronous evaluation: submit the SWA weights, poll for the stop.

:class:`AsyncEvalClient` runs on every training rank (the main training rank sends, through the bridge
of :mod:`scalefold.evaluation.protocol`, from a sender thread, and listens for replies on another);
:class:`AsyncEvaluation` is the Trainer's component over it (the same calls as
:class:`~scalefold.evaluation.sync.SyncEvaluation`).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from scalefold.distributed.runtime import DEFAULT_TIMEOUT_S, Runtime
from scalefold.evaluation.protocol import (
    _CONTINUE,
    _DTYPES,
    _POLL_S,
    _STOP,
    _TAG_HEADER,
    _TAG_PAYLOAD,
    _TAG_REPLY,
    DONE,
    FAILED,
    REPLY_BYTES,
    RESULT,
    SENTINEL,
    SUBMIT,
    EvalResult,
    _header,
    decode_reply,
    encode_reply,
    reply_time,
    swa_flat_buffer,
)
from scalefold.evaluation.sync import EvalContext
from scalefold.mlperf import logger as mll


class EvaluationRanksFailed(RuntimeError):
    """The asynchronous evaluation ranks failed, are stuck or were lost (the run aborts)."""


class AsyncEvalClient:
    """The training ranks' end of asynchronous evaluation (construct it on every training rank).

    Args:
        runtime: with evaluation ranks (``num_async_eval_ranks >= 1``) and the bridge group.
        num_params: elements of the flat SWA buffer sent (``swa_flat_buffer(opt).numel()``).
        dtype: dtype of the host copy sent over the bridge (the evaluation rank converts).
        max_pending: submissions that may wait for the evaluation ranks before ``submit`` blocks.
        timeout_s: seconds without progress (a reply or a delivered submission) while something is
            due after which the evaluation ranks are declared stuck.
    """

    def __init__(
        self,
        runtime: Runtime,
        num_params: int,
        dtype: torch.dtype = torch.float32,
        *,
        max_pending: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not runtime.parallel.async_eval:
            raise ValueError(
                "AsyncEvalClient needs evaluation ranks (num_async_eval_ranks >= 1); with 0, evaluate synchronously"
            )
        if not runtime.parallel.is_train_rank:
            raise ValueError(f"rank {runtime.rank} is an evaluation rank: run run_eval_rank() there")
        if not runtime.distributed or runtime.parallel.bridge_group is None:
            raise ValueError("asynchronous evaluation needs torch.distributed and the bridge group (init_distributed)")
        if num_params < 1 or max_pending < 1 or timeout_s <= 0:
            raise ValueError(
                f"need num_params >= 1, max_pending >= 1, timeout_s > 0; got {num_params}, {max_pending}, {timeout_s}"
            )
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported weight dtype {dtype}; expected one of {_DTYPES}")
        self.runtime = runtime
        self.num_params = num_params
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.results: list[EvalResult] = []
        self._taken = 0
        self._main = runtime.parallel.is_main_train_rank
        self._eval_rank = runtime.parallel.eval_ranks[0]
        self._lock = threading.Lock()
        self._stop = False
        self._failure: str | None = None
        self._failure_raised = False
        self._reported = False
        self._closed = False
        self._done = threading.Event()
        self._due: deque[int] = deque()  # steps whose reply is due, in order
        self._last_progress = time.monotonic()
        if not self._main:
            return
        pin = torch.cuda.is_available()
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(max_pending):
            self._free.put(torch.empty(num_params, dtype=dtype, pin_memory=pin))
        self._outbox: queue.Queue[tuple[torch.Tensor, torch.Tensor | None]] = queue.Queue()
        self._replies_due = threading.Semaphore(0)
        self._sender = threading.Thread(target=self._send_loop, name="scalefold-eval-send", daemon=True)
        self._listener = threading.Thread(target=self._listen_loop, name="scalefold-eval-listen", daemon=True)
        self._sender.start()
        self._listener.start()

    # -- public API -----------------------------------------------------------------------------

    @property
    def target_reached(self) -> bool:
        """Whether an evaluation reached the target (the first evaluation rank logged ``run_stop``)."""
        with self._lock:
            return self._stop

    def take_results(self) -> list[EvalResult]:
        """Evaluations finished since the last call, in submission order (main training rank; for
        ``metrics.jsonl`` and the console). :attr:`results` keeps all of them."""
        with self._lock:
            new = self.results[self._taken :]
            self._taken = len(self.results)
        return new

    @property
    def failed(self) -> bool:
        """Whether the evaluation ranks failed, are stuck or were lost (main training rank)."""
        with self._lock:
            return self._failure is not None

    def submit(self, step: int, epoch: int, swa_flat: torch.Tensor) -> None:
        """Queue the SWA weights of ``step`` for evaluation (main training rank; no-op elsewhere).

        Copies ``swa_flat`` to a host buffer and returns; the sender thread delivers it. Blocks only
        while ``max_pending`` earlier submissions still wait for the evaluation ranks. After a
        failure or once the target was reached, nothing is sent (``should_stop`` reports it).
        """
        if self._closed:
            raise RuntimeError("AsyncEvalClient.submit() after close()")
        if swa_flat.numel() != self.num_params:
            raise ValueError(
                f"swa_flat has {swa_flat.numel()} elements, the client was built for {self.num_params} "
                "(pass swa_flat_buffer(opt) and num_params=swa_flat_buffer(opt).numel())"
            )
        if not self._main:
            return
        buffer = self._take_free_buffer()
        if buffer is None:
            return
        buffer.copy_(swa_flat.detach().reshape(-1))
        with self._lock:
            if not self._due:
                self._last_progress = time.monotonic()
            self._due.append(step)
        self._outbox.put((_header(SUBMIT, step, epoch, self.num_params, self.dtype), buffer))

    def should_stop(self) -> bool:
        """Whether training must stop (target reached); the same answer on every training rank.

        Collective over the training group: call it once per train-eval cycle on every training rank.
        Raises ``RuntimeError`` if the evaluation ranks failed or are stuck.
        """
        code, message = _CONTINUE, ""
        if self._main:
            self._check_progress()
            with self._lock:
                if self._failure is not None:
                    code, message = FAILED, self._failure
                elif self._stop:
                    code = _STOP
        if self.runtime.parallel.num_train_ranks > 1:
            flag = encode_reply(code, message=message).to(self.runtime.device)
            dist.broadcast(flag, src=self.runtime.parallel.main_train_rank, group=self.runtime.parallel.train_group)
            code, _, _, _, _, message = decode_reply(flag)
        if code == FAILED:
            self._failure_raised = True
            raise RuntimeError(f"asynchronous evaluation failed: {message}")
        return code == _STOP

    def close(self) -> None:
        """Tell the evaluation ranks that training is over and wait for them (main training rank).

        Pending submissions are evaluated first (in order). Raises ``RuntimeError`` if the
        evaluation ranks fail or make no progress for ``timeout_s`` (unless ``should_stop`` already
        raised that failure).
        """
        if self._closed:
            return
        self._closed = True
        if not self._main:
            return
        with self._lock:
            self._due.append(-1)  # the sentinel's reply
            if len(self._due) == 1:
                self._last_progress = time.monotonic()
        self._outbox.put((_header(SENTINEL), None))  # also ends the sender thread after a failure
        while not self._done.is_set() and self._check_progress():
            self._done.wait(_POLL_S * 10)
        self._sender.join(timeout=min(self.timeout_s, 30.0))  # the sentinel is on its way
        self._listener.join(timeout=1.0)
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise RuntimeError(f"asynchronous evaluation failed: {self._failure}")

    # -- internals ------------------------------------------------------------------------------

    def _fail(self, message: str, reported: bool = False) -> None:
        """Record the failure; ``reported``: the first evaluation rank replied FAILED and now waits
        for the end-of-training sentinel (its connection is alive)."""
        with self._lock:
            if self._failure is None:
                self._failure = message
                self._reported = reported
        self._done.set()  # nothing more will come
        self._replies_due.release()  # wakes the listener if it waits for a reply that won't come

    def _progress(self) -> None:
        with self._lock:
            self._last_progress = time.monotonic()

    def _check_progress(self) -> bool:
        """False (and the failure recorded) once the evaluation ranks failed or stalled."""
        with self._lock:
            if self._failure is not None:
                return False
            stalled = bool(self._due) and time.monotonic() - self._last_progress > self.timeout_s
            due = self._due[0] if self._due else None
        if stalled:
            what = "the end of training" if due == -1 else f"the SWA weights of step {due}"
            self._fail(
                f"no reply from evaluation rank {self._eval_rank} for {self.timeout_s:g} s while evaluating {what}"
            )
            return False
        return True

    def _take_free_buffer(self) -> torch.Tensor | None:
        while True:
            with self._lock:
                if self._failure is not None or self._stop:
                    return None
            try:
                return self._free.get(timeout=_POLL_S * 10)
            except queue.Empty:
                if not self._check_progress():
                    return None

    def _send_loop(self) -> None:
        bridge = self.runtime.parallel.bridge_group
        while True:
            header, payload = self._outbox.get()
            sentinel = int(header[0]) == SENTINEL
            try:
                # after a failure only the sentinel goes out, and only to evaluation ranks that await it
                if self._failure is None or (sentinel and self._reported):
                    dist.send(header, dst=self._eval_rank, group=bridge, tag=_TAG_HEADER)
                    if payload is not None:
                        dist.send(payload, dst=self._eval_rank, group=bridge, tag=_TAG_PAYLOAD)
                    self._progress()
                    self._replies_due.release()
            except Exception as exc:  # noqa: BLE001 -- reported through should_stop()
                self._fail(f"sending to evaluation rank {self._eval_rank} failed: {exc}")
            finally:
                if payload is not None:
                    self._free.put(payload)
            if sentinel:
                return

    def _listen_loop(self) -> None:
        bridge = self.runtime.parallel.bridge_group
        reply = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
        while True:
            self._replies_due.acquire()
            if self._failure is not None:
                return
            try:
                dist.recv(reply, src=self._eval_rank, group=bridge, tag=_TAG_REPLY)
            except Exception as exc:  # noqa: BLE001 -- reported through should_stop()
                self._fail(f"lost evaluation rank {self._eval_rank}: {exc}")
                return
            kind, step, epoch, score, stop, message = decode_reply(reply)
            if kind == FAILED:
                with self._lock:
                    due = self._due[0] if self._due else None
                what = "the end of training" if due == -1 else f"the SWA weights of step {due}"
                self._fail(f"{message} (reply to {what})", reported=True)
                return
            with self._lock:
                self._last_progress = time.monotonic()
                if self._due:
                    self._due.popleft()
                if kind == RESULT:
                    self.results.append(EvalResult(step, epoch, score, stop, reply_time(reply)))
                    self._stop = self._stop or stop
            if kind == DONE:
                self._done.set()
                return


class AsyncEvaluation:
    """The SWA weights handed to the evaluation ranks at the end of each cycle; training goes on."""

    def __init__(self, ctx: EvalContext, runtime: Any, opt: Any, timeout_s: float) -> None:
        self.ctx = ctx
        self.swa_flat = swa_flat_buffer(opt)  # sent as is: the evaluation model's layout
        self.client = AsyncEvalClient(runtime, self.swa_flat.numel(), self.swa_flat.dtype, timeout_s=timeout_s)

    def prepare(self) -> None:
        """Nothing to build here: the evaluation ranks cache their share of the validation set."""

    def ready(self) -> None:
        """Nothing to wait for: the evaluation ranks hold the validation set."""

    def keep_start(self) -> None:
        """Nothing kept: see :meth:`score_start`."""

    def score_start(self, what: str = "") -> None:
        """Not scored: the starting weights are not sent to the evaluation ranks (``eval_baseline`` is for
        synchronous evaluation)."""

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

    @property
    def target_step(self) -> int | None:
        """The step whose evaluation reached the target (main training rank; None: none did)."""
        return next((r.step for r in self.client.results if r.target_reached), None)

    @property
    def run_stop_at(self) -> float | None:
        """The wall time the first evaluation rank logged ``run_stop`` at (None: unknown)."""
        at = next((r.at for r in self.client.results if r.target_reached), math.nan)
        return None if math.isnan(at) else at

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


__all__ = ["AsyncEvalClient", "AsyncEvaluation", "EvaluationRanksFailed"]
