"""Asynchronous evaluation (ScaleFold), its wire protocol: training never waits for evaluation.

The training side is :mod:`scalefold.evaluation.client`, the evaluation ranks' side
:mod:`scalefold.evaluation.server`; this module holds what both speak: message kinds and tags, the
reply encoding and the flat layout of the weights sent.

The last ``num_async_eval_ranks`` ranks form the evaluation group (``runtime.parallel``, built by :func:`~scalefold.distributed.runtime.init_distributed`).
Every ``eval_every`` iterations the main training rank copies the SWA weights (one flat buffer of
``FlatAdamSWA``) to host memory and hands them to a sender thread, which pushes them through the
gloo *bridge* ``[main training rank, first evaluation rank]``; training continues at once.

On the evaluation side (:func:`~scalefold.evaluation.server.run_eval_rank`) the first evaluation rank receives each submission,
broadcasts the weights within the evaluation group, every evaluation rank scores its
longest-processing-time share of the validation targets from a host-memory cache built once at
start, and the per-target scores are summed over the group. The first evaluation rank logs
``eval_start`` / ``eval_accuracy`` / ``eval_stop`` (``epoch_num`` in training samples, as sent by
training) and, when the mean reaches ``cfg.target_lddt``, ``run_stop status=success``; its reply
carries the stop flag back through the bridge. Training ranks poll it once per train-eval cycle
with :meth:`~scalefold.evaluation.client.AsyncEvalClient.should_stop` (collective over the training group, so every training
rank stops at the same cycle: the one after the evaluation that reached the target finished).

Protocol over the bridge (strict request / reply, FIFO per tag)::

    training -> eval   header  int64[5] = (kind SUBMIT|SENTINEL, step, epoch_num, numel, dtype code)
    training -> eval   payload the flat SWA weights (SUBMIT only)
    eval -> training   reply   uint8[REPLY_BYTES] = float64 (kind, step, epoch_num, score, stop, time)
                               + a UTF-8 message (FAILED); time: the wall time of a RESULT (run_stop's)

Each header gets exactly one reply: SUBMIT -> RESULT (or SKIPPED once the target was reached:
later submissions are received and dropped, so no ``eval_*`` line follows ``run_stop``) or FAILED;
SENTINEL -> DONE or FAILED. Submissions are evaluated in order, none is dropped: at most
``max_pending`` of them wait (host copies) for the evaluation ranks; when training outruns
evaluation further than that, :meth:`~scalefold.evaluation.client.AsyncEvalClient.submit` blocks until the oldest is taken
(MLPerf expects every evaluation point to be evaluated).

Why threads, not ``irecv`` + ``is_completed()``: gloo's point-to-point ``Work`` objects only mark
themselves complete inside ``wait()`` (``is_completed()`` stays ``False`` even after the data has
arrived), so a non-blocking poll needs a thread blocked in ``wait()``. The main training rank runs
a sender and a reply listener; polling is then a lock-protected read. The listener only posts a
receive when a reply is due, so idle periods never hit the process-group timeout.

Failures are reported, never a hang: an exception on any evaluation rank (setup or scoring) is
shared within the evaluation group, the first evaluation rank sends FAILED with the messages, and
every training rank raises ``RuntimeError`` at its next :meth:`~scalefold.evaluation.client.AsyncEvalClient.should_stop`. The
evaluation ranks then wait for training's sentinel (sent by :meth:`~scalefold.evaluation.client.AsyncEvalClient.close`) before
they raise too, so a launcher that tears the job down when one process fails (torchrun) does not
kill training before it has ended its run (``run_stop status=aborted``). A dead evaluation process
breaks the gloo connection (reported immediately); a stuck one is reported after ``timeout_s``
without progress while a reply is due.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.nn as nn

from scalefold.optim.adam_swa import DEFAULT_ALIGN_NUMEL, FlatAdamSWA, _align

# header kinds (training -> evaluation)
SUBMIT, SENTINEL = 1, 2
# reply kinds (evaluation -> training)
RESULT, SKIPPED, FAILED, DONE = 1, 2, 3, 4
# should_stop() codes broadcast over the training group
_CONTINUE, _STOP = 0, 1

_TAG_HEADER, _TAG_PAYLOAD, _TAG_REPLY = 71, 72, 73
_REPLY_FIELDS = 6  # float64 kind, step, epoch, score, stop, time
_REPLY_HEAD = struct.calcsize(f"<{_REPLY_FIELDS}d")
REPLY_BYTES = 4096
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_POLL_S = 0.005


_HEADER = ("kind", "step", "epoch", "numel", "dtype")
_REJECTED = -1  # header kind the first evaluation rank broadcasts when it cannot use the weights



@dataclass(frozen=True)
class EvalResult:
    """One evaluation of the SWA weights of training ``step`` (``epoch`` = training samples)."""

    step: int
    epoch: int
    score: float  # mean lDDT-Cα over all validation targets
    target_reached: bool
    at: float = math.nan  # wall time (time.time()) of the reply: when run_stop was logged, if target_reached


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
                 message: str = "", at: float = math.nan) -> torch.Tensor:  # fmt: skip
    """A reply / stop-flag message: ``uint8[REPLY_BYTES]`` (six float64 fields, then UTF-8 text);
    ``at``: a wall time (a RESULT's: when it was logged, ``run_stop`` included)."""
    head = struct.pack(f"<{_REPLY_FIELDS}d", kind, step, epoch, score, float(stop), at)
    text = message.encode("utf-8")[: REPLY_BYTES - _REPLY_HEAD]
    raw = head + text + b"\0" * (REPLY_BYTES - _REPLY_HEAD - len(text))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def decode_reply(t: torch.Tensor) -> tuple[int, int, int, float, bool, str]:
    """``(kind, step, epoch, score, stop, message)`` of :func:`encode_reply`'s tensor."""
    raw = bytes(t.cpu().numpy().tobytes())
    kind, step, epoch, score, stop, _ = struct.unpack(f"<{_REPLY_FIELDS}d", raw[:_REPLY_HEAD])
    message = raw[_REPLY_HEAD:].rstrip(b"\0").decode("utf-8", errors="replace")
    return int(kind), int(step), int(epoch), score, bool(stop), message


def reply_time(t: torch.Tensor) -> float:
    """The wall time ``at`` of :func:`encode_reply`'s tensor (NaN: none)."""
    return struct.unpack(f"<{_REPLY_FIELDS}d", bytes(t.cpu().numpy().tobytes())[:_REPLY_HEAD])[-1]


def _header(
    kind: int, step: int = 0, epoch: int = 0, numel: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.tensor([kind, step, epoch, numel, _DTYPES.index(dtype)], dtype=torch.int64)


__all__ = [
    "DONE", "FAILED", "REPLY_BYTES", "RESULT", "SENTINEL", "SKIPPED", "SUBMIT", "EvalResult",
    "bind_flat_parameters", "decode_reply", "encode_reply", "reply_time", "swa_flat_buffer",
]  # fmt: skip
