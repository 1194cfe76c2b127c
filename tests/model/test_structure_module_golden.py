"""Structure module (Alg. 20-24): numerical equality with the MLPerf reference, SE(3) behaviour,
masking and precision handling."""

from __future__ import annotations

import math

import torch

from scalefold.model.all_atom import (
    frames_and_literature_positions_to_atom14_pos,
    rigid_group_constants,
    torsion_angles_to_frames,
)
from scalefold.model.config import StructureModuleConfig
from scalefold.model.rigid import Rigid
from scalefold.model.structure_module import InvariantPointAttention, StructureModule

F64 = torch.float64

# Small config for the self-contained tests (the golden uses the config stored beside it).
SMALL_CFG = dict(
    c_s=16,
    c_z=8,
    c_hidden_ipa=4,
    c_hidden_ang_res=8,
    num_heads_ipa=2,
    num_qk_points=3,
    num_v_points=4,
    dropout_rate=0.0,
    num_blocks=2,
    num_ang_res_blocks=2,
    num_angles=7,
    scale_factor=10.0,
    inf=1e5,
    eps=1e-8,
)


def _perturb_(module: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Add seeded noise to every parameter so zero-initialised ("final") layers carry signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(std * torch.randn(p.shape, generator=g, dtype=F64).to(p.dtype))


def _small_inputs(dtype=F64, n_res=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n_res, SMALL_CFG["c_s"], generator=g, dtype=F64).to(dtype)
    z = torch.randn(1, n_res, n_res, SMALL_CFG["c_z"], generator=g, dtype=F64).to(dtype)
    mask = torch.ones(1, n_res, dtype=dtype)
    mask[:, -1] = 0
    aatype = torch.randint(0, 21, (1, n_res), generator=g)
    return s, z, mask, aatype


def _small_module(dtype=F64) -> StructureModule:
    torch.manual_seed(0)
    module = StructureModule(StructureModuleConfig(**SMALL_CFG)).to(F64)
    _perturb_(module)
    return module.to(dtype)


# ---------------------------------------------------------------------------------------------
# Golden comparison
# ---------------------------------------------------------------------------------------------


def _rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(expected.abs().max().item(), floor)
    return (actual - expected).abs().max().item() / scale if scale > 0 else (actual - expected).abs().max().item()


def test_matches_reference_golden(golden_small, golden_modules):
    """Float64 outputs at valid residues, input gradients and parameter gradients of
    sum_k <outputs[k], cotangents[k]> equal the MLPerf reference's (tolerance 1e-10 relative).

    ``ipa.linear_b.bias`` gets an analytically zero gradient (a per-head constant shift of the
    logits cancels in the softmax); the reference value is ~1e-15 of rounding noise, so every
    gradient is compared relative to at least 1e-6 of the largest parameter gradient.
    """
    golden = golden_modules["structure_module"]
    cfg = StructureModuleConfig(**golden_small["config"]["structure_module_config"])
    module = StructureModule(cfg).to(F64)
    module.load_state_dict(golden["state_dict"], strict=True)
    module.train()

    inputs = dict(golden["inputs"])
    s = inputs["s"].clone().requires_grad_(True)
    z = inputs["z"].clone().requires_grad_(True)
    outputs = module(s=s, z=z, mask=inputs["mask"], aatype=inputs["aatype"])
    assert set(outputs) == set(golden["outputs"])

    valid = inputs["mask"][0].bool()
    for key, expected in golden["outputs"].items():
        actual = outputs[key]
        assert actual.shape == expected.shape and actual.dtype == F64, key
        if key == "sm_single":
            actual, expected = actual[:, valid], expected[:, valid]
        else:  # [B, blocks, N, ...]
            actual, expected = actual[:, :, valid], expected[:, :, valid]
        assert _rel_err(actual, expected) < 1e-10, key

    loss = sum(torch.sum(outputs[k] * golden["cotangents"][k]) for k in outputs)
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss, [s, z, *params.values()])
    for name, grad in zip(("s", "z"), grads[:2]):
        assert _rel_err(grad, golden["input_grads"][name]) < 1e-10, name
    assert set(golden["param_grads"]) == set(params)
    floor = 1e-6 * max(g.abs().max().item() for g in golden["param_grads"].values())
    for name, grad in zip(params, grads[2:]):
        assert _rel_err(grad, golden["param_grads"][name], floor) < 1e-10, name


