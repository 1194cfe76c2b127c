"""Asynchronous evaluation ranks (ScaleFold): training never waits for evaluation.

The last ``num_async_eval_ranks`` ranks form the evaluation group (``runtime.parallel``, built by :func:`~scalefold.distributed.runtime.init_distributed`).
Every ``eval_every`` iterations the main training rank copies the SWA weights (one flat buffer of
``FlatAdamSWA``) to host memory and hands them to a sender thread, which pushes them through the
gloo *bridge* ``[main training rank, first evaluation rank]``; training continues at once.

On the evaluation side (:func:`run_eval_rank`) the first evaluation rank receives each submission,
broadcasts the weights within the evaluation group, every evaluation rank scores its
longest-processing-time share of the validation targets from a host-memory cache built once at
start, and the per-target scores are summed over the group. The first evaluation rank logs
``eval_start`` / ``eval_accuracy`` / ``eval_stop`` (``epoch_num`` in training samples, as sent by
training) and, when the mean reaches ``cfg.target_lddt``, ``run_stop status=success``; its reply
carries the stop flag back through the bridge. Training ranks poll it once per train-eval cycle
with :meth:`AsyncEvalClient.should_stop` (collective over the training group, so every training
rank stops at the same cycle: the one after the evaluation that reached the target finished).

Protocol over the bridge (strict request / reply, FIFO per tag)::

    training -> eval   header  int64[5] = (kind SUBMIT|SENTINEL, step, epoch_num, numel, dtype code)
    training -> eval   payload the flat SWA weights (SUBMIT only)
    eval -> training   reply   uint8[REPLY_BYTES] = float64 (kind, step, epoch_num, score, stop)
                               + a UTF-8 message (FAILED)

Each header gets exactly one reply: SUBMIT -> RESULT (or SKIPPED once the target was reached:
later submissions are received and dropped, so no ``eval_*`` line follows ``run_stop``) or FAILED;
SENTINEL -> DONE or FAILED. Submissions are evaluated in order, none is dropped: at most
``max_pending`` of them wait (host copies) for the evaluation ranks; when training outruns
evaluation further than that, :meth:`AsyncEvalClient.submit` blocks until the oldest is taken
(MLPerf expects every evaluation point to be evaluated).

Why threads, not ``irecv`` + ``is_completed()``: gloo's point-to-point ``Work`` objects only mark
themselves complete inside ``wait()`` (``is_completed()`` stays ``False`` even after the data has
arrived), so a non-blocking poll needs a thread blocked in ``wait()``. The main training rank runs
a sender and a reply listener; polling is then a lock-protected read. The listener only posts a
receive when a reply is due, so idle periods never hit the process-group timeout.

Failures are reported, never a hang: an exception on any evaluation rank (setup or scoring) is
shared within the evaluation group, the first evaluation rank sends FAILED with the messages, and
every training rank raises ``RuntimeError`` at its next :meth:`~AsyncEvalClient.should_stop`. The
evaluation ranks then wait for training's sentinel (sent by :meth:`~AsyncEvalClient.close`) before
they raise too, so a launcher that tears the job down when one process fails (torchrun) does not
kill training before it has ended its run (``run_stop status=aborted``). A dead evaluation process
breaks the gloo connection (reported immediately); a stuck one is reported after ``timeout_s``
without progress while a reply is due.
"""

from __future__ import annotations

import gc
import math
import queue
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from scalefold.data.eval_cache import EvalCache, assign_lpt
from scalefold.distributed.runtime import DEFAULT_TIMEOUT_S, Runtime
from scalefold.train import mlperf_logging as mll
from scalefold.train.flat_optimizer import DEFAULT_ALIGN_NUMEL, FlatAdamSWA, _align

# header kinds (training -> evaluation)
SUBMIT, SENTINEL = 1, 2
# reply kinds (evaluation -> training)
RESULT, SKIPPED, FAILED, DONE = 1, 2, 3, 4
# should_stop() codes broadcast over the training group
_CONTINUE, _STOP = 0, 1

_TAG_HEADER, _TAG_PAYLOAD, _TAG_REPLY = 71, 72, 73
_REPLY_FIELDS = 5  # float64 kind, step, epoch, score, stop
_REPLY_HEAD = struct.calcsize(f"<{_REPLY_FIELDS}d")
REPLY_BYTES = 4096
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_POLL_S = 0.005


