"""The structure module's geometry as plain tensor functions: the rotation algebra and the chains built on it.

The frames of the structure module (:mod:`scalefold.model.rigid`) are written element by element in
fp32 (autocast-proof), so eager PyTorch runs hundreds of tiny kernels per block iteration: the side-chain
frames alone (torsion angles -> 8 group frames -> atom14 positions) are ~400 operators forward and more
backward, eight iterations a pass. Here the same arithmetic is cut into a few functions of tensors, each
one elementwise chain of :mod:`scalefold.kernels.elementwise` (one compiled kernel each way under
``--compile``). Each chain function IS the code the model ran through ``Rigid`` / ``Rotation`` before, in
the same order (the same operators, created in the same order, so the eager path -- its values and its
gradients, accumulation order included -- stays bit for bit what it was):

* :func:`backbone_update` -- Alg. 23: the quaternion update, normalised, the new translation, and the
  backbone frames in Angstrom (rotation matrices) the side chains start from;
* :func:`sidechain_frames` -- Alg. 24: torsion angles -> the 8 rigid-group frames -> atom14 positions;
* :func:`structure_outputs` -- the block's frame outputs (``[*, 7]`` and ``[*, 8, 4, 4]``);
* :func:`ipa_points`, :func:`ipa_logits`, :func:`ipa_attended_points` -- invariant point attention's
  point work: points into global frames, the logits with the point-distance term and the softmax, the
  attended points back into local frames with their norms.

Frames enter as ``rot`` (``[*, 4]`` quaternions or ``[*, 3, 3]`` matrices, told apart by rank against
the ``[*, 3]`` translation: static under ``torch.compile``) and ``trans``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# -- the rotation algebra, written out (autocast never downcasts it) --------------------------------


def rot_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Product ``a @ b`` of ``[*, 3, 3]`` rotation matrices, written out (autocast-proof)."""
    rows = []
    for i in range(3):
        rows.append(
            torch.stack(
                [
                    a[..., i, 0] * b[..., 0, j] + a[..., i, 1] * b[..., 1, j] + a[..., i, 2] * b[..., 2, j]
                    for j in range(3)
                ],
                dim=-1,
            )
        )
    return torch.stack(rows, dim=-2)


