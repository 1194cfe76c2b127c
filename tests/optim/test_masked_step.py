"""The optimizer's skip on the device: ``step(apply=flag)`` is the plain step where the flag is true
(bit for bit) and no update at all where it is false, with no host read."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from scalefold.optim.adam_swa import FlatAdamSWA
from scalefold.optim.clipping import GradClipper


def _setup(compute: bool = False, chunk_numel: int | None = 16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5))  # 269 parameters: many chunks
    compute_model = None
    if compute:
        compute_model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5)).to(torch.bfloat16)
    opt = FlatAdamSWA(list(model.named_parameters()), None if compute_model is None else list(compute_model.parameters()),
                      lr=1e-3, eps=1e-6, swa_decay=0.9, chunk_numel=chunk_numel, backend="torch")  # fmt: skip
    return (compute_model or model), opt


def _grads(model: nn.Module, opt: FlatAdamSWA, step: int, poison: bool = False) -> torch.Tensor:
    opt.zero_grad()
    x = torch.randn(9, 7, generator=torch.Generator().manual_seed(step), dtype=next(model.parameters()).dtype)
    (model(x).float() ** 2).mean().mul(50).backward()
    if poison:
        opt.grad_buffers()[0][3] = float("nan")
    return GradClipper(max_norm=0.1).clip_flat_(opt.grad_buffers()).clip_scale


def _state(opt: FlatAdamSWA) -> list[torch.Tensor]:
    out = [opt.step_count.clone(), opt.swa_n_averaged.clone(), opt.lr.clone()]
    for g in opt.groups:
        out += [t.clone() for t in (g.master, g.exp_avg, g.exp_avg_sq, g.swa) + ((g.compute,) if g.compute is not None else ())]
    return out


@pytest.mark.parametrize("compute", [False, True])
@pytest.mark.parametrize("chunk_numel", [16, None])
def test_applied_masked_step_is_bit_identical_to_the_plain_step(compute, chunk_numel):
    (m1, plain), (m2, masked) = _setup(compute, chunk_numel), _setup(compute, chunk_numel)
    for step in range(4):  # the first step copies into SWA, the others average
        plain.step(_grads(m1, plain, step))
        masked.step(_grads(m2, masked, step), apply=torch.tensor(True))
        masked.settle(True)
        for a, b in zip(_state(plain), _state(masked)):
            assert torch.equal(a, b)
    assert plain.num_steps == masked.num_steps == 4
    assert plain.state_dict()["state"][0]["step"] == masked.state_dict()["state"][0]["step"]


def test_a_skipped_step_changes_nothing_even_with_nan_gradients():
    model, opt = _setup(compute=True)
    opt.step(_grads(model, opt, 0), apply=torch.tensor(True))
    opt.settle(True)
    before = _state(opt)
    opt.step(_grads(model, opt, 1, poison=True), apply=torch.tensor(False))
    opt.settle(False)
    after = _state(opt)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    assert opt.num_steps == 1 and opt.capturable


def test_a_skipped_first_step_leaves_the_swa_copy_for_the_next():
    """SWA's first update copies the weights (decided on the host): a skipped first step must not
    consume it -- the next applied step equals a plain first step."""
    (m1, plain), (m2, masked) = _setup(), _setup()
    masked.step(_grads(m2, masked, 0, poison=True), apply=torch.tensor(False))
    masked.settle(False)
    assert not masked.capturable and masked.num_steps == 0
    plain.step(_grads(m1, plain, 1))
    masked.step(_grads(m2, masked, 1), apply=torch.tensor(True))
    masked.settle(True)
    for a, b in zip(_state(plain), _state(masked)):
        assert torch.equal(a, b)


def test_the_verdict_must_be_settled_before_the_next_step():
    model, opt = _setup()
    opt.step(_grads(model, opt, 0), apply=torch.tensor(True))
    assert not opt.capturable
    with pytest.raises(RuntimeError, match="not settled"):
        opt.step(_grads(model, opt, 1))
    opt.settle(True)
    with pytest.raises(RuntimeError, match="no step"):
        opt.settle(True)
    with pytest.raises(ValueError, match="bool"):
        opt.step(None, apply=torch.tensor(1.0))


def test_the_masked_step_reads_nothing_back_to_the_host():
    from scalefold.perf.host_syncs import HostSyncCounter

    model, opt = _setup()
    scale = _grads(model, opt, 0)
    with HostSyncCounter() as counter:
        opt.step(scale, apply=torch.isfinite(scale))
    assert counter.count == 0, counter.report.by_place()
    opt.settle(True)
