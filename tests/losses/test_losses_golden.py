"""AlphaFold2 losses against the MLPerf reference goldens, plus gradient, invariance and padding
properties that the goldens alone do not pin."""

from __future__ import annotations

import math

import pytest
import torch

from scalefold.losses import (
    AlphaFoldLoss,
    backbone_fape_loss,
    compute_renamed_ground_truth,
    fape_loss,
    last_recycling_slice,
    sidechain_fape_loss,
    supervised_chi_loss,
)
from scalefold.model.rigid import quat_multiply, quat_to_rot, rot_vec_mul

GOLDEN_RTOL = 1e-9  # float64 re-implementation of the same math: observed bitwise equal

# Residue axis of every output the loss reads (distogram logits have two).
OUTPUT_RESIDUE_DIMS = {
    "sm_frames": (2,),
    "sm_sidechain_frames": (2,),
    "sm_unnormalized_angles": (2,),
    "sm_angles": (2,),
    "sm_positions": (2,),
    "final_atom_positions": (1,),
    "final_affine_tensor": (1,),
    "lddt_logits": (1,),
    "distogram_logits": (1, 2),
    "masked_msa_logits": (2,),
    "experimentally_resolved_logits": (1,),
}


def _golden_inputs(golden_small: dict, dtype=torch.float64):
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in golden_small["batch"].items()}
    outputs = {k: v.to(dtype) for k, v in golden_small["outputs"].items()}
    return outputs, batch


def _loss_fn(golden_small: dict, **kwargs) -> AlphaFoldLoss:
    return AlphaFoldLoss(golden_small["config"]["loss_config"], **kwargs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return abs(float(a) - float(b)) / max(abs(float(b)), 1e-300)


# ---------------------------------------------------------------------------------------------
# Golden equivalence
# ---------------------------------------------------------------------------------------------


def test_alphafold_loss_reproduces_golden_losses(golden_small):
    """Fed the reference model's float64 outputs and batch, AlphaFoldLoss reproduces every entry
    of golden_small["losses"] (unweighted terms, weighted total, sqrt(min(L, crop)) scaled total
    and the back-propagated loss) to float64 rounding."""
    outputs, batch = _golden_inputs(golden_small)
    loss, terms = _loss_fn(golden_small)(outputs, batch)
    expected = golden_small["losses"]
    assert set(expected) <= set(terms)
    for name, value in expected.items():
        assert _rel(terms[name], value) <= GOLDEN_RTOL, (name, float(terms[name]), float(value))
    assert _rel(loss, expected["loss_backpropagated"]) <= GOLDEN_RTOL
    assert loss.dtype == torch.float64


def test_crop_size_argument_and_presliced_batch(golden_small):
    """crop_size=config["train_sequence_crop_size"] (= the padded N_res here) gives the same
    loss as the reference's default (the batch's residue dim), and a batch already sliced to the
    last recycling iteration with batch_has_recycling_dim=False gives the same result."""
    outputs, batch = _golden_inputs(golden_small)
    crop = golden_small["config"]["train_sequence_crop_size"]
    ref, _ = _loss_fn(golden_small)(outputs, batch)
    with_crop, _ = _loss_fn(golden_small, crop_size=crop)(outputs, batch)
    sliced, _ = _loss_fn(golden_small, batch_has_recycling_dim=False)(outputs, last_recycling_slice(batch))
    assert torch.equal(ref, with_crop) and torch.equal(ref, sliced)
    seq_len = int(batch["seq_length"][0, -1])
    expected_scale = math.sqrt(min(seq_len, crop))
    _, terms = _loss_fn(golden_small)(outputs, batch)
    ratio = float(terms["scaled_weighted_total_loss"] / terms["weighted_total_loss"])
    assert abs(ratio - expected_scale) < 1e-6


def test_loss_uses_last_recycling_slice(golden_small):
    """Only batch[..., -1] is read: scrambling every earlier recycling slice leaves the loss
    bitwise unchanged."""
    outputs, batch = _golden_inputs(golden_small)
    ref, _ = _loss_fn(golden_small)(outputs, batch)
    gen = torch.Generator().manual_seed(0)
    scrambled = {}
    for k, v in batch.items():
        v = v.clone()
        if v.is_floating_point():
            v[..., :-1] = torch.randn(v[..., :-1].shape, generator=gen, dtype=v.dtype)
        scrambled[k] = v
    loss, _ = _loss_fn(golden_small)(outputs, scrambled)
    assert torch.equal(loss, ref)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_low_precision_runs(golden_small, dtype, rtol):
    """The loss runs in float32 and bf16 (device/dtype follow the inputs) and stays close to the
    float64 golden total."""
    outputs, batch = _golden_inputs(golden_small, dtype)
    loss, terms = _loss_fn(golden_small)(outputs, batch)
    assert torch.isfinite(loss)
    assert _rel(loss, golden_small["losses"]["loss_backpropagated"]) <= rtol


# ---------------------------------------------------------------------------------------------
# Padding independence
# ---------------------------------------------------------------------------------------------


def test_loss_independent_of_padded_residues(golden_small):
    """Replacing every output entry that belongs to a padded residue (seq_mask == 0) by noise
    leaves the loss and every term bitwise unchanged, and the loss gradient w.r.t. the outputs is
    exactly zero there."""
    outputs, batch = _golden_inputs(golden_small)
    ref_loss, ref_terms = _loss_fn(golden_small)(outputs, batch)

    padded = batch["seq_mask"][0, :, -1] == 0
    assert padded.any()
    gen = torch.Generator().manual_seed(1)
    noisy = {}
    for key, value in outputs.items():
        value = value.clone()
        for dim in OUTPUT_RESIDUE_DIMS.get(key, ()):
            index = [slice(None)] * value.dim()
            index[dim] = padded
            value[tuple(index)] = 10 * torch.randn(value[tuple(index)].shape, generator=gen, dtype=value.dtype)
        noisy[key] = value.requires_grad_(key in OUTPUT_RESIDUE_DIMS)

    loss, terms = _loss_fn(golden_small)(noisy, batch)
    assert torch.equal(loss, ref_loss)
    for name in ref_terms:
        assert torch.equal(terms[name], ref_terms[name]), name

    loss.backward()
    for key, dims in OUTPUT_RESIDUE_DIMS.items():
        grad = noisy[key].grad
        if grad is None:
            continue
        for dim in dims:
            index = [slice(None)] * grad.dim()
            index[dim] = padded
            assert torch.count_nonzero(grad[tuple(index)]) == 0, key


# ---------------------------------------------------------------------------------------------
# FAPE: gradients and invariance
# ---------------------------------------------------------------------------------------------


def _random_frames_4x4(n: int, gen: torch.Generator, scale: float = 6.0) -> torch.Tensor:
    q = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    t = scale * torch.randn(n, 3, generator=gen, dtype=torch.float64)
    frames = torch.zeros(n, 4, 4, dtype=torch.float64)
    frames[:, :3, :3] = quat_to_rot(q / q.norm(dim=-1, keepdim=True))
    frames[:, :3, 3] = t
    frames[:, 3, 3] = 1
    return frames


def test_backbone_fape_gradcheck():
    """Backbone FAPE (clamped and unclamped samples mixed, masked frames) has analytic gradients
    w.r.t. the predicted quaternion+translation trajectory equal to finite differences."""
    gen = torch.Generator().manual_seed(2)
    n_res, n_iter = 5, 2
    traj = torch.randn(2, n_iter, n_res, 7, generator=gen, dtype=torch.float64)
    traj[..., 4:] *= 8.0  # spread over the clamp distance
    traj.requires_grad_(True)
    gt = torch.stack([_random_frames_4x4(n_res, gen), _random_frames_4x4(n_res, gen)])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.float64)
    use_clamped = torch.tensor([1.0, 0.0], dtype=torch.float64)

    def fn(t):
        return backbone_fape_loss(gt, mask, t, use_clamped_fape=use_clamped, clamp_distance=10.0)

    assert torch.autograd.gradcheck(fn, (traj,), eps=1e-6, atol=1e-7)


