"""The places that choose their code by device take CUDA's path inside ``device_path.as_cuda`` (the step
counter's CPU stand-in for a GPU step) and their own everywhere else (``scalefold.kernels.device_path``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scalefold.kernels import device_path
from scalefold.model.dropout import shared_dropout_mask
from scalefold.optim.clipping import squared_norm
from scalefold.perf.flops import OpCounter


def _ops(fn) -> dict[str, int]:
    with OpCounter({}) as counter:
        fn()
    return {op: k for (_, op), k in counter.ops.items()}


def test_the_paths_follow_the_context():
    t = torch.zeros(2)
    assert device_path.cpu_path(t) and not device_path.cuda_path(t)
    with device_path.as_cuda():
        assert device_path.cuda_path(t) and not device_path.cpu_path(t)
        with device_path.as_cuda():
            assert device_path.cuda_path(t)
        assert device_path.cuda_path(t)
    assert device_path.cpu_path(t)


def test_dropout_is_one_fused_kernel_on_the_cuda_path():
    """On CUDA ``F.dropout`` is ``native_dropout`` (one kernel after the fill); on the CPU it stays the
    reference's decomposition, with the reference's random stream (bit for bit)."""

    def draw() -> torch.Tensor:
        return shared_dropout_mask((3, 5, 7, 4), 0.25, -3, torch.device("cpu"), torch.float32)

    cpu_ops = _ops(draw)
    assert cpu_ops.get("bernoulli_") == 1 and "native_dropout" not in cpu_ops
    with device_path.as_cuda():
        cuda_ops = _ops(draw)
    assert cuda_ops == {"ones": 1, "native_dropout": 1}
    torch.manual_seed(3)
    mask = draw()
    torch.manual_seed(3)
    expected = F.dropout(torch.ones(3, 1, 7, 4), p=0.25, training=True)
    assert mask.shape == (3, 1, 7, 4) and torch.equal(mask, expected)
    with device_path.as_cuda():
        mask = draw()
    assert set(mask.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}


def test_the_gradient_norm_is_one_reduction_on_the_cuda_path():
    g = torch.randn(3 * (1 << 18) + 5)
    cpu = squared_norm(g, torch.float64)
    assert _ops(lambda: squared_norm(g, torch.float64)).get("dot") == 4
    with device_path.as_cuda():
        ops = _ops(lambda: squared_norm(g, torch.float64))
        cuda = squared_norm(g, torch.float64)
    assert "dot" not in ops and ops.get("linalg_vector_norm") == 1
    assert torch.allclose(cpu, cuda, rtol=1e-5)  # fp32 summed in one tree: ~3e-7 apart
