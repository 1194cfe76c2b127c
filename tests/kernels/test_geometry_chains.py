"""The structure module's geometry chains (:mod:`scalefold.kernels.geometry`).

* bit for bit the ``Rigid`` / ``Rotation`` code the model ran before them (values and gradients), so the
  eager path is unchanged;
* each chain compiled with inductor equals its reference (values and gradients, fp32 and fp64);
* the structure module with the chains compiled equals the eager one.
"""

from __future__ import annotations

import math

import pytest
import torch

from scalefold.kernels import elementwise, geometry
from scalefold.model.all_atom import rigid_group_constants
from scalefold.model.config import StructureModuleConfig
from scalefold.model.rigid import Rigid, Rotation
from scalefold.model.structure_module import StructureModule

F64 = torch.float64


@pytest.fixture(autouse=True)
def _references_afterwards():
    yield
    elementwise.enable("aot_eager", elementwise.CHAINS)  # the selection back to every chain (mode() keeps it)
    elementwise.disable()


def _quats(*shape, dtype=F64):
    q = torch.randn(*shape, 4, dtype=dtype)
    return q / q.norm(dim=-1, keepdim=True)


def _inputs(dtype=F64, n=5, heads=2, p_qk=3, p_v=4, seed=0):
    """Leaves of every chain's arguments (tiny shapes), as a dict by name."""
    torch.manual_seed(seed)
    consts = rigid_group_constants(dtype, torch.device("cpu"))
    angles = torch.randn(1, n, 7, 2, dtype=dtype)
    t = {
        "quats": _quats(1, n, dtype=dtype), "trans": torch.randn(1, n, 3, dtype=dtype),
        "update": 0.3 * torch.randn(1, n, 6, dtype=dtype),
        "rot": geometry.quat_to_rot(_quats(1, n, dtype=dtype)), "angles": angles / angles.norm(dim=-1, keepdim=True),
        "group_rots": geometry.quat_to_rot(_quats(1, n, 8, dtype=dtype)), "group_trans": torch.randn(1, n, 8, 3, dtype=dtype),
        "pts": torch.randn(1, n, heads * p_qk * 3, dtype=dtype), "a": torch.randn(1, heads, n, n, dtype=dtype),
        "b": torch.randn(1, n, n, heads, dtype=dtype), "q_pts": torch.randn(1, n, heads, p_qk, 3, dtype=dtype),
        "k_pts": torch.randn(1, n, heads, p_qk, 3, dtype=dtype), "head_weights": torch.randn(heads, dtype=dtype),
        "v_pts": torch.randn(1, n, heads, p_v, 3, dtype=dtype),
    }  # fmt: skip
    t = {k: v.requires_grad_() for k, v in t.items()}
    aatype = torch.randint(0, 21, (1, n))
    mask = torch.ones(1, n, dtype=dtype)
    mask[:, -1] = 0
    return t, aatype, mask, consts


#: chain -> its call on the tensors of :func:`_inputs`
CALLS = {
    "backbone_update": lambda t, aa, m, c: (t["quats"], t["trans"], t["update"], 10.0),
    "sidechain_frames": lambda t, aa, m, c: (t["rot"], t["trans"], t["angles"], aa, *c),
    "structure_outputs": lambda t, aa, m, c: (t["quats"], t["trans"], t["group_rots"], t["group_trans"], 10.0),
    "ipa_points": lambda t, aa, m, c: (t["pts"], t["quats"], t["trans"]),
    "ipa_logits": lambda t, aa, m, c: (t["a"], t["b"], t["q_pts"], t["k_pts"], t["head_weights"], m, 0.3, 0.2, 1e5),
    "ipa_attended_points": lambda t, aa, m, c: (t["a"].softmax(-1), t["v_pts"], t["quats"], t["trans"], 1e-8),
}


def _run(fn, dtype, name):
    """Outputs of chain ``name`` through ``fn`` and the gradients of every leaf (a fixed weighted sum)."""
    t, aatype, mask, consts = _inputs(dtype)
    out = fn(*CALLS[name](t, aatype, mask, consts))
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=dtype).view(o.shape)).sum() for o in outs)
    leaves = [v for v in t.values()]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return outs, grads