def test_matches_full_model_golden(golden_small):
    """Run on the full-model golden's Evoformer outputs (``single``, ``pair``) with its
    ``structure_module.*`` weights: the ``sm_*`` outputs equal the reference's at valid residues.
    Together with the module golden this covers 15 of the 20 residue types' rigid-group tables."""
    cfg = StructureModuleConfig(**golden_small["config"]["structure_module_config"])
    module = StructureModule(cfg).to(F64)
    prefix = "structure_module."
    module.load_state_dict(
        {k[len(prefix) :]: v for k, v in golden_small["state_dict"].items() if k.startswith(prefix)}, strict=True
    )
    batch, expected = golden_small["batch"], golden_small["outputs"]
    mask = batch["seq_mask"][..., -1].to(F64)
    with torch.no_grad():
        outputs = module(expected["single"], expected["pair"], mask, batch["aatype"][..., -1])
    valid = mask[0].bool()
    for key, actual in outputs.items():
        if key == "sm_single":
            assert _rel_err(actual[:, valid], expected[key][:, valid]) < 1e-10, key
        else:
            assert _rel_err(actual[:, :, valid], expected[key][:, :, valid]) < 1e-10, key


def test_parameter_names_match_reference_checkpoint(reference_dir, golden_small):
    """Parameter names, order and shapes follow ``structure_module.*`` in the reference checkpoint
    (initial_training dims: c_s 384, c_z 128, IPA 12 heads x 16, 4/8 points, angle resnet 128)."""
    rows = [line.split("\t") for line in (reference_dir / "state_dict_initial_training.tsv").read_text().splitlines()]
    expected = [
        (name[len("structure_module.") :], shape) for name, shape, _ in rows if name.startswith("structure_module.")
    ]
    cfg = dict(golden_small["config"]["structure_module_config"])
    cfg.update(c_s=384, c_z=128, c_hidden_ipa=16, c_hidden_ang_res=128, num_heads_ipa=12)
    with torch.device("meta"):  # shapes only: skip the (slow) initialisation of real weights
        module = StructureModule(StructureModuleConfig(**cfg))
    actual = [(name, str(tuple(p.shape))) for name, p in module.named_parameters()]
    assert actual == expected
    assert len(module.state_dict()) == len(expected)  # no persistent buffers


# ---------------------------------------------------------------------------------------------
# Geometry: SE(3) invariance / covariance
# ---------------------------------------------------------------------------------------------


def _random_global_transform(seed: int) -> Rigid:
    g = torch.Generator().manual_seed(seed)
    return Rigid.from_tensor_7(torch.randn(7, generator=g, dtype=F64), normalize_quats=True)


def test_ipa_is_invariant_to_global_frame():
    """Composing every residue frame with one global rigid transform leaves IPA's output unchanged."""
    torch.manual_seed(0)
    ipa = InvariantPointAttention(c_s=16, c_z=8, c_hidden=4, num_heads=2, num_qk_points=3, num_v_points=4).to(F64)
    _perturb_(ipa)
    s, z, mask, _ = _small_inputs()
    g = torch.Generator().manual_seed(3)
    frames = Rigid.from_tensor_7(torch.randn(1, s.shape[1], 7, generator=g, dtype=F64), normalize_quats=True)
    out = ipa(s, z, frames, mask)
    assert out.abs().max() > 1e-3  # the test is not vacuous
    transform = _random_global_transform(4)
    moved = transform[None, None].compose(frames)
    torch.testing.assert_close(ipa(s, z, moved, mask), out, atol=1e-11, rtol=1e-11)


def test_atom_positions_transform_covariantly():
    """Moving the backbone frames by a global transform T moves all side-chain frames and atom14
    positions by T (Alg. 24 is SE(3)-covariant)."""
    g = torch.Generator().manual_seed(5)
    n_res = 21
    aatype = torch.arange(n_res)[None]
    frames = Rigid.from_tensor_7(torch.randn(1, n_res, 7, generator=g, dtype=F64), normalize_quats=True)
    angles = torch.randn(1, n_res, 7, 2, generator=g, dtype=F64)
    angles = angles / angles.norm(dim=-1, keepdim=True)
    consts = rigid_group_constants(F64, torch.device("cpu"))

    def atoms(backbone: Rigid):
        all_frames = torsion_angles_to_frames(backbone, angles, aatype, consts.default_frames)
        pos = frames_and_literature_positions_to_atom14_pos(
            all_frames, aatype, consts.group_idx, consts.atom_mask, consts.lit_positions
        )
        return all_frames, pos

    frames_0, pos_0 = atoms(frames)
    transform = _random_global_transform(6)
    frames_1, pos_1 = atoms(transform[None, None].compose(frames))
    torch.testing.assert_close(pos_1, transform[None, None, None].apply(pos_0) * consts.atom_mask[aatype][..., None])
    torch.testing.assert_close(frames_1.to_tensor_4x4(), transform[None, None, None].compose(frames_0).to_tensor_4x4())
    # Backbone atoms are placed by the backbone frame itself: CA at the frame origin.
    torch.testing.assert_close(pos_0[0, :20, 1], frames.get_trans()[0, :20])


