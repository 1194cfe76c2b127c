"""The fused triangle multiplication (Triton: LN + projections + gates, batched product, LN + output
projection + gate; backward recomputing the gates) vs the PyTorch reference module, forward and every
gradient (input and parameters), outgoing and incoming; fp64/fp32 in the interpreter, bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from scalefold import kernels  # noqa: E402
from scalefold.kernels import FP64_DOT_TRITON, reference, triton_ops, triton_version  # noqa: E402
from scalefold.model.triangle import TriangleMultiplicationIncoming, TriangleMultiplicationOutgoing  # noqa: E402

# Triton before 3.5 rejects tl.dot on fp64 operands (compiler and interpreter alike): the fp64 checks of the
# fused kernels need a newer one (the dispatch point then runs fp64 through the PyTorch path, as attention's)
requires_fp64_dot = pytest.mark.skipif(
    triton_version() < FP64_DOT_TRITON,
    reason="fp64 tl.dot needs Triton >= 3.5 (found {}.{})".format(*triton_version()),
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 checked on GPU only")
TOL = {torch.float64: 1e-10, torch.float32: 2e-4, torch.bfloat16: 5e-2}
NAMES = ("out", "dz") + reference.TrimulWeights._fields


def _module(outgoing: bool, c_z: int, c: int, dtype, device):
    """A module with random (not the zero/one initial) parameters, so every gradient is non-trivial."""
    cls = TriangleMultiplicationOutgoing if outgoing else TriangleMultiplicationIncoming
    module = cls(c_z, c).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    return module


def _grads(fn, module, z, mask, dout):
    out = fn(z, mask)
    leaves = [z, *module.weights()]
    return (out, *torch.autograd.grad(out, leaves, dout))


def _check(outgoing, batch, n, c_z, c, dtype, device, masked=True):
    module = _module(outgoing, c_z, c, dtype, device)
    z = (torch.randn(*batch, n, n, c_z, dtype=dtype, device=device) * 2 + 0.5).requires_grad_()
    mask = (torch.rand(*batch, n, n, device=device) > 0.25).to(dtype) if masked else None
    dout = torch.randn(*batch, n, n, c_z, dtype=dtype, device=device)
    w = module.weights()
    fused = _grads(lambda z_, m_: triton_ops.triangle_multiplication(z_, m_, w, outgoing), module, z, mask, dout)
    ref = _grads(lambda z_, m_: reference.triangle_multiplication(z_, m_, w, outgoing), module, z, mask, dout)
    for name, a, r in zip(NAMES, fused, ref):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        scale = max(1.0, r.abs().max().item())
        err = (a.double() - r.double()).abs().max().item()
        assert err <= TOL[dtype] * scale, f"{name}: {err} (scale {scale})"
    return fused, ref


@requires_fp64_dot
@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_fp64_forward_and_every_gradient(outgoing, device):
    """fp64, a masked pair, two batch entries: the output, dz and every parameter's gradient agree with the
    reference to rounding; c_hidden 32 runs the kernels' column loops twice (16-wide blocks)."""
    _check(outgoing, (2,), 5, 16, 32, torch.float64, device)


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_fp32_odd_sizes_no_mask(outgoing, device):
    """fp32, sizes that are not powers of two (N 7, c_z 24, c_hidden 20: masked columns in every tile), no
    mask, rows not a multiple of the row block."""
    _check(outgoing, (1,), 7, 24, 20, torch.float32, device, masked=False)


@requires_fp64_dot
def test_template_shaped_mask_broadcast(device):
    """A mask ``[*, 1, N, N]`` broadcast over the templates (the template pair stack's call), fp64."""
    module = _module(True, 16, 16, torch.float64, device)
    z = torch.randn(1, 2, 4, 4, 16, dtype=torch.float64, device=device)
    mask = (torch.rand(1, 1, 4, 4, device=device) > 0.3).double()
    w = module.weights()
    out = triton_ops.triangle_multiplication(z, mask, w, True)
    assert torch.allclose(out, reference.triangle_multiplication(z, mask, w, True), atol=1e-10)


@requires_fp64_dot
def test_outgoing_and_incoming_differ(device):
    """The two directions are not the same computation (a test that would pass with the layouts swapped
    would catch nothing): on a non-symmetric pair their outputs differ."""
    module = _module(True, 16, 16, torch.float64, device)
    z = torch.randn(1, 5, 5, 16, dtype=torch.float64, device=device)
    w = module.weights()
    out_o = triton_ops.triangle_multiplication(z, None, w, True)
    out_i = triton_ops.triangle_multiplication(z, None, w, False)
    assert (out_o - out_i).abs().max() > 1e-3