# -- the eager path: the chains' references are the Rigid code of before, bit for bit --------------------


def _old_sidechains(rot, trans, alpha, aatype, default_frames, group_idx, atom_mask, lit_positions):
    """The structure module's side chains as written with Rigid before the chains (the oracle)."""
    backb = Rigid(Rotation(rot_mats=rot), trans)
    default_r = Rigid.from_tensor_4x4(default_frames[aatype, ...])
    bb_rot = alpha.new_zeros((1,) * len(alpha.shape[:-1]) + (2,))
    bb_rot[..., 1] = 1
    alpha = torch.cat([bb_rot.expand(alpha.shape[:-2] + (-1, -1)), alpha], dim=-2)
    sin, cos = alpha[..., 0], alpha[..., 1]
    all_rots = alpha.new_zeros(alpha.shape[:-1] + (3, 3))
    all_rots[..., 0, 0] = 1
    all_rots[..., 1, 1] = cos
    all_rots[..., 1, 2] = -sin
    all_rots[..., 2, 1] = sin
    all_rots[..., 2, 2] = cos
    all_frames = default_r.compose(Rigid(Rotation(rot_mats=all_rots), None))
    chi1 = all_frames[..., 4]
    chi2 = chi1.compose(all_frames[..., 5])
    chi3 = chi2.compose(all_frames[..., 6])
    chi4 = chi3.compose(all_frames[..., 7])
    to_bb = Rigid.cat([all_frames[..., :5], chi2.unsqueeze(-1), chi3.unsqueeze(-1), chi4.unsqueeze(-1)], dim=-1)
    frames = backb[..., None].compose(to_bb)
    atom_group = group_idx[aatype, ...]
    rots = frames.get_rots().get_rot_mats()
    atom_rots = torch.gather(rots, -3, atom_group[..., None, None].expand(atom_group.shape + (3, 3)))
    atom_trans = torch.gather(frames.get_trans(), -2, atom_group[..., None].expand(atom_group.shape + (3,)))
    positions = Rigid(Rotation(rot_mats=atom_rots), atom_trans).apply(lit_positions[aatype, ...])
    return rots, frames.get_trans(), positions * atom_mask[aatype, ...].unsqueeze(-1)


def _old_backbone_update(quats, trans, update, scale):
    rigids = Rigid(Rotation(quats=quats, normalize_quats=False), trans).compose_q_update_vec(update)
    return rigids.get_rots().get_quats(), rigids.get_trans(), rigids.get_rots().get_rot_mats(), rigids.get_trans() * scale


def _old_structure_outputs(quats, trans, group_rots, group_trans, scale):
    rigids = Rigid(Rotation(quats=quats, normalize_quats=False), trans)
    return rigids.scale_translation(scale).to_tensor_7(), Rigid(Rotation(rot_mats=group_rots), group_trans).to_tensor_4x4()