def rot_vec_mul(r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Rotate ``[*, 3]`` vectors by ``[*, 3, 3]`` matrices: ``r @ t``, written out."""
    x, y, z = torch.unbind(t, dim=-1)
    return torch.stack(
        [r[..., i, 0] * x + r[..., i, 1] * y + r[..., i, 2] * z for i in range(3)],
        dim=-1,
    )


def invert_rot_mat(rot_mat: torch.Tensor) -> torch.Tensor:
    """Inverse of ``[*, 3, 3]`` rotation matrices (the transpose)."""
    return rot_mat.transpose(-1, -2)


def quat_to_rot(quat: torch.Tensor) -> torch.Tensor:
    """``[*, 4]`` quaternions ``(a, b, c, d)`` (not necessarily unit) -> ``[*, 3, 3]`` matrices.

    Uses the homogeneous form ``R_ij = sum_kl q_k q_l M_klij`` (exact rotation for unit quats).
    """
    a, b, c, d = torch.unbind(quat, dim=-1)
    aa, bb, cc, dd = a * a, b * b, c * c, d * d
    ab, ac, ad = a * b, a * c, a * d
    bc, bd, cd = b * c, b * d, c * d
    rows = [
        [aa + bb - cc - dd, 2 * (bc - ad), 2 * (bd + ac)],
        [2 * (bc + ad), aa - bb + cc - dd, 2 * (cd - ab)],
        [2 * (bd - ac), 2 * (cd + ab), aa - bb - cc + dd],
    ]
    return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)


def quat_multiply_by_vec(quat: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """Hamilton product ``quat * (0, vec)`` with a pure-vector quaternion ``vec`` ``[*, 3]``."""
    a, b, c, d = torch.unbind(quat, dim=-1)
    x, y, z = torch.unbind(vec, dim=-1)
    return torch.stack(
        [
            -b * x - c * y - d * z,
            a * x + c * z - d * y,
            a * y - b * z + d * x,
            a * z + b * y - c * x,
        ],
        dim=-1,
    )


def _index_frames(rot: torch.Tensor, trans: torch.Tensor, new_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Rigid.__getitem__((..., None * new_dims))``: rotation first, then translation, as ``Rigid`` does."""
    index = (Ellipsis,) + (None,) * new_dims
    rot = rot[index + (slice(None),) * (1 if rot.dim() == trans.dim() else 2)]
    return rot, trans[index + (slice(None),)]


def _rot_mats(rot: torch.Tensor, trans: torch.Tensor) -> torch.Tensor:
    """``Rotation.get_rot_mats``: quaternions (same rank as ``trans``) converted, matrices as they are."""
    return quat_to_rot(rot) if rot.dim() == trans.dim() else rot


def _compose(r1: torch.Tensor, t1: torch.Tensor, r2: torch.Tensor, t2: torch.Tensor):
    """``Rigid.compose`` of matrix frames: ``(R1 R2, R1 t2 + t1)``."""
    return rot_matmul(r1, r2), rot_vec_mul(r1, t2) + t1


# -- the structure module's iteration (Alg. 20, 23) --------------------------------------------------


def backbone_update(quats: torch.Tensor, trans: torch.Tensor, update: torch.Tensor, scale: float):
    """Compose frames ``(quats [*, 4], trans [*, 3])`` (nm) with the ``[*, 6]`` update ``(x, y, z, t)``
    (``Rigid.compose_q_update_vec``) -> ``(quats, trans, rot_mats, trans * scale)``: the new frames and
    the backbone frames of the side chains (rotation matrices, Angstrom)."""
    q_vec, t_vec = update[..., :3], update[..., 3:]
    new_quats = quats + quat_multiply_by_vec(quats, q_vec)
    new_quats = new_quats / torch.linalg.norm(new_quats, dim=-1, keepdim=True)
    new_trans = trans + rot_vec_mul(quat_to_rot(quats), t_vec)
    return new_quats, new_trans, quat_to_rot(new_quats), new_trans * scale


def structure_outputs(quats: torch.Tensor, trans: torch.Tensor, rots: torch.Tensor, group_trans: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A block's frame outputs: ``[*, 7]`` (quaternion, translation * ``scale``: ``to_tensor_7``) and the
    ``[*, 8, 4, 4]`` homogeneous side-chain frames (``to_tensor_4x4``)."""
    scaled = trans * scale
    frames = scaled.new_zeros(scaled.shape[:-1] + (7,))
    frames[..., :4] = quats
    frames[..., 4:] = scaled
    groups = group_trans.new_zeros(group_trans.shape[:-1] + (4, 4))
    groups[..., :3, :3] = rots
    groups[..., :3, 3] = group_trans
    groups[..., 3, 3] = 1
    return frames, groups


# -- the side chains (Alg. 24) -----------------------------------------------------------------------


def torsion_angles_to_frames(rot: torch.Tensor, trans: torch.Tensor, alpha: torch.Tensor, aatype: torch.Tensor,
                             default_frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ``[*, N, 8]`` rigid-group frames (matrices, translations) in global coordinates from the
    backbone frames ``rot``/``trans`` ``[*, N]``, the ``[*, N, 7, 2]`` (sin, cos) torsion angles and the
    ``[21, 8, 4, 4]`` literature frames (:func:`scalefold.model.all_atom.torsion_angles_to_frames`)."""
    default = default_frames[aatype, ...]  # [*, N, 8, 4, 4] group -> parent group
    default_rot, default_trans = default[..., :3, :3], default[..., :3, 3]
    # The backbone group gets the identity "angle" (sin 0, cos 1): [*, N, 8, 2].
    bb_rot = alpha.new_zeros((1,) * len(alpha.shape[:-1]) + (2,))
    bb_rot[..., 1] = 1
    alpha = torch.cat([bb_rot.expand(alpha.shape[:-2] + (-1, -1)), alpha], dim=-2)
    # Rotations about the x-axis, as in the AlphaFold source: [[1, 0, 0], [0, cos, -sin], [0, sin, cos]]
    sin, cos = alpha[..., 0], alpha[..., 1]
    all_rots = alpha.new_zeros(alpha.shape[:-1] + (3, 3))
    all_rots[..., 0, 0] = 1
    all_rots[..., 1, 1] = cos
    all_rots[..., 1, 2] = -sin
    all_rots[..., 2, 1] = sin
    all_rots[..., 2, 2] = cos
    zero_trans = torch.zeros(all_rots.shape[:-2] + (3,), dtype=all_rots.dtype, device=all_rots.device)
    rots, group_trans = _compose(default_rot, default_trans, all_rots, zero_trans)
    # chi2..chi4 frames are relative to the previous chi frame: chain them to the backbone.
    chi = [(rots[..., 4, :, :], group_trans[..., 4, :])]
    for k in (5, 6, 7):
        chi.append(_compose(*chi[-1], rots[..., k, :, :], group_trans[..., k, :]))
    parts = [(rots[..., :5, :, :], group_trans[..., :5, :])]
    parts += [(r.unsqueeze(-3), t.unsqueeze(-2)) for r, t in chi[1:]]
    rots_to_bb = torch.cat([r for r, _ in parts], dim=-3)
    trans_to_bb = torch.cat([t for _, t in parts], dim=-2)
    rot, trans = _index_frames(rot, trans, 1)
    return _compose(_rot_mats(rot, trans), trans, rots_to_bb, trans_to_bb)


def atom14_positions(rots: torch.Tensor, trans: torch.Tensor, aatype: torch.Tensor, group_idx: torch.Tensor,
                     atom_mask: torch.Tensor, lit_positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``[*, N, 14, 3]`` atom positions: each atom's literature position placed by its group's frame
    (``rots`` ``[*, N, 8, 3, 3]``, ``trans`` ``[*, N, 8, 3]``), zero where the residue has no such atom."""
    atom_group = group_idx[aatype, ...]  # [*, N, 14]
    atom_rots = torch.gather(rots, -3, atom_group[..., None, None].expand(atom_group.shape + (3, 3)))
    atom_trans = torch.gather(trans, -2, atom_group[..., None].expand(atom_group.shape + (3,)))
    lit = lit_positions[aatype, ...]
    positions = rot_vec_mul(atom_rots, lit) + atom_trans
    return positions * atom_mask[aatype, ...].unsqueeze(-1)


def sidechain_frames(rot: torch.Tensor, trans: torch.Tensor, alpha: torch.Tensor, aatype: torch.Tensor,
                     default_frames: torch.Tensor, group_idx: torch.Tensor, atom_mask: torch.Tensor,
                     lit_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Alg. 24 in one: backbone frames + torsion angles -> the 8 group frames ``(rots, trans)`` and the
    ``[*, N, 14, 3]`` atom14 positions (the ``[21, ...]`` constant tables of :mod:`scalefold.model.all_atom`)."""
    rots, group_trans = torsion_angles_to_frames(rot, trans, alpha, aatype, default_frames)
    return rots, group_trans, atom14_positions(rots, group_trans, aatype, group_idx, atom_mask, lit_positions)


# -- invariant point attention (Alg. 22) -------------------------------------------------------------


def ipa_points(pts: torch.Tensor, rot: torch.Tensor, trans: torch.Tensor) -> torch.Tensor:
    """Projected points ``[*, N, P * 3]`` laid out ``[all x | all y | all z]`` -> ``[*, N, P, 3]`` in
    global coordinates by the frames ``[*, N]`` (``r[..., None].apply``)."""
    pts = torch.stack(torch.split(pts, pts.shape[-1] // 3, dim=-1), dim=-1)
    rot, trans = _index_frames(rot, trans, 1)
    return rot_vec_mul(_rot_mats(rot, trans), pts) + trans


def ipa_logits(a: torch.Tensor, b: torch.Tensor, q_pts: torch.Tensor, k_pts: torch.Tensor, head_weights: torch.Tensor,
               mask: torch.Tensor, scale_qk: float, scale_pt: float, inf: float) -> torch.Tensor:  # fmt: skip
    """IPA's attention weights ``[*, H, N, N]``: the scaled query-key products ``a``, the pair bias ``b``
    ``[*, N, N, H]``, the head-weighted point distances of ``q_pts``/``k_pts`` ``[*, N, H, P, 3]`` and the
    mask's offset, then the softmax over the keys."""
    a = a * scale_qk
    a = a + math.sqrt(1.0 / 3) * b.movedim(-1, -3)
    # Point term: -gamma_h * w_C / 2 * sum_p |q_pts_i - k_pts_j|^2.
    pt_att = q_pts.unsqueeze(-4) - k_pts.unsqueeze(-5)  # [*, N, N, H, P, 3]
    pt_att = sum(torch.unbind(pt_att**2, dim=-1))  # [*, N, N, H, P]
    weights = F.softplus(head_weights).view((1,) * (pt_att.ndim - 2) + (head_weights.shape[0], 1))
    weights = weights * scale_pt
    pt_att = -0.5 * torch.sum(pt_att * weights, dim=-1)  # [*, N, N, H]
    square_mask = (mask.unsqueeze(-1) * mask.unsqueeze(-2) - 1.0) * inf  # [*, N, N]
    a = a + pt_att.movedim(-1, -3)
    a = a + square_mask.unsqueeze(-3)
    return torch.softmax(a, dim=-1)


def ipa_attended_points(a: torch.Tensor, v_pts: torch.Tensor, rot: torch.Tensor, trans: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The value points ``[*, N, H, P, 3]`` attended with ``a`` ``[*, H, N, N]`` and mapped back into the
    local frames (``r[..., None, None].invert_apply``) -> ``([*, N, H, P, 3], their norms [*, N, H, P])``."""
    o_pt = torch.sum(
        a.unsqueeze(-3).unsqueeze(-1)  # [*, H, 1, N, N, 1]
        * v_pts.swapdims(-4, -3).movedim(-1, -3).unsqueeze(-3),  # [*, H, 3, 1, N, P]
        dim=-2,
    )  # [*, H, 3, N, P]
    o_pt = o_pt.movedim(-3, -1).swapdims(-3, -4)
    rot, trans = _index_frames(rot, trans, 2)
    o_pt = o_pt - trans
    o_pt = rot_vec_mul(invert_rot_mat(_rot_mats(rot, trans)), o_pt)
    return o_pt, torch.sqrt(torch.sum(o_pt**2, dim=-1) + eps)


__all__ = [
    "atom14_positions", "backbone_update", "invert_rot_mat", "ipa_attended_points", "ipa_logits", "ipa_points",
    "quat_multiply_by_vec", "quat_to_rot", "rot_matmul", "rot_vec_mul", "sidechain_frames", "structure_outputs",
    "torsion_angles_to_frames",
]  # fmt: skip