@requires_fp64_dot
def test_dispatch_point_and_module(device, monkeypatch):
    """The model's module goes through ``kernels.triangle_multiplication``: backend "torch" is its operators
    (bit-identical to the reference), "triton" the fused kernels, to rounding (fp64)."""
    module = _module(False, 16, 16, torch.float64, device)
    z = torch.randn(1, 6, 6, 16, dtype=torch.float64, device=device)
    mask = (torch.rand(1, 6, 6, device=device) > 0.2).double()
    w = module.weights()
    ref = reference.triangle_multiplication(z, mask, w, False)
    assert torch.equal(kernels.triangle_multiplication(z, mask, w, False, backend="torch"), ref)
    assert torch.allclose(kernels.triangle_multiplication(z, mask, w, False, backend="triton"), ref, atol=1e-10)
    monkeypatch.setenv("SCALEFOLD_KERNELS", "triton")
    assert torch.allclose(module(z, mask), ref, atol=1e-10)
    monkeypatch.setenv("SCALEFOLD_KERNELS", "torch")
    assert torch.equal(module(z, mask), ref)


def test_under_torch_compile(device):
    """The kernels are custom ops: one opaque node to ``torch.compile`` (forward and backward)."""
    module = _module(True, 16, 16, torch.float32, device)
    z = torch.randn(1, 4, 4, 16, device=device, requires_grad=True)
    w = module.weights()
    compiled = torch.compile(lambda z_: triton_ops.triangle_multiplication(z_, None, w, True), backend="aot_eager")
    out = compiled(z)
    ref = reference.triangle_multiplication(z, None, w, True)
    assert torch.allclose(out, ref, atol=1e-4)
    g, g_ref = (torch.autograd.grad(o.square().sum(), z)[0] for o in (out, ref))
    assert torch.allclose(g, g_ref, atol=1e-3)


@requires_cuda
@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_bf16_on_gpu(outgoing):
    """bf16 at a small MLPerf-like shape (c_z 128, c_hidden 128), GPU only (the interpreter's bf16 dot is
    wrong): output, dz and every parameter gradient within twice the PyTorch path's own bf16 error (both
    against fp64 of the same parameters and inputs), plus 1 % of the value's scale."""
    module = _module(outgoing, 128, 128, torch.float64, "cuda")
    z = torch.randn(1, 64, 64, 128, dtype=torch.float64, device="cuda")
    mask = (torch.rand(1, 64, 64, device="cuda") > 0.25).double()
    dout = torch.randn_like(z)
    results = []
    for fn, dtype in ((triton_ops.triangle_multiplication, torch.bfloat16),
                      (reference.triangle_multiplication, torch.bfloat16),
                      (reference.triangle_multiplication, torch.float64)):  # fmt: skip
        module_d = _module(outgoing, 128, 128, dtype, "cuda")
        module_d.load_state_dict(module.state_dict())
        z_d = z.to(dtype).requires_grad_()
        w = module_d.weights()
        out = fn(z_d, mask.to(dtype), w, outgoing)
        results.append([t.double() for t in (out, *torch.autograd.grad(out, [z_d, *w], dout.to(dtype)))])
    for name, fused, ref_bf16, exact in zip(NAMES, *results):
        scale = exact.abs().max().item()
        err, ref_err = (fused - exact).abs().max().item(), (ref_bf16 - exact).abs().max().item()
        assert err <= 2 * ref_err + 1e-2 * scale, f"{name}: {err} vs the PyTorch path's {ref_err} (scale {scale})"


@requires_cuda
def test_bf16_autocast_on_gpu():
    """Under bf16 autocast (the model's bf16 training) with fp32 ``z`` and weights: the output is bf16 and
    the gradients come back in the parameters' fp32."""
    module = _module(True, 128, 128, torch.float32, "cuda")
    z = torch.randn(1, 32, 32, 128, device="cuda", requires_grad=True)
    w = module.weights()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = triton_ops.triangle_multiplication(z, None, w, True)
        ref = reference.triangle_multiplication(z, None, w, True)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() <= 5e-2 * max(1.0, ref.float().abs().max().item())
    grads = torch.autograd.grad(out.float().sum(), [z, *w])
    assert all(g.dtype == torch.float32 for g in grads)