def _old_ipa_points(pts, quats, trans):
    pts = torch.stack(torch.split(pts, pts.shape[-1] // 3, dim=-1), dim=-1)
    return Rigid(Rotation(quats=quats, normalize_quats=False), trans)[..., None].apply(pts)


def _old_ipa_logits(a, b, q_pts, k_pts, head_weights, mask, scale_qk, scale_pt, inf):
    a = a * scale_qk
    a = a + math.sqrt(1.0 / 3) * b.movedim(-1, -3)
    pt_att = q_pts.unsqueeze(-4) - k_pts.unsqueeze(-5)
    pt_att = sum(torch.unbind(pt_att**2, dim=-1))
    w = torch.nn.functional.softplus(head_weights).view((1,) * (pt_att.ndim - 2) + (head_weights.shape[0], 1))
    pt_att = -0.5 * torch.sum(pt_att * (w * scale_pt), dim=-1)
    square_mask = (mask.unsqueeze(-1) * mask.unsqueeze(-2) - 1.0) * inf
    return torch.softmax(a + pt_att.movedim(-1, -3) + square_mask.unsqueeze(-3), dim=-1)


def _old_ipa_attended_points(a, v_pts, quats, trans, eps):
    o_pt = torch.sum(a.unsqueeze(-3).unsqueeze(-1) * v_pts.swapdims(-4, -3).movedim(-1, -3).unsqueeze(-3), dim=-2)
    o_pt = o_pt.movedim(-3, -1).swapdims(-3, -4)
    o_pt = Rigid(Rotation(quats=quats, normalize_quats=False), trans)[..., None, None].invert_apply(o_pt)
    return o_pt, torch.sqrt(torch.sum(o_pt**2, dim=-1) + eps)


OLD = {
    "backbone_update": _old_backbone_update, "sidechain_frames": _old_sidechains,
    "structure_outputs": _old_structure_outputs, "ipa_points": _old_ipa_points, "ipa_logits": _old_ipa_logits,
    "ipa_attended_points": _old_ipa_attended_points,
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", elementwise.GEOMETRY_CHAINS)
def test_reference_is_the_rigid_code_bit_for_bit(name, dtype):
    """The chain's reference (what the model runs with the chains off) equals the Rigid code it replaced:
    exactly, values and gradients (ipa_logits: the oracle sums its terms in one expression, same order)."""
    assert elementwise.chain(name) is getattr(geometry, name)
    want, got = _run(OLD[name], dtype, name), _run(getattr(geometry, name), dtype, name)
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert (w is None and g is None) or torch.equal(w, g)


# -- compiled: each chain alone, and the structure module with all of them -------------------------------


@pytest.fixture(autouse=True)
def _chains_restored():
    """Each test leaves the chains as it found them (backend and selection: other tests compile through them)."""
    before = dict(elementwise._state)
    yield
    elementwise._state.update(before)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("name", elementwise.GEOMETRY_CHAINS)
def test_compiled_chain_equals_reference(name, dtype):
    """Inductor's code for the chain (fullgraph, dynamic) gives the reference's values and gradients (fp32, the
    structure module's dtype under bf16 training; fp64 compiles as long again for the same code)."""
    want = _run(getattr(geometry, name), dtype, name)
    elementwise.enable("inductor", (name,))
    assert elementwise.chain(name) is not getattr(geometry, name)
    got = _run(elementwise.chain(name), dtype, name)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert (w is None) == (g is None)
        if w is not None:
            torch.testing.assert_close(g, w, **tol)


def _structure_module_step(dtype):
    cfg = StructureModuleConfig(c_s=16, c_z=8, c_hidden_ipa=4, c_hidden_ang_res=8, num_heads_ipa=2, num_qk_points=3,
                                num_v_points=4, dropout_rate=0.0, num_blocks=2, num_ang_res_blocks=1, num_angles=7,
                                scale_factor=10.0, inf=1e5, eps=1e-8)  # fmt: skip
    torch.manual_seed(0)
    module = StructureModule(cfg).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    # the trunk's outputs require grad in a training step: so do these (the chains' inputs' requires_grad as there)
    s = torch.randn(1, 6, 16, dtype=dtype, requires_grad=True)
    z = torch.randn(1, 6, 6, 8, dtype=dtype, requires_grad=True)
    mask, aatype = torch.ones(1, 6, dtype=dtype), torch.randint(0, 21, (1, 6))
    with torch.no_grad():  # a recycling pass's grad mode: graphs of its own
        recycled = module(s, z, mask, aatype)
    out = module(s, z, mask, aatype)
    loss = sum((v * torch.linspace(-1, 1, v.numel(), dtype=dtype).view(v.shape)).sum() for v in out.values())
    loss.backward()
    return out, [p.grad for p in module.parameters()], recycled


def test_structure_module_with_compiled_geometry_equals_eager():
    """The whole structure module (two blocks: a no-grad pass as in recycling, then forward and backward) with its
    geometry chains traced and run through AOT autograd (``aot_eager``: the graphs inductor compiles, each chain
    checked under inductor above). (The training step's test in test_elementwise.py compiles only the Evoformer's
    chains: the geometry chains' both grad modes are checked here.)"""
    want = _structure_module_step(torch.float32)
    elementwise.enable("aot_eager", elementwise.GEOMETRY_CHAINS)
    assert all(elementwise.chain(n) is not getattr(geometry, n) for n in elementwise.GEOMETRY_CHAINS)
    got = _structure_module_step(torch.float32)
    for key in want[0]:
        torch.testing.assert_close(got[0][key], want[0][key], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-4, atol=1e-4)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