def test_sidechain_fape_gradcheck():
    """Side-chain FAPE's gradients w.r.t. the predicted rigid-group frames and atom positions of
    the final iteration equal finite differences; earlier iterations get zero gradient."""
    gen = torch.Generator().manual_seed(3)
    n_res, n_iter = 3, 2
    frames = torch.stack([_random_frames_4x4(n_res * 8, gen).view(n_res, 8, 4, 4) for _ in range(n_iter)])[None]
    positions = 4 * torch.randn(1, n_iter, n_res, 14, 3, generator=gen, dtype=torch.float64)
    gt_frames = _random_frames_4x4(n_res * 8, gen).view(1, n_res, 8, 4, 4)
    alt_frames = _random_frames_4x4(n_res * 8, gen).view(1, n_res, 8, 4, 4)
    gt_exists = (torch.rand(1, n_res, 8, generator=gen) > 0.3).double()
    gt_pos = 4 * torch.randn(1, n_res, 14, 3, generator=gen, dtype=torch.float64)
    pos_exists = (torch.rand(1, n_res, 14, generator=gen) > 0.3).double()
    alt_better = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    frames.requires_grad_(True)
    positions.requires_grad_(True)

    def fn(f, p):
        return sidechain_fape_loss(f, p, gt_frames, alt_frames, gt_exists, gt_pos, pos_exists, alt_better)

    assert torch.autograd.gradcheck(fn, (frames, positions), eps=1e-6, atol=1e-7)
    fn(frames, positions).sum().backward()
    assert torch.count_nonzero(frames.grad[:, 0]) == 0 and torch.count_nonzero(positions.grad[:, 0]) == 0


