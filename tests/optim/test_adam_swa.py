"""Flat-buffer Adam + SWA against torch.optim.Adam + AveragedModel (the reference semantics)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from scalefold.kernels import adam_swa_, reference
from scalefold.optim.adam_swa import FlatAdamSWA

SWA_DECAY = 0.9
MAX_NORM = 0.1
EPS = 1e-6


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # several shapes, a 0-dim-like tiny tensor, sizes not multiples of the alignment
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5), nn.Linear(5, 1, bias=False))
    return model.to(dtype)


def _loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(9, 7, generator=g, dtype=dtype)
    return (model(x) ** 2).mean() * 50.0  # large enough that clipping at 0.1 is active


def _reference_run(dtype: torch.dtype, steps: int, clip: bool):
    model = _model(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=EPS)
    swa = torch.optim.swa_utils.AveragedModel(model, avg_fn=lambda a, p, n: a + (p - a) * (1.0 - SWA_DECAY))
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step, dtype).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        swa.update_parameters(model)
    return model, opt, swa


def _flat_run(dtype: torch.dtype, steps: int, clip: bool, **kwargs):
    from scalefold.optim.clipping import GradClipper

    model = _model(dtype)
    opt = FlatAdamSWA(list(model.named_parameters()), lr=1e-3, eps=EPS, swa_decay=SWA_DECAY, **kwargs)
    clipper = GradClipper(max_norm=MAX_NORM)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step, dtype).backward()
        scale = clipper.clip_flat_(opt.grad_buffers()).clip_scale if clip else None
        opt.step(scale)
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clip", [False, True])
def test_matches_torch_adam_and_swa_over_20_steps(dtype, clip):
    """20 steps of FlatAdamSWA (+ flat-buffer clipping) equal torch.optim.Adam + clip_grad_norm_ +
    AveragedModel(decay 0.9): weights, moments and SWA weights (fp32 to a few ulp, fp64 to 1e-12)."""
    steps = 20
    ref_model, ref_opt, ref_swa = _reference_run(dtype, steps, clip)
    model, opt = _flat_run(dtype, steps, clip, chunk_numel=64)  # several chunks per buffer
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    ref_state = ref_opt.state_dict()["state"]
    flat_state = opt.state_dict()["state"]
    swa_views = opt.swa_views()
    for i, ((name, p), q, s) in enumerate(zip(model.named_parameters(), ref_model.parameters(), ref_swa.module.parameters())):
        torch.testing.assert_close(p, q, **tol, msg=f"param {name}")
        torch.testing.assert_close(flat_state[i]["exp_avg"], ref_state[i]["exp_avg"], **tol)
        torch.testing.assert_close(flat_state[i]["exp_avg_sq"], ref_state[i]["exp_avg_sq"], **tol)
        torch.testing.assert_close(swa_views[i], s, **tol, msg=f"swa {name}")
        assert float(flat_state[i]["step"]) == float(ref_state[i]["step"]) == steps


def test_without_clipping_fp32_is_bitwise_equal():
    """Without clipping the reference update reproduces torch.optim.Adam's operations exactly (fp32, CPU).

    The SWA average is one ``lerp_`` pass (``a + (p - a) * w`` for ``w < 0.5``, as the reference's
    three-op expression) instead of three passes over the buffer; lerp's vectorised CPU kernel may
    fuse the multiply-add, so the SWA weights agree to rounding, not bitwise (each step's rounding
    difference is damped by the decay, so it stays within a few ulp of the weights)."""
    ref_model, _, ref_swa = _reference_run(torch.float32, 5, clip=False)
    model, opt = _flat_run(torch.float32, 5, clip=False)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for s, q in zip(opt.swa_views(), ref_swa.module.parameters()):
        ulp = torch.finfo(torch.float32).eps * q.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((s - q).abs() <= 2 * ulp).all(), float(((s - q).abs() / ulp).max())


def test_parameters_and_grads_are_views_of_flat_buffers():
    """Parameters and their .grad are views into one contiguous buffer per dtype group."""
    model = _model(torch.float32)
    opt = FlatAdamSWA(model.parameters())
    assert len(opt.groups) == 1
    group = opt.groups[0]
    base = group.master.untyped_storage().data_ptr()
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == base
        assert p.grad.untyped_storage().data_ptr() == group.grad.untyped_storage().data_ptr()
    opt.check_grads_attached()
    model[0].weight.grad = None
    with pytest.raises(RuntimeError, match="not a view of the flat buffer"):
        opt.check_grads_attached()


def test_grads_alias_the_flat_buffer_without_being_views_so_a_compile_makes_no_symbols():
    """Each ``.grad`` is its slot of the flat gradient buffer (same memory, writes seen both ways) but not an autograd
    view of it: ``torch.compile`` turns an input parameter's ``.grad`` into a fake tensor, and a view's base gets a
    symbolic size per dimension (with guards and sympy work: 41 s vs 11 s to compile the tiny model's forward). Here
    a static compile of the model makes no symbol at all; with the views it made them."""
    from torch._guards import detect_fake_mode

    from scalefold.optim.adam_swa import storage_alias

    model = _model(torch.float32)
    opt = FlatAdamSWA(model.parameters())
    flat = opt.groups[0].grad
    for p in model.parameters():
        assert p.grad._base is None and not p.grad._is_view()
    weight = model[0].weight
    weight.grad.fill_(2.0)
    lo = weight.grad.storage_offset() - flat.storage_offset()
    assert torch.equal(flat[lo : lo + weight.numel()], torch.full((weight.numel(),), 2.0))
    flat.zero_()
    assert torch.count_nonzero(weight.grad) == 0
    alias = storage_alias(flat[3:11].view(2, 4))
    assert alias._base is None and alias.stride() == (4, 1) and alias.data_ptr() == flat[3:].data_ptr()

    def symbols(views: bool) -> int:
        if views:  # the .grad the optimizer attached before: views of the flat buffer
            group = opt.groups[0]
            for p, view in zip(model.parameters(), group.views(group.grad, [q.shape for q in model.parameters()])):
                p.grad = view
        seen = []

        def backend(gm, example_inputs):
            seen.append(len(detect_fake_mode(example_inputs).shape_env.var_to_val))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(model, backend=backend, dynamic=False)(torch.randn(9, 7))
        torch._dynamo.reset()
        return seen[0]

    assert symbols(views=False) == 0
    assert symbols(views=True) > 0  # what the aliases avoid (the check can tell)


def test_bf16_compute_copy_groups_and_updates():
    """With a bf16 compute copy: grads are read from the compute params, master stays fp32, and the
    compute copy equals the master weights cast to bf16 after the step; mixed dtypes form two groups."""
    master = _model(torch.float32)
    compute = copy.deepcopy(master)
    compute[0].to(torch.bfloat16)  # one fp32 and one bf16 compute group
    compute[2].to(torch.bfloat16)
    opt = FlatAdamSWA(master.parameters(), compute_params=compute.parameters())
    assert sorted(str(g.grad.dtype) for g in opt.groups) == ["torch.bfloat16", "torch.float32"]
    for p in compute.parameters():
        p.grad.fill_(0.5)
    opt.step()
    for p, c in zip(master.parameters(), compute.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(c, p.detach().to(c.dtype), rtol=0, atol=0)
        assert not torch.equal(p, torch.zeros_like(p))


def test_state_dict_round_trip_through_torch_adam_layout():
    """state_dict() has torch.optim.Adam's layout: a torch Adam loads it and continues identically to
    FlatAdamSWA loading torch Adam's state; SWA state uses the reference AlphaFoldSWA key names."""
    dtype = torch.float64
    ref_model, ref_opt, ref_swa = _reference_run(dtype, 3, clip=False)
    model, opt = _flat_run(dtype, 3, clip=False)

    # torch Adam state -> fresh flat optimizer on a copy of the reference weights
    model2 = copy.deepcopy(ref_model)
    opt2 = FlatAdamSWA(list(model2.named_parameters()), eps=EPS)
    opt2.load_state_dict(ref_opt.state_dict())
    assert opt2.num_steps == 3
    # flat state -> a torch Adam
    model3 = copy.deepcopy(model)
    opt3 = torch.optim.Adam(model3.parameters(), lr=1e-3, eps=EPS)
    opt3.load_state_dict(opt.state_dict())

    for m, o in ((ref_model, ref_opt), (model2, opt2), (model3, opt3)):
        if isinstance(o, FlatAdamSWA):
            o.zero_grad()
        else:
            o.zero_grad()
        _loss(m, 3, dtype).backward()
        o.step()
    for a, b, c in zip(ref_model.parameters(), model2.parameters(), model3.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-15)

    swa_sd = opt.swa_state_dict()
    assert set(swa_sd) == {"averaged_model.n_averaged"} | {f"averaged_model.module.{n}" for n, _ in model.named_parameters()}
    assert int(swa_sd["averaged_model.n_averaged"]) == 3
    reference_keys = set(ref_swa.state_dict()) - {"n_averaged"}
    assert {k.removeprefix("averaged_model.") for k in swa_sd} - {"n_averaged"} == reference_keys
    fresh = FlatAdamSWA(list(_model(dtype).named_parameters()))
    fresh.load_swa_state_dict({k: v.clone() for k, v in swa_sd.items()})
    for a, b in zip(fresh.swa_views(), opt.swa_views()):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_mismatched_shapes():
    """A checkpoint whose moments do not match the parameters is refused with the mismatches listed."""
    _, ref_opt, _ = _reference_run(torch.float32, 1, clip=False)
    sd = ref_opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(3, 3)
    opt = FlatAdamSWA(list(_model(torch.float32).named_parameters()))
    with pytest.raises(ValueError, match=r"0\.weight\.exp_avg: \(3, 3\)"):
        opt.load_state_dict(sd)


def test_lr_is_a_device_tensor_read_at_step_time():
    """The learning rate is read from the optimizer's lr tensor at each step (graph-friendly)."""
    model = _model(torch.float64)
    opt = FlatAdamSWA(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad.fill_(1.0)
    opt.set_lr(0.0)
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_update_function_rejects_ragged_buffers():
    """The update (``scalefold.kernels.adam_swa_``) works on flat, equally long 1-D buffers only."""
    t = torch.zeros(8)
    with pytest.raises(ValueError, match="flat 1-D"):
        adam_swa_(t, torch.zeros(7), t.clone(), t.clone(), t.clone(), lr=torch.tensor(1e-3), step=torch.tensor(1.0))


@pytest.mark.slow
def test_compiled_update_matches_reference():
    """The torch.compile'd update (one fused loop) agrees with the eager reference (fp32)."""
    torch.manual_seed(0)
    n = 1000
    bufs = [torch.randn(n), torch.randn(n) * 1e-2, torch.randn(n) * 1e-3, torch.rand(n) * 1e-6, torch.randn(n)]
    a = [b.clone() for b in bufs]
    b = [b.clone() for b in bufs]
    kw = dict(lr=torch.tensor(1e-3, dtype=torch.float64), step=torch.tensor(7.0, dtype=torch.float64),
              clip_scale=torch.tensor(0.3), swa_n_averaged=3)  # fmt: skip
    adam_swa_(*a, backend="torch", **kw)
    adam_swa_(*b, backend="compile", **kw)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clip", [False, True])
def test_reference_update_host_and_device_step_size_agree(clip):
    """The reference's two Adam branches (``reference.adam_swa_chunk_``): a host-float step size
    (CPU: torch.optim.Adam's own ``addcdiv_``) and a device-tensor step size (CUDA: no host sync)
    give the same parameters, moments and SWA weights to within a few ulp, with and without the
    clip scale."""
    gen = torch.Generator().manual_seed(0)
    param, grad, m, swa = (torch.randn(1000, generator=gen) for _ in range(4))
    v = torch.rand(1000, generator=gen)
    results = []
    for neg_step_size in (-1e-3, torch.tensor(-1e-3, dtype=torch.float64)):
        state = [t.clone() for t in (param, grad, m, v, swa)]
        p, g, ea, eas, sw = state
        reference.adam_swa_chunk_(
            p, g, ea, eas, sw, None, clip_scale=torch.tensor(0.25) if clip else None, neg_step_size=neg_step_size,
            bias_correction2_sqrt=torch.tensor(0.9, dtype=torch.float64), beta1=0.9, beta2=0.999, eps=1e-6,
            swa_decay=0.9, swa_copy=False,
        )  # fmt: skip
        results.append((p, ea, eas, sw))
    assert not torch.equal(results[0][0], param)  # the update did move the parameters
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-12)


def test_swa_update_is_the_lerp_form_training_has_always_used():
    """The one reference's SWA step is ``swa.lerp_(param, 1 - decay)`` bit for bit: MLPerf's
    ``avg + (p - avg) * (1 - decay)`` in one pass. It is not bitwise the three-op expression (lerp's
    CPU kernel may fuse the multiply-add: here 0.6 % of the entries differ by an ulp), so this pins
    which of the two training runs."""
    gen = torch.Generator().manual_seed(3)
    param, exp_avg, swa = (torch.randn(4096, generator=gen) for _ in range(3))
    exp_avg_sq, grad = torch.rand(4096, generator=gen), torch.randn(4096, generator=gen)
    swa_before = swa.clone()
    adam_swa_(param, grad, exp_avg, exp_avg_sq, swa, lr=torch.tensor(1e-3), step=torch.tensor(2.0), backend="torch")
    assert torch.equal(swa, swa_before.lerp(param, 1.0 - 0.9))
    three_op = swa_before + (param - swa_before) * (1.0 - 0.9)
    ulp = torch.finfo(torch.float32).eps * torch.maximum(swa_before.abs(), param.abs())  # of the operands
    assert ((swa - three_op).abs() <= 2 * ulp).all()
