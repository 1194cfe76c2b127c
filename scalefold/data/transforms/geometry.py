"""Supervision features derived from a structure: deterministic functions of aatype + atom37.

* atom14 <-> atom37 index maps, atom-existence masks, atom14 ground truth and its
  symmetry-swapped alternative (Supplementary 1.9.3, Algorithm 26 "renameSymmetricGroundTruthAtoms");
* the eight rigid-group frames per residue and their alternatives (Algorithm 21 "rigidFrom3Points",
  Table 2, Supplementary 1.8);
* backbone / side-chain torsion angles as (sin, cos) (Algorithm 24's inverse, Supplementary 1.9.1);
* pseudo-beta positions (CA for glycine, CB otherwise).

Operation order follows the MLPerf HPC OpenFold reference, so results agree with it to float
rounding. All functions are batched over leading dims (``[*, N_res, ...]``); floating outputs take
the dtype/device of the positions (masks: of the atom mask).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from scalefold import residue_constants as rc

Features = dict[str, torch.Tensor]

NUM_RIGID_GROUPS = 8
NUM_TORSIONS = 7
#: Frame construction epsilon inside the square roots of Algorithm 21.
FRAME_EPS = 1e-8
#: Epsilon of the (sin, cos) normalisation.
TORSION_NORM_EPS = 1e-8


# ---------------------------------------------------------------------------------------------
# Per-residue-type lookup tables (index 20 = UNK), built once as numpy arrays.
# ---------------------------------------------------------------------------------------------


@cache
def _tables() -> dict[str, np.ndarray]:
    resnames = [rc.restype_1to3[r] for r in rc.restypes]
    atom14_mask = np.array(
        [[1.0 if name else 0.0 for name in rc.restype_name_to_atom14_names[n]] for n in resnames] + [[0.0] * 14],
        dtype=np.float32,
    )  # [21, 14]
    atom37_mask = np.zeros((21, 37), dtype=np.float32)
    for i, name in enumerate(resnames):
        for atom in rc.residue_atoms[name]:
            atom37_mask[i, rc.atom_order[atom]] = 1.0

    # Rigid groups (Table 2): 0 backbone (C, CA, N), 3 psi (CA, C, O), 4..7 chi1..chi4
    # (last three atoms of the chi); groups 1, 2 (pre-omega, phi) have no ground-truth frame.
    base_atoms = np.zeros((21, NUM_RIGID_GROUPS, 3), dtype=np.int64)
    group_exists = np.zeros((21, NUM_RIGID_GROUPS), dtype=np.float32)
    group_exists[:, 0] = 1.0
    group_exists[:, 3] = 1.0
    group_ambiguous = np.zeros((21, NUM_RIGID_GROUPS), dtype=np.float32)
    for i, name in enumerate(resnames):
        base_atoms[i, 0] = [rc.atom_order[a] for a in ("C", "CA", "N")]
        base_atoms[i, 3] = [rc.atom_order[a] for a in ("CA", "C", "O")]
        for chi, atoms in enumerate(rc.chi_angles_atoms[name]):
            if rc.chi_angles_mask[i][chi]:
                base_atoms[i, chi + 4] = [rc.atom_order[a] for a in atoms[1:]]
        group_exists[i, 4:] = rc.chi_angles_mask[i]
        if name in rc.residue_atom_renaming_swaps:
            # The last chi of ASP/GLU/PHE/TYR is pi-periodic: its frame is ambiguous.
            group_ambiguous[i, int(sum(rc.chi_angles_mask[i])) - 1 + 4] = 1.0
    base_atoms[20, 0] = [rc.atom_order[a] for a in ("C", "CA", "N")]
    base_atoms[20, 3] = [rc.atom_order[a] for a in ("CA", "C", "O")]

    chi_atoms = np.zeros((21, 4, 4), dtype=np.int64)  # atom37 indices of the 4 atoms of each chi
    chi_atoms[:20] = rc.chi_angles_atom_indices
    chi_mask = np.zeros((21, 4), dtype=np.float32)
    chi_mask[:20] = rc.chi_angles_mask
    chi_pi_periodic = np.zeros((21, 4), dtype=np.float32)
    chi_pi_periodic[:20] = np.asarray(rc.chi_pi_periodic, dtype=np.float32)[:20]

    return {
        "atom14_to_atom37": np.asarray(rc.restype_atom14_to_atom37, dtype=np.int64),  # [21, 14]
        "atom37_to_atom14": np.asarray(rc.restype_atom37_to_atom14, dtype=np.int64),  # [21, 37]
        "atom14_mask": atom14_mask,
        "atom37_mask": atom37_mask,
        "atom14_ambiguous": np.asarray(rc.restype_atom14_ambiguous_atoms, dtype=np.float32),  # [21, 14]
        "atom14_swap": np.asarray(rc.restype_atom14_ambiguous_atoms_swap_idx, dtype=np.int64),  # [21, 14]
        "group_base_atoms": base_atoms,
        "group_exists": group_exists,
        "group_ambiguous": group_ambiguous,
        "chi_atoms": chi_atoms,
        "chi_mask": chi_mask,
        "chi_pi_periodic": chi_pi_periodic,
    }


def _table(name: str, aatype: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-residue rows of lookup table ``name``: ``[*, N_res, ...]``."""
    table = torch.as_tensor(_tables()[name], device=aatype.device)
    if dtype is not None:
        table = table.to(dtype)
    return table[aatype.long()]