def _global_motion(gen: torch.Generator):
    q = torch.randn(4, generator=gen, dtype=torch.float64)
    q = q / q.norm()
    return q, quat_to_rot(q), 20 * torch.randn(3, generator=gen, dtype=torch.float64)


def _move_frames_4x4(frames: torch.Tensor, rot: torch.Tensor, trans: torch.Tensor) -> torch.Tensor:
    g = torch.eye(4, dtype=frames.dtype)
    g[:3, :3], g[:3, 3] = rot, trans
    return g @ frames


def test_fape_invariant_to_global_motion(golden_small):
    """FAPE (backbone + side chain, on the golden outputs) is unchanged by a global rotation and
    translation of the prediction, and separately of the ground truth."""
    outputs, batch = _golden_inputs(golden_small)
    batch = last_recycling_slice(batch)
    cfg = golden_small["config"]["loss_config"]["fape_loss_config"]
    kwargs = {k: v for k, v in cfg.items() if k != "weight"}

    def fape(outs, b):
        b = dict(b)
        b.update(compute_renamed_ground_truth(b, outs["sm_positions"][:, -1]))
        return fape_loss(outs, b, **kwargs)

    ref = fape(outputs, batch)
    gen = torch.Generator().manual_seed(4)

    q, rot, trans = _global_motion(gen)
    moved = dict(outputs)
    traj = outputs["sm_frames"]
    moved["sm_frames"] = torch.cat(
        [quat_multiply(q.expand_as(traj[..., :4]), traj[..., :4]), rot_vec_mul(rot, traj[..., 4:]) + trans], dim=-1
    )
    moved["sm_sidechain_frames"] = _move_frames_4x4(outputs["sm_sidechain_frames"], rot, trans)
    moved["sm_positions"] = rot_vec_mul(rot, outputs["sm_positions"]) + trans
    assert torch.allclose(fape(moved, batch), ref, rtol=1e-10, atol=0)

    _, rot, trans = _global_motion(gen)
    moved_batch = dict(batch)
    for key in ("backbone_rigid_tensor", "rigidgroups_gt_frames", "rigidgroups_alt_gt_frames"):
        moved_batch[key] = _move_frames_4x4(batch[key], rot, trans)
    for key in ("atom14_gt_positions", "atom14_alt_gt_positions"):
        moved_batch[key] = rot_vec_mul(rot, batch[key]) + trans
    assert torch.allclose(fape(outputs, moved_batch), ref, rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------------------------
# Chi loss
# ---------------------------------------------------------------------------------------------


def test_supervised_chi_gradcheck_and_pi_periodicity():
    """The torsion loss has correct gradients w.r.t. normalised and unnormalised angles, and a
    π-periodic chi (ASP chi2) predicted at the true angle + π costs nothing, while a non-periodic
    chi (ASP chi1) at + π is penalised."""
    gen = torch.Generator().manual_seed(5)
    n_res, n_iter = 4, 2
    aatype = torch.tensor([[3, 0, 6, 13]])  # ASP, ALA, GLU, PHE
    unnorm = torch.randn(1, n_iter, n_res, 7, 2, generator=gen, dtype=torch.float64)
    angles = unnorm / unnorm.norm(dim=-1, keepdim=True)
    true = torch.randn(1, n_res, 4, 2, generator=gen, dtype=torch.float64)
    true = true / true.norm(dim=-1, keepdim=True)
    chi_mask = torch.tensor([[[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]], dtype=torch.float64)
    seq_mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.float64)

    def fn(a, u):
        return supervised_chi_loss(a, u, aatype, seq_mask, chi_mask, true, chi_weight=0.5, angle_norm_weight=0.01)

    assert torch.autograd.gradcheck(fn, (angles.requires_grad_(), unnorm.requires_grad_()), eps=1e-6, atol=1e-7)

    # Perfect prediction except ASP (residue 0): chi2 flipped by π -> free; chi1 flipped -> penalised.
    perfect = torch.zeros(1, 1, n_res, 7, 2, dtype=torch.float64)
    perfect[..., 3:, :] = true[:, None]
    zero_norm = supervised_chi_loss(perfect, perfect, aatype, seq_mask, chi_mask, true, angle_norm_weight=0.0)
    flipped = perfect.clone()
    flipped[0, 0, 0, 4] *= -1
    assert torch.allclose(
        supervised_chi_loss(flipped, flipped, aatype, seq_mask, chi_mask, true, angle_norm_weight=0.0), zero_norm
    )
    flipped[0, 0, 0, 3] *= -1
    assert (
        supervised_chi_loss(flipped, flipped, aatype, seq_mask, chi_mask, true, angle_norm_weight=0.0) > zero_norm + 0.1
    )
