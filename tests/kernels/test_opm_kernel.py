"""The fused outer product mean (Triton: the outer product and its output projection in one kernel, the
mean's normaliser in its epilogue; backward recomputing the outer product) vs the PyTorch reference: output
and the gradients of both projections, the weight and the bias; fp64/fp32 in the interpreter at tiny shapes,
bf16 on a GPU; the module through the one dispatch point, and the refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from scalefold import kernels  # noqa: E402
from scalefold.kernels import FP64_DOT_TRITON, reference, triton_ops, triton_version  # noqa: E402
from scalefold.model.outer_product_mean import OuterProductMean  # noqa: E402

requires_fp64_dot = pytest.mark.skipif(
    triton_version() < FP64_DOT_TRITON,
    reason="fp64 tl.dot needs Triton >= 3.5 (found {}.{})".format(*triton_version()),
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 checked on GPU only")
TOL = {torch.float64: 1e-10, torch.float32: 2e-4}
NAMES = ("out", "da", "db", "weight", "bias")


def _operands(batch, s, n1, n2, c, cz, dtype, device, masked=True):
    f = dict(dtype=dtype, device=device)
    mask_a = (torch.rand(*batch, s, n1, 1, device=device) > 0.3).to(dtype) if masked else torch.ones(*batch, s, n1, 1, **f)
    mask_b = mask_a if n1 == n2 and masked else torch.ones(*batch, s, n2, 1, **f)
    a = (torch.randn(*batch, s, n1, c, **f) * mask_a).requires_grad_()
    b = (torch.randn(*batch, s, n2, c, **f) * mask_b).requires_grad_()
    weight = (torch.randn(cz, c * c, **f) * 0.3).requires_grad_()
    bias = torch.randn(cz, **f).requires_grad_()
    return a, b, mask_a, mask_b, weight, bias


def _grads(fn, a, b, mask_a, mask_b, weight, bias, dout):
    out = fn(a, b, mask_a, mask_b, weight, bias, 1e-3)
    return (out, *torch.autograd.grad(out, [a, b, weight, bias], dout))


def _errors(batch, s, n1, n2, c, cz, dtype, device, masked=True):
    """``{name: (max abs error, max abs error / max |reference|)}`` of the fused op against the reference."""
    ops = _operands(batch, s, n1, n2, c, cz, dtype, device, masked)
    dout = torch.randn(*batch, n1, n2, cz, dtype=dtype, device=device)
    fused = _grads(triton_ops.outer_product_mean, *ops, dout)
    ref = _grads(reference.outer_product_mean, *ops, dout)
    errors = {}
    for name, x, r in zip(NAMES, fused, ref):
        assert x.shape == r.shape and x.dtype == r.dtype, name
        err = (x.double() - r.double()).abs().max().item()
        errors[name] = (err, err / max(r.abs().max().item(), 1e-30))
    return errors


def _check(*args, **kwargs):
    dtype = args[6]
    for name, (err, rel) in _errors(*args, **kwargs).items():
        assert rel <= TOL[dtype], f"{name}: max abs error {err}, relative {rel}"


@requires_fp64_dot
def test_fp64_forward_and_every_gradient(device):
    """fp64, masked MSA rows, two batch entries, N 6 (pair tiles partly outside), S 20 (two MSA-row blocks of
    16), C 4 and c_z 8 (below a dot's 16: padded): to rounding."""
    _check((2,), 20, 6, 6, 4, 8, torch.float64, device)


def test_fp32_odd_sizes_unequal_residues(device):
    """fp32, sizes that are not powers of two, a rectangular pair (N1 5, N2 7: DAP's sharded rows against the
    gathered columns), C 3, c_z 10, no mask."""
    _check((1,), 7, 5, 7, 3, 10, torch.float32, device, masked=False)


@requires_fp64_dot
def test_fully_masked_residue(device):
    """A residue whose MSA column is masked everywhere: the normaliser is eps alone (the reference divides the
    bias by 1e-3), and the kernel agrees."""
    a, b, mask_a, mask_b, weight, bias = _operands((1,), 4, 3, 3, 2, 4, torch.float64, device)
    mask_a = mask_a.clone()
    mask_a[..., 1, :] = 0
    a, b = a.detach() * mask_a, b.detach() * mask_a
    out = triton_ops.outer_product_mean(a, b, mask_a, mask_a, weight, bias, 1e-3)
    ref = reference.outer_product_mean(a, b, mask_a, mask_a, weight, bias, 1e-3)
    assert torch.allclose(out, ref, rtol=1e-12, atol=0)
    assert ref[0, 1].abs().max() > 100  # the bias over eps: a value the test would see go wrong


def _module(c_m, c_z, c, dtype, device, chunk_size=None):
    module = OuterProductMean(c_m, c_z, c, chunk_size=chunk_size).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module


@requires_fp64_dot
def test_module_through_the_dispatch_point(device, monkeypatch):
    """The module goes through ``kernels.outer_product_mean``: "torch" is the reference's operators (bit for
    bit the module's code before the dispatch point: the transposed einsum, the projection, the normaliser;
    chunked too), "triton" the fused kernels to rounding, every parameter's gradient included."""
    module = _module(8, 8, 4, torch.float64, device)
    m = torch.randn(1, 5, 6, 8, dtype=torch.float64, device=device, requires_grad=True)
    mask = (torch.rand(1, 5, 6, device=device) > 0.2).double()
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SCALEFOLD_KERNELS", backend)
        out = module(m, mask)
        results[backend] = (out, *torch.autograd.grad(out.square().sum(), [m, *module.parameters()]))
    for x, r in zip(results["triton"], results["torch"]):
        assert (x - r).abs().max() <= 1e-10 * max(1.0, r.abs().max().item())
    monkeypatch.setenv("SCALEFOLD_KERNELS", "torch")
    for chunk_size in (None, 2):
        module.chunk_size = chunk_size
        pair = []
        for fn in (module, lambda m_, mask_: _before_dispatch(module, m_, mask_)):
            out = fn(m, mask)
            pair.append((out, *torch.autograd.grad(out.square().sum(), [m, *module.parameters()])))
        assert all(torch.equal(x, r) for x, r in zip(*pair))


def _before_dispatch(module, m, mask):
    """The module's forward as it was written before the dispatch point (no DAP)."""
    from scalefold.model.memory import chunked

    mask = mask.to(m.dtype).unsqueeze(-1)
    m = module.layer_norm(m)
    b = module.linear_2(m) * mask
    a = module.linear_1(m) * mask
    a, b = a.transpose(-2, -3), b.transpose(-2, -3)

    def project(a_):
        outer = torch.einsum("...bac,...dae->...bdce", a_, b)
        return module.linear_out(outer.reshape(outer.shape[:-2] + (module.c_hidden * module.c_hidden,)))

    outer = chunked(project, module.chunk_size, [a], dims=[-3], out_dim=-3)
    return outer / (torch.einsum("...abc,...adc->...bdc", mask, mask) + module.eps)


def test_refused_operands_take_the_reference(device, capsys):
    """Operands the kernels do not take (C above 64; an integer dtype) go to the reference with one line on
    stderr naming the limit, printed once per reason."""
    from scalefold.kernels import opm_triton

    a, b, mask_a, mask_b, weight, bias = (t.detach() for t in _operands((1,), 2, 2, 2, 65, 4, torch.float32, device))
    ref = reference.outer_product_mean(a, b, mask_a, mask_b, weight, bias, 1e-3)
    for _ in range(2):
        out = kernels.outer_product_mean(a, b, mask_a, mask_b, weight, bias, 1e-3, backend="triton")
        assert torch.equal(out, ref)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["scalefold.kernels: fused outer product mean: c_hidden 65 above the kernels' limit 64; "
                     "using the PyTorch reference"]  # fmt: skip
    assert "c_z 300 above the kernels' limit 256" in opm_triton.unsupported(a[..., :4], b[..., :4],
                                                                             torch.empty(300, 16), torch.float32)
    assert "dtype torch.int32" in opm_triton.unsupported(a, b, weight, torch.int32)


def test_under_torch_compile(device):
    """The kernels are custom ops: one opaque node to ``torch.compile`` (forward and backward)."""
    a, b, mask_a, mask_b, weight, bias = _operands((1,), 3, 4, 4, 4, 8, torch.float32, device)
    fn = torch.compile(triton_ops.outer_product_mean, backend="aot_eager")
    out = fn(a, b, mask_a, mask_b, weight, bias, 1e-3)
    ref = reference.outer_product_mean(a, b, mask_a, mask_b, weight, bias, 1e-3)
    assert torch.allclose(out, ref, atol=1e-4)
    g, g_ref = (torch.autograd.grad(o.square().sum(), [a, weight]) for o in (out, ref))
    assert all(torch.allclose(x, r, atol=1e-3, rtol=1e-4) for x, r in zip(g, g_ref))


@requires_fp64_dot
def test_flop_count_matches_the_pytorch_path(device):
    """``torch.utils.flop_counter`` (and so ``estimate-step``) counts the fused ops' matrix FLOPs as the
    products the PyTorch path runs, its normaliser's einsum included (model FLOPs do not depend on the kernel
    path): forward and backward equal; the backward twice the forward's products with a gradient (not the
    masks' normaliser)."""
    from torch.utils.flop_counter import FlopCounterMode

    a, b, mask_a, mask_b, weight, bias = _operands((1,), 3, 4, 4, 4, 8, torch.float64, device)
    counts = []
    for fn in (triton_ops.outer_product_mean, reference.outer_product_mean):
        with FlopCounterMode(display=False) as fwd:
            out = fn(a, b, mask_a, mask_b, weight, bias, 1e-3)
        with FlopCounterMode(display=False) as bwd:
            out.backward(torch.ones_like(out))
        counts.append((fwd.get_total_flops(), bwd.get_total_flops()))
    norm = 2 * 4 * 4 * 3  # the normaliser: the reference's einsum [N, S] x [S, N], the fused kernel's epilogue
    assert counts[0] == counts[1] and counts[0][1] == 2 * (counts[0][0] - norm) > 0


@requires_fp64_dot
def test_ops_pass_opcheck(device):
    """``scalefold::opm_fwd`` / ``opm_bwd`` pass torch.library.opcheck (schema, fake impl, autograd
    registration), fp64."""
    a, b, mask_a, mask_b, weight, bias = _operands((1,), 3, 4, 5, 4, 8, torch.float64, device)
    args = (a, b, mask_a[..., 0].contiguous(), mask_b[..., 0].contiguous(), weight, bias, 1e-3)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.scalefold.opm_fwd.default, args, test_utils=utils)
    out, den = torch.ops.scalefold.opm_fwd(*args)
    bwd_args = (torch.randn_like(out), a.detach(), b.detach(), weight.detach(), den)
    torch.library.opcheck(torch.ops.scalefold.opm_bwd.default, bwd_args, test_utils=("test_schema", "test_faketensor"))