def _gather_atoms(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-residue atom gather: ``values`` [*, N_res, 37] (masks) or [*, N_res, 37, 3] (positions),
    ``index`` [*, N_res, ...] atom37 indices -> [*, N_res, ...] (masks) or [*, N_res, ..., 3]."""
    is_mask = values.shape[-1] == 37
    res_dims = values.dim() - (1 if is_mask else 2)  # number of dims up to and including N_res
    per_residue = int(np.prod(index.shape[res_dims:]))
    flat_index = index.reshape(*index.shape[:res_dims], per_residue)  # [*, N_res, K]
    if is_mask:
        return torch.gather(values, -1, flat_index).reshape(index.shape)
    out = torch.gather(values, -2, flat_index[..., None].expand(*flat_index.shape, 3))
    return out.reshape(*index.shape, 3)


# ---------------------------------------------------------------------------------------------
# Rigid-frame arithmetic (rotation [*, 3, 3] + translation [*, 3]).
# ---------------------------------------------------------------------------------------------


def frames_from_3_points(
    p_neg_x_axis: torch.Tensor, origin: torch.Tensor, p_xy_plane: torch.Tensor, eps: float = FRAME_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 21 (Gram-Schmidt): frame with origin ``origin``, x axis pointing away from
    ``p_neg_x_axis``, ``p_xy_plane`` in the xy plane. Returns (rotation [*, 3, 3], translation [*, 3])."""
    p_neg_x_axis, origin_c, p_xy_plane = (t.unbind(-1) for t in (p_neg_x_axis, origin, p_xy_plane))
    e0 = [c1 - c2 for c1, c2 in zip(origin_c, p_neg_x_axis)]
    e1 = [c1 - c2 for c1, c2 in zip(p_xy_plane, origin_c)]
    denom = torch.sqrt(sum(c * c for c in e0) + eps)
    e0 = [c / denom for c in e0]
    dot = sum(c1 * c2 for c1, c2 in zip(e0, e1))
    e1 = [c2 - c1 * dot for c1, c2 in zip(e0, e1)]
    denom = torch.sqrt(sum(c * c for c in e1) + eps)
    e1 = [c / denom for c in e1]
    e2 = [
        e0[1] * e1[2] - e0[2] * e1[1],
        e0[2] * e1[0] - e0[0] * e1[2],
        e0[0] * e1[1] - e0[1] * e1[0],
    ]
    rot = torch.stack([c for row in zip(e0, e1, e2) for c in row], dim=-1)
    rot = rot.reshape(rot.shape[:-1] + (3, 3))  # columns are e0, e1, e2
    return rot, torch.stack(origin_c, dim=-1)


def _rotate(rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``rot @ v`` for [*, 3, 3] x [*, 3], written out element-wise."""
    x, y, z = v.unbind(-1)
    return torch.stack([rot[..., i, 0] * x + rot[..., i, 1] * y + rot[..., i, 2] * z for i in range(3)], dim=-1)


def _to_4x4(rot: torch.Tensor, trans: torch.Tensor) -> torch.Tensor:
    """Homogeneous [*, 4, 4] matrix of a frame."""
    out = trans.new_zeros((*trans.shape[:-1], 4, 4))
    out[..., :3, :3] = rot
    out[..., :3, 3] = trans
    out[..., 3, 3] = 1
    return out


# ---------------------------------------------------------------------------------------------
# Features.
# ---------------------------------------------------------------------------------------------


def atom14_masks(aatype: torch.Tensor, dtype: torch.dtype = torch.float32) -> Features:
    """Index maps and existence masks from the residue types alone (Supplementary 1.2.1).

    Returns ``atom14_atom_exists`` [*, N, 14], ``residx_atom14_to_atom37`` [*, N, 14] (int64),
    ``residx_atom37_to_atom14`` [*, N, 37] (int64), ``atom37_atom_exists`` [*, N, 37].
    """
    return {
        "atom14_atom_exists": _table("atom14_mask", aatype, dtype),
        "residx_atom14_to_atom37": _table("atom14_to_atom37", aatype),
        "residx_atom37_to_atom14": _table("atom37_to_atom14", aatype),
        "atom37_atom_exists": _table("atom37_mask", aatype, dtype),
    }


def atom14_ground_truth(
    aatype: torch.Tensor, all_atom_positions: torch.Tensor, all_atom_mask: torch.Tensor
) -> Features:
    """atom14 ground truth and its symmetry-swapped alternative (Algorithm 26's inputs).

    Returns ``atom14_gt_exists``, ``atom14_gt_positions`` [*, N, 14, 3], ``atom14_alt_gt_positions``,
    ``atom14_alt_gt_exists`` and ``atom14_atom_is_ambiguous`` (ASP/GLU/PHE/TYR symmetric atoms).
    """
    mask_dtype = all_atom_mask.dtype
    to_atom37 = _table("atom14_to_atom37", aatype)  # [*, N, 14]
    exists = _table("atom14_mask", aatype, mask_dtype)
    gt_exists = exists * _gather_atoms(all_atom_mask, to_atom37)  # [*, N, 14]
    gt_positions = gt_exists[..., None].to(all_atom_positions.dtype) * _gather_atoms(all_atom_positions, to_atom37)

    swap = _table("atom14_swap", aatype)  # [*, N, 14]: each atom's symmetric partner (or itself)
    alt_positions = torch.gather(gt_positions, -2, swap[..., None].expand(*swap.shape, 3))
    alt_exists = torch.gather(gt_exists, -1, swap)
    return {
        "atom14_gt_exists": gt_exists,
        "atom14_gt_positions": gt_positions,
        "atom14_alt_gt_positions": alt_positions,
        "atom14_alt_gt_exists": alt_exists,
        "atom14_atom_is_ambiguous": _table("atom14_ambiguous", aatype, mask_dtype),
    }


def rigid_group_frames(
    aatype: torch.Tensor, all_atom_positions: torch.Tensor, all_atom_mask: torch.Tensor, eps: float = FRAME_EPS
) -> Features:
    """Ground-truth frames of the 8 rigid groups per residue (Algorithm 21 on Table 2's atoms).

    Returns ``rigidgroups_gt_frames`` / ``rigidgroups_alt_gt_frames`` [*, N, 8, 4, 4],
    ``rigidgroups_gt_exists``, ``rigidgroups_group_exists``, ``rigidgroups_group_is_ambiguous``
    [*, N, 8]. The backbone frame is rotated by pi about y (x -> -x, z -> -z); the alternative
    frame of a pi-periodic chi group is rotated by pi about x.
    """
    mask_dtype = all_atom_mask.dtype
    base_atoms = _table("group_base_atoms", aatype)  # [*, N, 8, 3]
    base_pos = _gather_atoms(all_atom_positions, base_atoms)  # [*, N, 8, 3, 3]
    rot, trans = frames_from_3_points(base_pos[..., 0, :], base_pos[..., 1, :], base_pos[..., 2, :], eps)

    group_exists = _table("group_exists", aatype, mask_dtype)  # [*, N, 8]
    base_atoms_exist = _gather_atoms(all_atom_mask, base_atoms)  # [*, N, 8, 3]
    gt_exists = torch.min(base_atoms_exist, dim=-1)[0] * group_exists

    # Backbone group: compose with diag(-1, 1, -1), i.e. negate the x and z axes.
    flip = torch.ones(NUM_RIGID_GROUPS, 3, dtype=rot.dtype, device=rot.device)
    flip[0, 0] = -1
    flip[0, 2] = -1
    rot = rot * flip[:, None, :]

    ambiguous = _table("group_ambiguous", aatype, mask_dtype)  # [*, N, 8]
    # Alternative frames: compose with diag(1, -1, -1) where ambiguous.
    alt_flip = torch.ones((*ambiguous.shape, 1, 3), dtype=rot.dtype, device=rot.device)
    alt_flip[..., 0, 1:] = 1 - 2 * ambiguous[..., None].to(rot.dtype)
    alt_rot = rot * alt_flip

    return {
        "rigidgroups_gt_frames": _to_4x4(rot, trans),
        "rigidgroups_gt_exists": gt_exists,
        "rigidgroups_group_exists": group_exists,
        "rigidgroups_group_is_ambiguous": ambiguous,
        "rigidgroups_alt_gt_frames": _to_4x4(alt_rot, trans),
    }


def backbone_frames(rigid_groups: Features) -> Features:
    """``backbone_rigid_tensor`` [*, N, 4, 4] and ``backbone_rigid_mask`` [*, N]: rigid group 0."""
    return {
        "backbone_rigid_tensor": rigid_groups["rigidgroups_gt_frames"][..., 0, :, :],
        "backbone_rigid_mask": rigid_groups["rigidgroups_gt_exists"][..., 0],
    }


def torsion_atoms(
    aatype: torch.Tensor, all_atom_positions: torch.Tensor, all_atom_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The four atoms defining each of the 7 torsions: positions ``[*, N, 7, 4, 3]``, mask ``[*, N, 7]``.

    Backbone: pre-omega (CA-, C-, N, CA), phi (C-, N, CA, C), psi (N, CA, C, O); the previous
    residue of the first one is a zero pad (its atoms sit at the origin, mask 0). Side chain:
    chi1..chi4 from the residue type's chi-atom table (UNK / gaps: index 0, mask 0).
    """
    aatype = torch.clamp(aatype.long(), max=20)
    pos, mask = all_atom_positions, all_atom_mask
    prev_pos = torch.cat([pos.new_zeros([*pos.shape[:-3], 1, 37, 3]), pos[..., :-1, :, :]], dim=-3)
    prev_mask = torch.cat([mask.new_zeros([*mask.shape[:-2], 1, 37]), mask[..., :-1, :]], dim=-2)

    pre_omega_pos = torch.cat([prev_pos[..., 1:3, :], pos[..., :2, :]], dim=-2)
    phi_pos = torch.cat([prev_pos[..., 2:3, :], pos[..., :3, :]], dim=-2)
    psi_pos = torch.cat([pos[..., :3, :], pos[..., 4:5, :]], dim=-2)
    pre_omega_mask = torch.prod(prev_mask[..., 1:3], dim=-1) * torch.prod(mask[..., :2], dim=-1)
    phi_mask = prev_mask[..., 2] * torch.prod(mask[..., :3], dim=-1, dtype=mask.dtype)
    psi_mask = torch.prod(mask[..., :3], dim=-1, dtype=mask.dtype) * mask[..., 4]

    chi_atoms = _table("chi_atoms", aatype)  # [*, N, 4, 4]
    chis_pos = _gather_atoms(pos, chi_atoms)  # [*, N, 4, 4, 3]
    chis_mask = _table("chi_mask", aatype, mask.dtype) * torch.prod(
        _gather_atoms(mask, chi_atoms), dim=-1, dtype=mask.dtype
    )

    torsions_pos = torch.cat(
        [pre_omega_pos[..., None, :, :], phi_pos[..., None, :, :], psi_pos[..., None, :, :], chis_pos], dim=-3
    )  # [*, N, 7, 4, 3]
    torsions_mask = torch.cat([pre_omega_mask[..., None], phi_mask[..., None], psi_mask[..., None], chis_mask], -1)
    return torsions_pos, torsions_mask


def degenerate_torsion_frames(torsions_pos: torch.Tensor, min_area: float = 1e-2) -> torch.Tensor:
    """Torsions whose Gram-Schmidt frame is ill-defined: ``[*, N, 7]`` bool.

    The frame of a torsion is built on its atoms 1, 2, 0 (:func:`frames_from_3_points`). When two
    of them coincide -- typically the pre-omega of the first residue, whose previous-residue atoms
    are the zero pad, or missing atoms left at the origin -- the second axis is pure rounding
    noise, so the (sin, cos) there is an arbitrary unit vector that changes with the last bit of
    the coordinates (1 ulp flips it). In real data such torsions are masked out (their atoms are
    padding or unresolved); their values are implementation-defined, so comparisons with the
    reference skip them. ``min_area``
    (squared Angstrom) bounds ``|(a2 - a1) x (a0 - a2)|``; real backbone/side-chain triples give ~2.
    """
    a0, a1, a2 = torsions_pos[..., 0, :], torsions_pos[..., 1, :], torsions_pos[..., 2, :]
    area = torch.linalg.vector_norm(torch.cross(a2 - a1, a0 - a2, dim=-1), dim=-1)
    return area < min_area


def torsion_angles(
    aatype: torch.Tensor, all_atom_positions: torch.Tensor, all_atom_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torsion angles (pre-omega, phi, psi, chi1..4) as unit (sin, cos) pairs.

    Returns ``(sin_cos [*, N, 7, 2], alt_sin_cos [*, N, 7, 2], mask [*, N, 7])``; the alternative
    adds pi to pi-periodic chis. Residue types > 20 (gaps in templates) count as UNK.
    """
    aatype = torch.clamp(aatype.long(), max=20)
    torsions_pos, torsions_mask = torsion_atoms(aatype, all_atom_positions, all_atom_mask)

    # Frame on atoms 1, 2 (origin), 0; express atom 3 in it: sin = z, cos = y.
    rot, trans = frames_from_3_points(torsions_pos[..., 1, :], torsions_pos[..., 2, :], torsions_pos[..., 0, :])
    rot_inv = rot.transpose(-1, -2)
    fourth = _rotate(rot_inv, torsions_pos[..., 3, :]) + (-1 * _rotate(rot_inv, trans))
    sin_cos = torch.stack([fourth[..., 2], fourth[..., 1]], dim=-1)
    denom = torch.sqrt(torch.sum(torch.square(sin_cos), dim=-1, dtype=sin_cos.dtype, keepdim=True) + TORSION_NORM_EPS)
    sin_cos = sin_cos / denom
    psi_sign = sin_cos.new_tensor([1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    sin_cos = sin_cos * psi_sign[:, None]

    chi_pi_periodic = _table("chi_pi_periodic", aatype, sin_cos.dtype)  # [*, N, 4]
    mirror = torch.cat([sin_cos.new_ones(*aatype.shape, 3), 1.0 - 2.0 * chi_pi_periodic], dim=-1)
    alt_sin_cos = sin_cos * mirror[..., None]
    return sin_cos, alt_sin_cos, torsions_mask


def pseudo_beta(
    aatype: torch.Tensor, all_atom_positions: torch.Tensor, all_atom_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pseudo-beta atom (CA for glycine, CB otherwise): positions [*, N, 3] and mask [*, N]."""
    is_gly = aatype == rc.restype_order["G"]
    ca, cb = rc.atom_order["CA"], rc.atom_order["CB"]
    positions = torch.where(is_gly[..., None], all_atom_positions[..., ca, :], all_atom_positions[..., cb, :])
    mask = torch.where(is_gly, all_atom_mask[..., ca], all_atom_mask[..., cb])
    return positions, mask


def structure_features(aatype: torch.Tensor, all_atom_positions: torch.Tensor, all_atom_mask: torch.Tensor) -> Features:
    """All supervision features of a chain: atom14 maps/ground truth, rigid groups, backbone
    frames, pseudo-beta, chi angles (sin, cos) and chi mask."""
    feats = atom14_masks(aatype, dtype=all_atom_mask.dtype)
    feats.update(atom14_ground_truth(aatype, all_atom_positions, all_atom_mask))
    groups = rigid_group_frames(aatype, all_atom_positions, all_atom_mask)
    feats.update(groups)
    feats.update(backbone_frames(groups))
    sin_cos, _, torsion_mask = torsion_angles(aatype, all_atom_positions, all_atom_mask)
    feats["pseudo_beta"], feats["pseudo_beta_mask"] = pseudo_beta(aatype, all_atom_positions, all_atom_mask)
    feats["chi_angles_sin_cos"] = sin_cos[..., 3:, :]
    feats["chi_mask"] = torsion_mask[..., 3:]
    return feats


def template_structure_features(
    template_aatype: torch.Tensor, template_all_atom_positions: torch.Tensor, template_all_atom_mask: torch.Tensor
) -> Features:
    """Template torsion angles (sin, cos, alternative, mask) and pseudo-beta features."""
    sin_cos, alt, mask = torsion_angles(template_aatype, template_all_atom_positions, template_all_atom_mask)
    beta, beta_mask = pseudo_beta(template_aatype, template_all_atom_positions, template_all_atom_mask)
    return {
        "template_torsion_angles_sin_cos": sin_cos,
        "template_alt_torsion_angles_sin_cos": alt,
        "template_torsion_angles_mask": mask,
        "template_pseudo_beta": beta,
        "template_pseudo_beta_mask": beta_mask,
    }