def test_launch_table_holds_the_mlperf_keys(monkeypatch):
    """The launch keys the four launchers build at the MLPerf call sites (bf16, and fp32 with and without
    TF32), recorded without launching anything (meta tensors), each have an entry in the shipped table for
    sm_90 and sm_80, and each entry fits its kernel's configs."""
    from scalefold.kernels import autotune, launch_table, trimul_triton

    keys = set()

    class NoLaunch:  # stands in for a @triton.jit kernel: kernel[grid](...) does nothing
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    class Recorder:
        def __init__(self, name, configs, interpreter_config):
            self.name, self.default = name, configs[0]

        def run(self, key, launch, bench=None):
            keys.add((self.name, key.dtype, key.shape))
            launch(self.default)
            return self.default

    monkeypatch.setattr(autotune, "get_tuner", Recorder)
    for kernel in ("_in_fwd", "_out_fwd", "_out_bwd", "_gates_bwd"):
        monkeypatch.setattr(trimul_triton, kernel, NoLaunch())
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for dtype, tf32 in ((torch.bfloat16, False), (torch.float32, True), (torch.float32, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            for _, batch, n, cz, c in trimul_triton.MLPERF_SITES:
                with torch.device("meta"):
                    trimul_triton.run_site(batch, n, cz, c, dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    lists = {**trimul_triton.TRIMUL_CONFIGS, **{f"{n}_exact": c for n, c in trimul_triton.TRIMUL_EXACT_CONFIGS.items()}}
    assert {k[0] for k in keys} == set(lists) and len(keys) == 4 * 3 * 2  # 4 kernels x 3 dtypes x 2 sites
    table = launch_table.read(launch_table.SHIPPED)
    for arch in ("sm_90", "sm_80"):
        for name, label, shape in sorted(keys):
            entry = table.entry(arch, name, label, shape)
            assert entry is not None, (arch, name, label, shape)
            assert launch_table.misfit(entry, lists[name][0]) is None


@requires_fp64_dot
def test_flop_count_matches_the_pytorch_path(device):
    """``torch.utils.flop_counter`` (and so ``scalefold estimate-step``) counts the fused ops' matrix FLOPs as
    the products the PyTorch path runs: forward and forward + backward equal."""
    from torch.utils.flop_counter import FlopCounterMode

    module = _module(True, 16, 24, torch.float64, device)
    z = torch.randn(2, 6, 6, 16, dtype=torch.float64, device=device, requires_grad=True)
    w = module.weights()
    counts = []
    for fn in (triton_ops.triangle_multiplication, reference.triangle_multiplication):
        with FlopCounterMode(display=False) as fwd:
            out = fn(z, None, w, False)
        with FlopCounterMode(display=False) as bwd:
            out.backward(torch.ones_like(out))
        counts.append((fwd.get_total_flops(), bwd.get_total_flops()))
    assert counts[0] == counts[1] and counts[0][0] > 0 and counts[0][1] == 2 * counts[0][0]


@requires_fp64_dot
def test_ops_pass_opcheck(device):
    """``scalefold::trimul_fwd`` / ``trimul_bwd`` pass torch.library.opcheck (schema, fake impl, autograd
    registration), fp64 so the interpreter's dots are exact."""
    f64 = dict(dtype=torch.float64, device=device)
    n, cz, c = 4, 16, 16
    z = torch.randn(n * n, cz, **f64, requires_grad=True)
    mask = torch.ones(n * n, **f64)
    w_in, b_in = torch.randn(4 * c + cz, cz, **f64, requires_grad=True), torch.randn(4 * c + cz, **f64)
    w_out, b_out = torch.randn(cz, c, **f64, requires_grad=True), torch.randn(cz, **f64)
    ln_in, ln_out = (torch.ones(cz, **f64), torch.zeros(cz, **f64)), (torch.ones(c, **f64), torch.zeros(c, **f64))
    args = (z, mask, w_in, b_in, *ln_in, w_out, b_out, *ln_out, 1e-5, 1e-5, n, True)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.scalefold.trimul_fwd.default, args, test_utils=utils)
    out, a, b, x, g, zn, mean, rstd, mean_x, rstd_x = torch.ops.scalefold.trimul_fwd(*args)
    bwd_args = (torch.randn_like(out), out, z.detach(), mask, w_in.detach(), b_in, ln_in[0], w_out.detach(), *ln_out,
                a, b, x, g, zn, mean, rstd, mean_x, rstd_x, n, True)  # fmt: skip
    torch.library.opcheck(torch.ops.scalefold.trimul_bwd.default, bwd_args, test_utils=("test_schema", "test_faketensor"))


def test_run_site_runs_the_four_kernels(device):
    """``run_site`` (the ahead-of-time check's and tune-kernels' entry) runs the four kernels on real inputs
    (here a tiny site in the interpreter), not only on meta tensors."""
    from scalefold.kernels import trimul_triton

    with torch.device(device):
        trimul_triton.run_site(2, 4, 16, 16, torch.float32)


@requires_fp64_dot
def test_template_pair_block_through_the_fused_path(device, monkeypatch):
    """A whole template pair block (both directions, the pair mask broadcast over 2 templates, c_t 8 and
    C 8: dims below a dot's 16, padded in the tiles) with its triangle multiplications on the Triton path
    agrees with the PyTorch path to rounding (fp64), output and every parameter gradient."""
    from scalefold.model.config import TemplatePairStackConfig
    from scalefold.model.template import TemplatePairBlock

    block = TemplatePairBlock(TemplatePairStackConfig(c_t=8, c_hidden_tri_att=4, c_hidden_tri_mul=8, num_heads_tri=2,
                                                      dropout_rate=0.0))  # fmt: skip
    block = block.to(device=device, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    t = torch.randn(1, 2, 6, 6, 8, dtype=torch.float64, device=device, requires_grad=True)
    seq = torch.ones(1, 6, dtype=torch.float64, device=device)
    seq[:, -2:] = 0
    mask = seq[:, :, None] * seq[:, None, :]
    original = kernels.triangle_multiplication
    results = []
    for backend in ("torch", "triton"):
        monkeypatch.setattr(kernels, "triangle_multiplication", lambda *a, _b=backend, **k: original(*a, **k, backend=_b))
        out = block(t, mask)
        results.append((out, *torch.autograd.grad(out.square().sum(), [t, *block.parameters()])))
    for a, r in zip(*results):
        assert (a - r).abs().max() <= 1e-10 * max(1.0, r.abs().max().item())
