"""Per-step agreement between ranks: one small collective, so every rank takes the same decisions.

:func:`agree_on_device` is the training step's: the sum of the ranks' losses, whether any rank asked to
stop, a count summed over the ranks and the step's verdict (apply the update or skip it), all as device
tensors -- nothing is read back to the host inside the step (the loop reads the result once, after it:
:meth:`StepAgreement.read`). :func:`allreduce_step_stats` is the host-side form of the same numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


def allreduce_step_stats(
    loss: torch.Tensor, stop: bool, group: dist.ProcessGroup | None, world_size: int, count: int = 0
) -> tuple[float, bool, int]:
    """(mean loss over the training ranks, any rank asked to stop, sum of ``count`` over the ranks):
    one all-reduce of three numbers (``count``: e.g. the samples this rank's loader replaced)."""
    stats = torch.tensor([0.0, float(stop), float(count)], dtype=torch.float64, device=loss.device)
    stats[0] = loss.detach().to(torch.float64)
    if world_size > 1:
        dist.all_reduce(stats, group=group)
    mean_loss, stops, total = stats.tolist()
    return mean_loss / world_size, stops > 0, int(round(total))


class StepAgreement(NamedTuple):
    """One step's agreed numbers, on the device: ``stats`` = [sum of the losses, stop requests, count]
    (float64, summed over the ranks) and ``apply`` (bool: every rank's gradients and the mean loss are
    finite -- the same verdict on every rank)."""

    stats: torch.Tensor
    apply: torch.Tensor


def agree_on_device(loss: torch.Tensor, grads_finite: torch.Tensor, flags: torch.Tensor,
                    group: dist.ProcessGroup | None, world_size: int) -> StepAgreement:  # fmt: skip
    """The step's agreement without a host read: ``flags`` is a float64 device tensor ``[stop, count]``
    (written before the step: a CUDA graph reads it from its address), ``grads_finite`` the clipping's
    verdict (with DDP already the same on every rank: the norm of the averaged buckets).

    The same collective as :func:`allreduce_step_stats` (one all-reduce of three float64 numbers), so
    the agreed loss is bit-identical to it."""
    stats = torch.cat([loss.detach().to(torch.float64).reshape(1), flags.to(torch.float64).reshape(2)])
    if world_size > 1:
        dist.all_reduce(stats, group=group)
    apply = torch.logical_and(grads_finite.to(stats.device), torch.isfinite(stats[0] / world_size))
    return StepAgreement(stats, apply)


def read_agreement(stats: list[float], world_size: int) -> tuple[float, bool, int]:
    """(mean loss, any rank asked to stop, summed count) from ``stats`` read back to the host -- the
    same arithmetic as :func:`allreduce_step_stats`."""
    mean_loss, stops, total = stats
    return mean_loss / world_size, stops > 0, int(round(total))


def broadcast_float(value: float, src: int, group: dist.ProcessGroup | None, device: torch.device, distributed: bool) -> float:
    """``value`` of rank ``src`` on every rank of ``group`` (the evaluation result: all ranks stop together)."""
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=src, group=group)
    return float(t.item())


__all__ = ["StepAgreement", "agree_on_device", "allreduce_step_stats", "broadcast_float", "read_agreement"]
