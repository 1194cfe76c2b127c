"""Per-step agreement between ranks: one small collective, so every rank takes the same decisions."""

from __future__ import annotations

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


def broadcast_float(value: float, src: int, group: dist.ProcessGroup | None, device: torch.device, distributed: bool) -> float:
    """``value`` of rank ``src`` on every rank of ``group`` (the evaluation result: all ranks stop together)."""
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=src, group=group)
    return float(t.item())


__all__ = ["allreduce_step_stats", "broadcast_float"]