@dataclass(frozen=True)
class EvalResult:
    """One evaluation of the SWA weights of training ``step`` (``epoch`` = training samples)."""

    step: int
    epoch: int
    score: float  # mean lDDT-Cα over all validation targets
    target_reached: bool


# ----------------------------------------------------------------------------------------------
# Flat weights: the layout of FlatAdamSWA's buffers
# ----------------------------------------------------------------------------------------------


def swa_flat_buffer(opt: FlatAdamSWA) -> torch.Tensor:
    """The optimizer's SWA weights as one flat tensor (what :meth:`AsyncEvalClient.submit` sends).

    Its ``numel()`` (parameters plus alignment padding) is the ``num_params`` of the client.
    """
    if len(opt.groups) != 1:
        raise ValueError(
            f"asynchronous evaluation sends one flat SWA buffer, the optimizer has {len(opt.groups)} "
            "(parameters of mixed dtypes or devices)"
        )
    return opt.groups[0].swa


def bind_flat_parameters(module: nn.Module, align_numel: int = DEFAULT_ALIGN_NUMEL) -> torch.Tensor:
    """Make ``module``'s parameters views of one new flat buffer laid out like ``FlatAdamSWA``'s.

    Same parameter order (``named_parameters()``), same per-parameter alignment, so copying
    :func:`swa_flat_buffer` of the training optimizer into the returned buffer loads the SWA weights.
    The buffer starts as a copy of the current parameters.
    """
    params = list(module.parameters())
    if not params:
        raise ValueError("the evaluation model has no parameters")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ValueError(
            f"the evaluation model's parameters must share one dtype and device, got {sorted(map(str, kinds))}"
        )
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += _align(p.numel(), align_numel)
    flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            view = flat[offset : offset + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view
    return flat


# ----------------------------------------------------------------------------------------------
# Wire format
# ----------------------------------------------------------------------------------------------


def encode_reply(kind: int, step: int = 0, epoch: int = 0, score: float = math.nan, stop: bool = False,
                 message: str = "") -> torch.Tensor:  # fmt: skip
    """A reply / stop-flag message: ``uint8[REPLY_BYTES]`` (five float64 fields, then UTF-8 text)."""
    head = struct.pack(f"<{_REPLY_FIELDS}d", kind, step, epoch, score, float(stop))
    text = message.encode("utf-8")[: REPLY_BYTES - _REPLY_HEAD]
    raw = head + text + b"\0" * (REPLY_BYTES - _REPLY_HEAD - len(text))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def decode_reply(t: torch.Tensor) -> tuple[int, int, int, float, bool, str]:
    """``(kind, step, epoch, score, stop, message)`` of :func:`encode_reply`'s tensor."""
    raw = bytes(t.cpu().numpy().tobytes())
    kind, step, epoch, score, stop = struct.unpack(f"<{_REPLY_FIELDS}d", raw[:_REPLY_HEAD])
    message = raw[_REPLY_HEAD:].rstrip(b"\0").decode("utf-8", errors="replace")
    return int(kind), int(step), int(epoch), score, bool(stop), message


def _header(
    kind: int, step: int = 0, epoch: int = 0, numel: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.tensor([kind, step, epoch, numel, _DTYPES.index(dtype)], dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Training side
# ----------------------------------------------------------------------------------------------


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
                    self.results.append(EvalResult(step, epoch, score, stop))
                    self._stop = self._stop or stop
            if kind == DONE:
                self._done.set()
                return


# ----------------------------------------------------------------------------------------------
# Evaluation side
# ----------------------------------------------------------------------------------------------


def _batches_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A copy of ``batch`` on ``device`` (the model may modify its inputs in place)."""
    return {k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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
        return ((i, _batches_to(b, device)) for i, b in zip(self.indices, self._batches))


def store_eval_cache(store_path: str, chain_ids: Sequence[str], features: Any, runtime: Runtime,
                     num_workers: int = 0) -> EvalCache:  # fmt: skip
    """This evaluation rank's :class:`EvalCache` of the validation chains ``chain_ids`` of a store.

    Targets are spread over the evaluation group by LPT with cost L² (residue counts from the
    store's chain table); each target keeps the reference's fixed validation seed
    (:class:`~scalefold.data.dataset.StoreSample` in ``"eval"`` mode). Nothing is computed here:
    :func:`run_eval_rank` builds the features once at its start, while training runs its first
    cycle (``num_workers`` loader workers), and every evaluation replays them from host memory.
    """
    from scalefold.data.dataset import validation_cache

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
    first = runtime.parallel.is_main_eval_rank
    device = runtime.device
    target = float(cfg.target_lddt)
    model, weights, shard, error = _setup_eval_rank(runtime, build_model, eval_batches, target_lengths, align_numel)
    inbox = _Inbox(runtime) if first else None
    if error is not None:  # the same on every evaluation rank
        if inbox is not None:  # answer training's next request with the failure
            inbox.receive()
            inbox.reply(encode_reply(FAILED, inbox.step, inbox.epoch, message=error))
        ended = inbox is not None and int(inbox.header[0]) == SENTINEL  # that request was the sentinel
        _await_end_of_training(runtime, None if ended else inbox)
        raise RuntimeError(f"asynchronous evaluation failed: {error}")
    _say(f"scalefold: evaluation rank {runtime.rank}: {len(shard.indices)} of {shard.num_targets} validation "
         f"targets (LPT, cost ~ L^2), features cached in host memory")  # fmt: skip

    results: list[EvalResult] = []
    stopped = False
    header = torch.zeros(len(_HEADER), dtype=torch.int64, device=device)
    while True:
        try:
            if inbox is not None:
                header.copy_(inbox.receive(expected_numel=weights.numel()))
            dist.broadcast(header, src=runtime.parallel.main_eval_rank, group=runtime.parallel.eval_group)
            kind, step, epoch = int(header[0]), int(header[1]), int(header[2])
            if kind == _REJECTED:
                raise _GroupFailure(
                    inbox.error if inbox is not None else "the first evaluation rank rejected the weights"
                )
            if kind == SENTINEL:
                if inbox is not None:
                    inbox.reply(encode_reply(DONE))
                break
            if stopped:  # target already reached: received and dropped, nothing logged after run_stop
                if inbox is not None:
                    inbox.reply(encode_reply(SKIPPED, step, epoch))
                continue

            # this rank's share of the targets with the received SWA weights, summed over the group
            if inbox is not None:
                weights.copy_(inbox.payload)
                if mllog is not None:
                    mllog.eval_start(epoch)
            dist.broadcast(weights, src=runtime.parallel.main_eval_rank, group=runtime.parallel.eval_group)
            t0 = time.perf_counter()
            score = _evaluate(runtime, model, shard, score_fn)
            stopped = score >= target
            if first:
                _say(f"scalefold: evaluated the SWA weights of step {step}: lDDT-Cα {score:.4f} in "
                     f"{time.perf_counter() - t0:.2f} s" + (f" (target {target:g} reached)" if stopped else ""))  # fmt: skip
            results.append(EvalResult(step, epoch, score, stopped))
            if inbox is not None:
                if mllog is not None:
                    mllog.eval_accuracy(score, epoch)
                    mllog.eval_stop(epoch)
                    if stopped:
                        mllog.run_stop(mll.STATUS_SUCCESS)
                inbox.reply(encode_reply(RESULT, step, epoch, score, stopped))
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


_HEADER = ("kind", "step", "epoch", "numel", "dtype")
_REJECTED = -1  # header kind the first evaluation rank broadcasts when it cannot use the weights


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


def _await_end_of_training(runtime: Runtime, inbox: _Inbox | None) -> None:
    """After a failure the whole evaluation group knows: drop training's requests until its
    end-of-training sentinel, then release the other evaluation ranks.

    So no evaluation process exits (which makes a launcher such as torchrun tear the job down)
    before training has seen the failure, ended its run and logged ``run_stop status=aborted``.
    Best effort: if training or a peer is gone, there is nothing left to wait for.
    """
    try:
        if inbox is not None:
            while int(inbox.receive()[0]) != SENTINEL:
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


__all__ = [
    "AsyncEvalClient", "EvalResult", "run_eval_rank", "store_eval_cache", "swa_flat_buffer", "bind_flat_parameters",
    "encode_reply", "decode_reply", "REPLY_BYTES",
]  # fmt: skip
