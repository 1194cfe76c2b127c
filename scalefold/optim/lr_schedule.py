"""Learning-rate schedule of the MLPerf HPC OpenFold benchmark: linear warm-up, then constant.

Reference semantics (``OpenFoldBenchmarkLRScheduler``): for 1-based iteration ``i``,

    lr(i) = round(linspace(warmup_lr_init, base_lr, warmup_lr_iters)[i - 1], 10)   if i <= warmup_lr_iters
    lr(i) = base_lr                                                                 otherwise

with the linspace in float64. Base 1e-3 in the reference; warm-up init and length are free
hyper-parameters of the closed division (reference: 1e-5 over 0 iterations, i.e. no warm-up).
The value is written into a device tensor (the flat optimizer's ``lr``), so a captured CUDA graph
sees the new value without re-capture; it is written only when it changes.
"""

from __future__ import annotations

import torch

DEFAULT_BASE_LR = 1e-3
DEFAULT_WARMUP_LR_INIT = 1e-5
DEFAULT_WARMUP_LR_ITERS = 0
_ROUND_DIGITS = 10  # the reference rounds warm-up values to 10 decimals


def warmup_constant_lr(
    iteration: int,
    base_lr: float = DEFAULT_BASE_LR,
    warmup_lr_init: float = DEFAULT_WARMUP_LR_INIT,
    warmup_lr_iters: int = DEFAULT_WARMUP_LR_ITERS,
) -> float:
    """The learning rate of 1-based ``iteration`` (pure function)."""
    if iteration < 1:
        raise ValueError(f"iterations are 1-based, got {iteration}")
    if warmup_lr_iters < 0:
        raise ValueError(f"warmup_lr_iters must be >= 0, got {warmup_lr_iters}")
    if iteration > warmup_lr_iters:
        return base_lr
    ramp = torch.linspace(warmup_lr_init, base_lr, warmup_lr_iters, dtype=torch.float64)
    return round(ramp[iteration - 1].item(), _ROUND_DIGITS)


class WarmupConstantLR:
    """Writes :func:`warmup_constant_lr` into ``lr_tensor`` each iteration.

    Args:
        lr_tensor: 0-dim device tensor the optimizer reads (``FlatAdamSWA.lr``).
        base_lr, warmup_lr_init, warmup_lr_iters: the schedule.
    """

    def __init__(
        self,
        lr_tensor: torch.Tensor,
        base_lr: float = DEFAULT_BASE_LR,
        warmup_lr_init: float = DEFAULT_WARMUP_LR_INIT,
        warmup_lr_iters: int = DEFAULT_WARMUP_LR_ITERS,
    ) -> None:
        if lr_tensor.dim() != 0:
            raise ValueError("lr_tensor must be a 0-dim tensor")
        if warmup_lr_iters < 0:
            raise ValueError(f"warmup_lr_iters must be >= 0, got {warmup_lr_iters}")
        self.lr_tensor = lr_tensor
        self.base_lr = base_lr
        self.warmup_lr_init = warmup_lr_init
        self.warmup_lr_iters = warmup_lr_iters
        self._ramp = torch.linspace(warmup_lr_init, base_lr, warmup_lr_iters, dtype=torch.float64).tolist()
        self._last: float | None = None

    def value(self, iteration: int) -> float:
        if iteration < 1:
            raise ValueError(f"iterations are 1-based, got {iteration}")
        if iteration <= self.warmup_lr_iters:
            return round(self._ramp[iteration - 1], _ROUND_DIGITS)
        return self.base_lr

    def __call__(self, iteration: int) -> float:
        """Set the learning rate for ``iteration`` (1-based) and return it."""
        lr = self.value(iteration)
        if lr != self._last:
            self.lr_tensor.fill_(lr)
            self._last = lr
        return lr