def test_structure_module_output_geometry():
    """Unit quaternions, unit-norm angles, CA at the frame translation (Angstrom), and a
    per-block output stack of the documented shapes."""
    module = _small_module()
    s, z, mask, aatype = _small_inputs()
    out = module(s, z, mask, aatype)
    blocks, n_res = SMALL_CFG["num_blocks"], s.shape[1]
    assert out["sm_frames"].shape == (1, blocks, n_res, 7)
    assert out["sm_sidechain_frames"].shape == (1, blocks, n_res, 8, 4, 4)
    assert out["sm_positions"].shape == (1, blocks, n_res, 14, 3)
    assert out["sm_single"].shape == s.shape
    torch.testing.assert_close(out["sm_frames"][..., :4].norm(dim=-1), torch.ones(1, blocks, n_res, dtype=F64))
    torch.testing.assert_close(out["sm_angles"].norm(dim=-1), torch.ones(1, blocks, n_res, 7, dtype=F64))
    real = aatype[0] < 20  # UNK has no atoms
    ca = out["sm_positions"][0, :, real, 1]
    torch.testing.assert_close(ca, out["sm_frames"][0, :, real, 4:])
    torch.testing.assert_close(out["sm_sidechain_frames"][..., 0, :3, 3], out["sm_frames"][..., 4:])
    torch.testing.assert_close(out["sm_states"][:, -1], out["sm_single"])


def test_padded_residues_do_not_affect_valid_outputs():
    """Changing the inputs of masked residues leaves every output at valid residues unchanged."""
    module = _small_module()
    s, z, mask, aatype = _small_inputs()
    out = module(s, z, mask, aatype)
    s2, z2 = s.clone(), z.clone()
    s2[:, -1] += 5.0
    z2[:, -1] += 5.0
    z2[:, :, -1] -= 3.0
    out2 = module(s2, z2, mask, aatype)
    for key in out:
        a, b = (
            (out[key][:, :-1], out2[key][:, :-1]) if key == "sm_single" else (out[key][:, :, :-1], out2[key][:, :, :-1])
        )
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=key)


def test_rotation_gradient_stopped_between_blocks(monkeypatch):
    """Alg. 20, line 20: the frames entering block i+1 carry translations with gradient but
    detached rotations; gradients still reach every parameter and ``s``."""
    module = _small_module()
    seen = []
    ipa_forward = module.ipa.forward

    def recording_forward(s, z, r, mask):
        seen.append((r.get_rots().get_cur_rot().grad_fn, r.get_trans().grad_fn))
        return ipa_forward(s, z, r, mask)

    monkeypatch.setattr(module.ipa, "forward", recording_forward)
    s, z, mask, aatype = _small_inputs()
    s.requires_grad_(True)
    out = module(s, z, mask, aatype)
    assert len(seen) == SMALL_CFG["num_blocks"]
    rot_grad_fn, trans_grad_fn = seen[1]
    assert rot_grad_fn is None and trans_grad_fn is not None
    out["sm_positions"].sum().backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    assert all(p.grad is not None for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------


def test_float32_close_to_float64():
    """A float32 run agrees with float64 to float32 precision."""
    module = _small_module()
    s, z, mask, aatype = _small_inputs()
    ref = module(s, z, mask, aatype)
    module32 = _small_module(torch.float32)
    out = module32(s.float(), z.float(), mask.float(), aatype)
    for key in ref:
        assert out[key].dtype == torch.float32
        a, b = (
            (ref[key][:, :-1], out[key][:, :-1]) if key == "sm_single" else (ref[key][:, :, :-1], out[key][:, :, :-1])
        )
        assert _rel_err(b.double(), a) < 1e-4, key


def test_bf16_autocast_runs_in_float32():
    """Under bf16 autocast (fp32 params) the structure module computes in float32: outputs are
    float32 and identical to a run without autocast; bf16 inputs are upcast the same way."""
    module = _small_module(torch.float32)
    s, z, mask, aatype = _small_inputs(torch.float32)
    ref = module(s, z, mask, aatype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(s, z, mask, aatype)
        out_bf16_in = module(s.bfloat16(), z.bfloat16(), mask.bfloat16(), aatype)
    for key in ref:
        assert out[key].dtype == torch.float32 and out_bf16_in[key].dtype == torch.float32
        torch.testing.assert_close(out[key], ref[key], atol=0, rtol=0)


def test_bf16_parameters_use_float32_copies():
    """With bf16 parameters and inputs the module still computes in float32 and gradients
    reach the bf16 parameters."""
    module = _small_module(torch.bfloat16)
    s, z, mask, aatype = _small_inputs(torch.bfloat16)
    out = module(s, z, mask, aatype)
    assert out["sm_positions"].dtype == torch.float32
    assert torch.isfinite(out["sm_positions"]).all()
    out["sm_positions"].sum().backward()
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None and g.dtype == torch.bfloat16 for g in grads)
    assert math.isfinite(sum(g.float().abs().sum().item() for g in grads))