def test_run_site_runs_the_kernels(device):
    """``run_site`` (the ahead-of-time check's and tune-kernels' entry) runs the kernels on real inputs."""
    from scalefold.kernels import opm_triton

    with torch.device(device):
        opm_triton.run_site(3, 5, 4, 8, torch.float32)


@requires_cuda
def test_bf16_on_gpu():
    """bf16 at a small MLPerf-like shape (S 128, N 64, C 32, c_z 128), GPU only (the interpreter's bf16 dot is
    wrong): output and every gradient within twice the PyTorch path's own bf16 error against fp64, plus 1 %
    of the value's scale."""
    ops64 = _operands((1,), 128, 64, 64, 32, 128, torch.float64, "cuda")
    dout = torch.randn(1, 64, 64, 128, dtype=torch.float64, device="cuda")
    results = []
    for fn, dtype in ((triton_ops.outer_product_mean, torch.bfloat16), (reference.outer_product_mean, torch.bfloat16),
                      (reference.outer_product_mean, torch.float64)):  # fmt: skip
        ops = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in ops64]
        results.append([t.double() for t in _grads(fn, *ops, dout.to(dtype))])
    for name, fused, ref_bf16, exact in zip(NAMES, *results):
        scale = exact.abs().max().item()
        err, ref_err = (fused - exact).abs().max().item(), (ref_bf16 - exact).abs().max().item()
        assert err <= 2 * ref_err + 1e-2 * scale, f"{name}: {err} vs the PyTorch path's {ref_err} (scale {scale})"


@requires_cuda
def test_bf16_autocast_module_on_gpu(monkeypatch):
    """The module under bf16 autocast (the model's bf16 training) with fp32 parameters: the fused path's output is
    bf16 like the PyTorch path's, within bf16 rounding of it, and the parameters' gradients come back in fp32."""
    module = _module(256, 128, 32, torch.float32, "cuda")
    m = torch.randn(1, 32, 64, 256, device="cuda", requires_grad=True)
    mask = (torch.rand(1, 32, 64, device="cuda") > 0.1).float()
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SCALEFOLD_KERNELS", backend)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs[backend] = module(m, mask)
    assert outs["triton"].dtype == outs["torch"].dtype == torch.bfloat16
    ref = outs["torch"].float()
    assert (outs["triton"].float() - ref).abs().max() <= 2e-2 * max(1.0, ref.abs().max().item())
    grads = torch.autograd.grad(outs["triton"].float().sum(), [m, *module.parameters()])
    assert all(g.dtype == torch.float32 for g in grads)
