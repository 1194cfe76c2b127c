"""all_atom helpers: atom14 -> atom37 scatter, pseudo-beta, and torsion frames (Alg. 24)."""

from __future__ import annotations

import math

import torch

from scalefold import residue_constants as rc
from scalefold.model.all_atom import (
    atom14_to_atom37,
    frames_and_literature_positions_to_atom14_pos,
    pseudo_beta_fn,
    rigid_group_constants,
    torsion_angles_to_frames,
)
from scalefold.model.rigid import Rigid

F64 = torch.float64


def _last_recycle(batch: dict) -> dict:
    return {k: v[..., -1] for k, v in batch.items() if isinstance(v, torch.Tensor)}


def test_atom14_to_atom37_matches_reference(golden_small):
    """``final_atom_positions`` of the reference = atom14_to_atom37 of the last block's positions."""
    feats = _last_recycle(golden_small["batch"])
    outputs = golden_small["outputs"]
    atom37 = atom14_to_atom37(outputs["sm_positions"][:, -1], feats)
    assert atom37.shape == outputs["final_atom_positions"].shape and atom37.dtype == F64
    torch.testing.assert_close(atom37, outputs["final_atom_positions"], atol=0, rtol=0)
    # Per-atom data without a trailing feature dim (e.g. a mask) works the same way.
    mask37 = atom14_to_atom37(feats["atom14_atom_exists"], feats)
    torch.testing.assert_close(mask37, feats["atom37_atom_exists"])


def test_pseudo_beta_matches_pipeline(golden_small):
    """CB (CA for glycine) positions and mask equal the pipeline's ``pseudo_beta`` features."""
    feats = _last_recycle(golden_small["batch"])
    pb, pb_mask = pseudo_beta_fn(feats["aatype"], feats["all_atom_positions"], feats["all_atom_mask"])
    torch.testing.assert_close(pb, feats["pseudo_beta"])
    torch.testing.assert_close(pb_mask, feats["pseudo_beta_mask"])
    assert pseudo_beta_fn(feats["aatype"], feats["all_atom_positions"]).shape == pb.shape


def test_identity_backbone_zero_angles_give_literature_backbone():
    """With identity backbone frames and (sin, cos) = (0, 1) torsions, backbone atoms N, CA, C
    sit at their literature positions and every side-chain frame equals its default chain."""
    consts = rigid_group_constants(F64, torch.device("cpu"))
    aatype = torch.arange(20)[None]
    backbone = Rigid.identity((1, 20), dtype=F64)
    angles = torch.zeros(1, 20, 7, 2, dtype=F64)
    angles[..., 1] = 1.0
    frames = torsion_angles_to_frames(backbone, angles, aatype, consts.default_frames)
    pos = frames_and_literature_positions_to_atom14_pos(
        frames, aatype, consts.group_idx, consts.atom_mask, consts.lit_positions
    )
    torch.testing.assert_close(pos[0, :, :3], consts.lit_positions[:20, :3])
    # Compare the [R | t] rows: absent chi frames are all-zero in the table (no homogeneous 1).
    default = consts.default_frames[aatype]
    torch.testing.assert_close(frames.to_tensor_4x4()[..., :5, :3, :], default[..., :5, :3, :])
    has_chi2 = torch.tensor(rc.chi_angles_mask)[:, 1].bool()
    chi2 = default[0, has_chi2, 4] @ default[0, has_chi2, 5]
    torch.testing.assert_close(frames.to_tensor_4x4()[0, has_chi2, 5, :3], chi2[..., :3, :])
    # Missing atoms are exactly zero.
    assert (pos[0][consts.atom_mask[:20] == 0] == 0).all()


def test_chi1_rotation_moves_only_side_chain():
    """Rotating chi1 by 180 degrees keeps backbone atoms and CB fixed and preserves bond lengths."""
    consts = rigid_group_constants(F64, torch.device("cpu"))
    lys = rc.restype_order["K"]
    aatype = torch.tensor([[lys]])
    backbone = Rigid.identity((1, 1), dtype=F64)

    def positions(chi1: float) -> torch.Tensor:
        angles = torch.zeros(1, 1, 7, 2, dtype=F64)
        angles[..., 1] = 1.0
        angles[..., 3, :] = torch.tensor([math.sin(chi1), math.cos(chi1)], dtype=F64)
        frames = torsion_angles_to_frames(backbone, angles, aatype, consts.default_frames)
        return frames_and_literature_positions_to_atom14_pos(
            frames, aatype, consts.group_idx, consts.atom_mask, consts.lit_positions
        )[0, 0]

    p0, p1 = positions(0.0), positions(math.pi)
    torch.testing.assert_close(p0[:5], p1[:5])  # N CA C O CB
    assert (p0[5] - p1[5]).norm() > 1.0  # CG moved
    cb_cg = lambda p: (p[5] - p[4]).norm()  # noqa: E731
    torch.testing.assert_close(cb_cg(p0), cb_cg(p1))
