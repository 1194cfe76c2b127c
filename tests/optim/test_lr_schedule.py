"""Warm-up-then-constant learning rate (MLPerf OpenFold reference semantics)."""

from __future__ import annotations

import pytest
import torch

from scalefold.optim.lr_schedule import WarmupConstantLR, warmup_constant_lr


def test_linear_warmup_then_constant():
    """lr(i) is linspace(init, base, n)[i-1] rounded to 10 decimals for i <= n, then base."""
    values = [warmup_constant_lr(i, base_lr=1e-3, warmup_lr_init=1e-5, warmup_lr_iters=5) for i in range(1, 8)]
    expected = [round(v, 10) for v in torch.linspace(1e-5, 1e-3, 5, dtype=torch.float64).tolist()] + [1e-3, 1e-3]
    assert values == expected
    assert values[0] == 1e-5 and values[4] == 1e-3


def test_no_warmup_is_constant_base_lr():
    """warmup_lr_iters = 0 (reference default) means base_lr from iteration 1."""
    assert [warmup_constant_lr(i, base_lr=2e-3, warmup_lr_iters=0) for i in (1, 2, 1000)] == [2e-3] * 3


def test_writes_into_device_tensor_only_on_change():
    """The scheduler fills the optimizer's lr tensor; values equal the pure function."""
    lr = torch.zeros((), dtype=torch.float64)
    sched = WarmupConstantLR(lr, base_lr=1e-3, warmup_lr_init=1e-4, warmup_lr_iters=3)
    seen = []
    for it in range(1, 6):
        assert sched(it) == warmup_constant_lr(it, 1e-3, 1e-4, 3)
        seen.append(float(lr))
    assert seen == [1e-4, 5.5e-4, 1e-3, 1e-3, 1e-3]


def test_rejects_zero_based_iterations():
    """Iterations are 1-based as in the reference loop."""
    with pytest.raises(ValueError):
        warmup_constant_lr(0)
    with pytest.raises(ValueError):
        WarmupConstantLR(torch.zeros(()), warmup_lr_iters=2)(0)
