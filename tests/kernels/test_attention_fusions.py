"""The Evoformer's attentions with their projections fused (``kernels.projections``: the queries, keys, values
and gate of one input as one product on the fast path): each module on the Triton path against its PyTorch path
(fp64, tiny shapes, every parameter's gradient), and the PyTorch path bit for bit the layers one by one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from scalefold.kernels import FP64_DOT_TRITON, triton_ops, triton_version  # noqa: E402,F401
from scalefold.model.msa_attention import MSAColumnAttention, MSARowAttentionWithPairBias  # noqa: E402
from scalefold.model.triangle import TriangleAttentionEndingNode, TriangleAttentionStartingNode  # noqa: E402

requires_fp64_dot = pytest.mark.skipif(
    triton_version() < FP64_DOT_TRITON,
    reason="fp64 tl.dot needs Triton >= 3.5 (found {}.{})".format(*triton_version()),
)
S, N, C = 3, 5, 8


def _cases(device):
    f = dict(dtype=torch.float64, device=device)
    m, z = torch.randn(1, S, N, C, **f), torch.randn(1, N, N, C, **f)
    msa_mask = (torch.rand(1, S, N, device=device) > 0.2).double()
    pair_mask = (torch.rand(1, N, N, device=device) > 0.2).double()
    return {
        "msa_row": (MSARowAttentionWithPairBias(C, C, 4, 2), (m, z, msa_mask)),
        "msa_col": (MSAColumnAttention(C, 4, 2), (m, msa_mask)),
        "tri_start": (TriangleAttentionStartingNode(C, 4, 2), (z, pair_mask)),
        "tri_end": (TriangleAttentionEndingNode(C, 4, 2), (z, pair_mask)),
    }


def _run(module, inputs):
    leaves = [t.clone().requires_grad_() for t in inputs[:-1]]
    out = module(*leaves, inputs[-1])
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum(),
                                leaves + list(module.parameters()))  # fmt: skip
    return [out, *grads]


@requires_fp64_dot
@pytest.mark.parametrize("name", ["msa_row", "msa_col", "tri_start", "tri_end"])
def test_attention_module_fast_path_equals_its_pytorch_path(name, device, monkeypatch):
    """Output, the inputs' and every parameter's gradient: the Triton path (fused projections, the attention
    kernel) equals the PyTorch path to rounding."""
    module, inputs = _cases(device)[name]
    module = module.to(device=device, dtype=torch.float64)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SCALEFOLD_KERNELS", backend)
        results[backend] = _run(module, inputs)
    for a, r in zip(results["triton"], results["torch"]):
        assert (a - r).abs().max() <= 1e-10 * max(1.0, r.abs().max().item())


def test_pytorch_path_is_the_layers_one_by_one(monkeypatch):
    """On the PyTorch path the attention's projections are its four Linear layers called one by one: the
    module's output is bit for bit what it was before the dispatch point."""
    monkeypatch.setenv("SCALEFOLD_KERNELS", "torch")
    module, (z, mask) = _cases("cpu")["tri_start"]
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    mha, x = module.mha, torch.randn(1, N, N, C)
    q, k, v = (mha._heads(lin(x)) for lin in (mha.linear_q, mha.linear_k, mha.linear_v))
    from scalefold.kernels import reference

    o = reference.attention(q, k, v, gate=mha._heads(mha.linear_g(x)), inf=mha.inf)
    expected = mha.linear_o(o.transpose(-2, -3).reshape(1, N, N, -1))
    assert torch.equal(mha(x, x), expected)


@pytest.mark.parametrize("cls", [TriangleAttentionStartingNode, TriangleAttentionEndingNode], ids=["start", "end"])
def test_triangle_bias_projected_with_the_heads_is_bit_identical_on_the_pytorch_path(cls, monkeypatch):
    """Without DAP and chunking the triangle attention projects its pair bias with the queries, keys, values and
    gate (``Attention.project``); on the PyTorch path the output is bit for bit the chunked path's (the code
    before), output and gradients."""
    monkeypatch.setenv("SCALEFOLD_KERNELS", "torch")
    module = cls(C, 4, 2)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    z, mask = torch.randn(1, N, N, C), (torch.rand(1, N, N) > 0.2).float()
    fused = _run(module, (z, mask))
    module.chunk_size = N  # one chunk: the path with the bias projected on its own
    assert all(torch.equal(a, r) for a, r in zip(fused, _run(module, (z, mask))))
