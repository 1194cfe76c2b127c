"""Fused Adam + SWA Triton kernel vs the PyTorch reference step (``reference.adam_swa_``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from scalefold import kernels  # noqa: E402
from scalefold.kernels import reference, triton_ops  # noqa: E402
from scalefold.kernels.autotune import interpreting  # noqa: E402


def _state(n, dtype, compute_dtype, device):
    param = torch.randn(n, dtype=dtype, device=device)
    exp_avg = torch.randn(n, dtype=dtype, device=device) * 1e-2
    exp_avg_sq = torch.rand(n, dtype=dtype, device=device) * 1e-4
    swa = torch.randn(n, dtype=dtype, device=device)
    compute = torch.empty(n, dtype=compute_dtype, device=device) if compute_dtype is not None else None
    return [param, exp_avg, exp_avg_sq, swa, compute]


@pytest.mark.parametrize(
    "dtype,compute_dtype,tol",
    [(torch.float32, torch.bfloat16, 1e-6), (torch.float32, None, 1e-6), (torch.float64, None, 1e-14)],
)
def test_several_steps_equal_reference(dtype, compute_dtype, tol, device):
    """Four steps with a clip scale, the first with n_averaged == 0 (SWA copies the weights):
    master weights, both moments, SWA and the compute copy equal the reference step."""
    n = 5000  # not a multiple of the block
    ours = _state(n, dtype, compute_dtype, device)
    ref = [t.clone() if t is not None else None for t in ours]
    lr = torch.tensor(1e-3, dtype=torch.float64, device=device)
    for i in range(4):
        grad = torch.randn(n, dtype=compute_dtype or dtype, device=device) * 1e-2
        step = torch.tensor(float(i + 1), dtype=torch.float64, device=device)
        clip = torch.tensor(0.3 if i % 2 else 1.0, device=device)
        kw = dict(lr=lr, step=step, clip_scale=clip, swa_decay=0.9, swa_n_averaged=i)
        triton_ops.adam_swa_update_(ours[0], grad, *ours[1:4], ours[4], **kw)
        reference.adam_swa_(ref[0], grad, *ref[1:4], ref[4], **kw)
    for name, a, b in zip(["param", "exp_avg", "exp_avg_sq", "swa"], ours, ref):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), name
    if compute_dtype is not None:
        if interpreting():  # the interpreter truncates fp32 -> bf16; GPUs round to nearest even
            assert torch.allclose(ours[4].float(), ours[0], rtol=2**-7, atol=0)
        else:
            assert torch.equal(ours[4], ours[0].to(compute_dtype))


def test_first_swa_update_copies_weights(device):
    """n_averaged == 0: SWA becomes the updated weights exactly; no clip scale given."""
    param, exp_avg, exp_avg_sq, swa, _ = _state(300, torch.float32, None, device)
    grad = torch.randn(300, device=device)
    one = torch.tensor(1.0, dtype=torch.float64, device=device)
    kernels.adam_swa_(
        param, grad, exp_avg, exp_avg_sq, swa, lr=one * 1e-3, step=one, swa_n_averaged=0, backend="triton"
    )
    assert torch.equal(swa, param)


def test_flat_optimizer_triton_backend_matches_torch(device):
    """``FlatAdamSWA(backend="triton")`` (the flat optimizer's kernel hook) tracks ``backend="torch"``."""
    flat = pytest.importorskip("scalefold.optim.adam_swa")
    torch.manual_seed(0)
    shapes = [(7, 5), (13,), (3, 3, 3)]
    runs = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        opt = flat.FlatAdamSWA(params, lr=1e-2, backend=backend)
        for i in range(3):
            torch.manual_seed(10 + i)
            for p in params:
                p.grad.copy_(torch.randn(p.shape, device=device))
            opt.step(clip_scale=torch.tensor(0.5, device=device))
        runs[backend] = [g.master.clone() for g in opt.groups] + [g.swa.clone() for g in opt.groups]
    for a, b in zip(runs["torch"], runs["triton"]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
