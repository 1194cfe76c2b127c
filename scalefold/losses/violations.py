"""Structural violations and the violation loss (supplement 1.9.11, eq. 44–47).

* between-residue peptide-bond geometry: C–N bond length and the CA–C–N / C–N–CA angles
  (flat-bottom losses with a tolerance of ``violation_tolerance_factor`` literature stddevs);
* between-residue clashes: non-bonded heavy atoms of different residues closer than the sum of
  their van der Waals radii minus ``clash_overlap_tolerance``;
* within-residue violations: intra-residue atom pairs outside the bounds of
  ``residue_constants.make_atom14_dists_bounds`` (bonds, angles as virtual bonds, clashes).

Reference quirk kept for equivalence: the CA–C–N angle term uses the C–N *bond-length* stddev
(0.014) as its tolerance unit, as AlphaFold / OpenFold / the MLPerf reference do.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from scalefold import residue_constants as rc
from scalefold.losses.common import device_table

#: atom14 slots of the backbone atoms (identical for every residue type).
N_INDEX, CA_INDEX, C_INDEX = 0, 1, 2
#: atom14 slot of the cysteine SG atom (disulfide bridges are not clashes).
CYS_SG_INDEX = rc.restype_name_to_atom14_names["CYS"].index("SG")
NUM_ATOM14 = 14


class PeptideBondAtoms(NamedTuple):
    """The backbone atoms either side of each peptide bond ``i -> i+1``: positions
    ``[*, N_res - 1, 3]``, masks ``[*, N_res - 1]``; ``has_no_gap_mask`` is 0 at chain breaks."""

    this_ca_pos: torch.Tensor
    this_ca_mask: torch.Tensor
    this_c_pos: torch.Tensor
    this_c_mask: torch.Tensor
    next_n_pos: torch.Tensor
    next_n_mask: torch.Tensor
    next_ca_pos: torch.Tensor
    next_ca_mask: torch.Tensor
    has_no_gap_mask: torch.Tensor


class BondTerm(NamedTuple):
    """One flat-bottom term of :func:`between_residue_bond_loss`."""

    loss_per_bond: torch.Tensor  # [*, N_res - 1]
    loss_mean: torch.Tensor  # [*], over the bonds whose atoms exist (chain breaks excluded)
    violation_mask: torch.Tensor  # [*, N_res - 1], beyond the hard tolerance


def between_residue_bond_loss(
    pred_atom_positions: torch.Tensor,
    pred_atom_mask: torch.Tensor,
    residue_index: torch.Tensor,
    aatype: torch.Tensor,
    tolerance_factor_soft: float = 12.0,
    tolerance_factor_hard: float = 12.0,
    eps: float = 1e-6,
) -> dict[str, torch.Tensor]:
    """Flat-bottom losses on the peptide bond between consecutive residues (eq. 44, 45).

    Args:
        pred_atom_positions: [*, N_res, 14, 3] (atom14; N, CA, C in slots 0, 1, 2)
        pred_atom_mask:      [*, N_res, 14]
        residue_index:       [*, N_res] (assumed increasing; a jump != 1 is a chain break)
        aatype:              [*, N_res]
    Returns:
        ``c_n_loss_mean``, ``ca_c_n_loss_mean``, ``c_n_ca_loss_mean`` [*];
        ``per_residue_loss_sum`` [*, N_res]; ``per_residue_violation_mask`` [*, N_res].
    """
    atoms = peptide_bond_atoms(pred_atom_positions, pred_atom_mask, residue_index)
    c_n_bond_length, c_n = c_n_bond_length_loss(atoms, aatype, tolerance_factor_soft, tolerance_factor_hard, eps)
    ca_c_n, c_n_ca = peptide_bond_angle_losses(
        atoms, c_n_bond_length, tolerance_factor_soft, tolerance_factor_hard, eps
    )
    per_residue_loss_sum, violation_mask = bond_losses_per_residue(c_n, ca_c_n, c_n_ca)
    return {
        "c_n_loss_mean": c_n.loss_mean,
        "ca_c_n_loss_mean": ca_c_n.loss_mean,
        "c_n_ca_loss_mean": c_n_ca.loss_mean,
        "per_residue_loss_sum": per_residue_loss_sum,
        "per_residue_violation_mask": violation_mask,
    }


def peptide_bond_atoms(
    pred_atom_positions: torch.Tensor, pred_atom_mask: torch.Tensor, residue_index: torch.Tensor
) -> PeptideBondAtoms:
    """CA(i), C(i), N(i+1), CA(i+1) of every residue pair ``(i, i+1)`` from atom14 positions
    ``[*, N_res, 14, 3]`` and mask ``[*, N_res, 14]``, and which pairs are not a chain break."""
    return PeptideBondAtoms(
        this_ca_pos=pred_atom_positions[..., :-1, CA_INDEX, :],
        this_ca_mask=pred_atom_mask[..., :-1, CA_INDEX],
        this_c_pos=pred_atom_positions[..., :-1, C_INDEX, :],
        this_c_mask=pred_atom_mask[..., :-1, C_INDEX],
        next_n_pos=pred_atom_positions[..., 1:, N_INDEX, :],
        next_n_mask=pred_atom_mask[..., 1:, N_INDEX],
        next_ca_pos=pred_atom_positions[..., 1:, CA_INDEX, :],
        next_ca_mask=pred_atom_mask[..., 1:, CA_INDEX],
        has_no_gap_mask=(residue_index[..., 1:] - residue_index[..., :-1]) == 1.0,
    )


def c_n_bond_length_loss(
    atoms: PeptideBondAtoms,
    aatype: torch.Tensor,
    tolerance_factor_soft: float,
    tolerance_factor_hard: float,
    eps: float,
) -> tuple[torch.Tensor, BondTerm]:
    """C(i)-N(i+1) bond-length term (eq. 44); the bond to a proline is slightly longer.

    Returns the bond lengths ``[*, N_res - 1]`` (the angle terms use them) and the term.
    """
    c_n_bond_length = torch.sqrt(eps + torch.sum((atoms.this_c_pos - atoms.next_n_pos) ** 2, dim=-1))
    next_is_proline = aatype[..., 1:] == rc.resname_to_idx["PRO"]
    gt_length = (~next_is_proline) * rc.between_res_bond_length_c_n[0] + next_is_proline * (
        rc.between_res_bond_length_c_n[1]
    )
    gt_stddev = (~next_is_proline) * rc.between_res_bond_length_stddev_c_n[0] + next_is_proline * (
        rc.between_res_bond_length_stddev_c_n[1]
    )
    c_n_bond_length_error = torch.sqrt(eps + (c_n_bond_length - gt_length) ** 2)
    c_n_loss_per_residue = torch.relu(c_n_bond_length_error - tolerance_factor_soft * gt_stddev)
    mask = atoms.this_c_mask * atoms.next_n_mask * atoms.has_no_gap_mask
    c_n_loss = torch.sum(mask * c_n_loss_per_residue, dim=-1) / (torch.sum(mask, dim=-1) + eps)
    c_n_violation_mask = mask * (c_n_bond_length_error > (tolerance_factor_hard * gt_stddev))
    return c_n_bond_length, BondTerm(c_n_loss_per_residue, c_n_loss, c_n_violation_mask)


def peptide_bond_angle_losses(
    atoms: PeptideBondAtoms,
    c_n_bond_length: torch.Tensor,
    tolerance_factor_soft: float,
    tolerance_factor_hard: float,
    eps: float,
) -> tuple[BondTerm, BondTerm]:
    """The CA(i)-C(i)-N(i+1) and C(i)-N(i+1)-CA(i+1) bond-angle terms (eq. 45), on the angles'
    cosines (dot products of unit bond vectors). ``c_n_bond_length``: from
    :func:`c_n_bond_length_loss`."""
    ca_c_bond_length = torch.sqrt(eps + torch.sum((atoms.this_ca_pos - atoms.this_c_pos) ** 2, dim=-1))
    n_ca_bond_length = torch.sqrt(eps + torch.sum((atoms.next_n_pos - atoms.next_ca_pos) ** 2, dim=-1))
    c_ca_unit_vec = (atoms.this_ca_pos - atoms.this_c_pos) / ca_c_bond_length[..., None]
    c_n_unit_vec = (atoms.next_n_pos - atoms.this_c_pos) / c_n_bond_length[..., None]
    n_ca_unit_vec = (atoms.next_ca_pos - atoms.next_n_pos) / n_ca_bond_length[..., None]

    # CA(i)-C(i)-N(i+1). The tolerance unit is the C-N bond-length stddev (reference quirk).
    ca_c_n_cos_angle = torch.sum(c_ca_unit_vec * c_n_unit_vec, dim=-1)
    gt_angle = rc.between_res_cos_angles_ca_c_n[0]
    gt_stddev = rc.between_res_bond_length_stddev_c_n[0]
    ca_c_n_cos_angle_error = torch.sqrt(eps + (ca_c_n_cos_angle - gt_angle) ** 2)
    ca_c_n_loss_per_residue = torch.relu(ca_c_n_cos_angle_error - tolerance_factor_soft * gt_stddev)
    mask = atoms.this_ca_mask * atoms.this_c_mask * atoms.next_n_mask * atoms.has_no_gap_mask
    ca_c_n_loss = torch.sum(mask * ca_c_n_loss_per_residue, dim=-1) / (torch.sum(mask, dim=-1) + eps)
    ca_c_n_violation_mask = mask * (ca_c_n_cos_angle_error > (tolerance_factor_hard * gt_stddev))

    # C(i)-N(i+1)-CA(i+1).
    c_n_ca_cos_angle = torch.sum((-c_n_unit_vec) * n_ca_unit_vec, dim=-1)
    gt_angle = rc.between_res_cos_angles_c_n_ca[0]
    gt_stddev = rc.between_res_cos_angles_c_n_ca[1]
    c_n_ca_cos_angle_error = torch.sqrt(eps + torch.square(c_n_ca_cos_angle - gt_angle))
    c_n_ca_loss_per_residue = torch.relu(c_n_ca_cos_angle_error - tolerance_factor_soft * gt_stddev)
    mask = atoms.this_c_mask * atoms.next_n_mask * atoms.next_ca_mask * atoms.has_no_gap_mask
    c_n_ca_loss = torch.sum(mask * c_n_ca_loss_per_residue, dim=-1) / (torch.sum(mask, dim=-1) + eps)
    c_n_ca_violation_mask = mask * (c_n_ca_cos_angle_error > (tolerance_factor_hard * gt_stddev))
    return (
        BondTerm(ca_c_n_loss_per_residue, ca_c_n_loss, ca_c_n_violation_mask),
        BondTerm(c_n_ca_loss_per_residue, c_n_ca_loss, c_n_ca_violation_mask),
    )


def bond_losses_per_residue(c_n: BondTerm, ca_c_n: BondTerm, c_n_ca: BondTerm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per_residue_loss_sum, per_residue_violation_mask)`` ``[*, N_res]`` of the three
    peptide-bond terms: each bond's loss is shared equally by its two residues, and a residue
    violates if either of its bonds does."""
    per_bond_loss = c_n.loss_per_bond + ca_c_n.loss_per_bond + c_n_ca.loss_per_bond
    per_residue_loss_sum = 0.5 * (F.pad(per_bond_loss, (0, 1)) + F.pad(per_bond_loss, (1, 0)))

    violation_mask = torch.max(
        torch.stack([c_n.violation_mask, ca_c_n.violation_mask, c_n_ca.violation_mask], dim=-2),
        dim=-2,
    )[0]
    violation_mask = torch.maximum(F.pad(violation_mask, (0, 1)), F.pad(violation_mask, (1, 0)))
    return per_residue_loss_sum, violation_mask


def between_residue_clash_loss(
    atom14_pred_positions: torch.Tensor,
    atom14_atom_exists: torch.Tensor,
    atom14_atom_radius: torch.Tensor,
    residue_index: torch.Tensor,
    overlap_tolerance_soft: float = 1.5,
    overlap_tolerance_hard: float = 1.5,
    eps: float = 1e-10,
    mean_eps: float = 1e-6,
) -> dict[str, torch.Tensor]:
    """Steric clashes between atoms of different residues (eq. 46, i != j part).

    Args:
        atom14_pred_positions: [*, N_res, 14, 3]
        atom14_atom_exists:    [*, N_res, 14]
        atom14_atom_radius:    [*, N_res, 14] van der Waals radii
        residue_index:         [*, N_res]
    Returns:
        ``mean_loss`` [*], ``per_atom_loss_sum`` [*, N_res, 14], ``per_atom_clash_mask`` [*, N_res, 14].
    """
    dtype = atom14_pred_positions.dtype
    batch_ones = (1,) * len(residue_index.shape[:-1])

    # [*, N_res, N_res, 14, 14]
    dists = torch.sqrt(
        eps
        + torch.sum(
            (atom14_pred_positions[..., :, None, :, None, :] - atom14_pred_positions[..., None, :, None, :, :]) ** 2,
            dim=-1,
        )
    )
    dists_mask = (atom14_atom_exists[..., :, None, :, None] * atom14_atom_exists[..., None, :, None, :]).to(dtype)
    # Each residue pair once (i < j); same-residue pairs are handled by within_residue_violations.
    dists_mask = dists_mask * (residue_index[..., :, None, None, None] < residue_index[..., None, :, None, None])

    # The C(i)-N(i+1) peptide bond is not a clash.
    c_one_hot = _atom14_one_hot(C_INDEX, residue_index.device)
    c_one_hot = c_one_hot.reshape(*batch_ones, *c_one_hot.shape).to(dtype)
    n_one_hot = _atom14_one_hot(N_INDEX, residue_index.device)
    n_one_hot = n_one_hot.reshape(*batch_ones, *n_one_hot.shape).to(dtype)
    neighbour_mask = (residue_index[..., :, None, None, None] + 1) == residue_index[..., None, :, None, None]
    c_n_bonds = neighbour_mask * c_one_hot[..., None, None, :, None] * n_one_hot[..., None, None, None, :]
    dists_mask = dists_mask * (1.0 - c_n_bonds)

    # Disulfide bridges (SG-SG) are not clashes.
    cys_sg_one_hot = _atom14_one_hot(CYS_SG_INDEX, residue_index.device)
    cys_sg_one_hot = cys_sg_one_hot.reshape(*batch_ones, *cys_sg_one_hot.shape)
    disulfide_bonds = cys_sg_one_hot[..., None, None, :, None] * cys_sg_one_hot[..., None, None, None, :]
    dists_mask = dists_mask * (1.0 - disulfide_bonds)

    # [*, N_res, N_res, 14, 14]
    dists_lower_bound = dists_mask * (
        atom14_atom_radius[..., :, None, :, None] + atom14_atom_radius[..., None, :, None, :]
    )
    dists_to_low_error = dists_mask * torch.relu(dists_lower_bound - overlap_tolerance_soft - dists)

    mean_loss = torch.sum(dists_to_low_error, dim=(-4, -3, -2, -1)) / (
        mean_eps + torch.sum(dists_mask, dim=(-4, -3, -2, -1))
    )
    per_atom_loss_sum = torch.sum(dists_to_low_error, dim=(-4, -2)) + torch.sum(dists_to_low_error, dim=(-3, -1))

    clash_mask = dists_mask * (dists < (dists_lower_bound - overlap_tolerance_hard))
    per_atom_clash_mask = torch.maximum(torch.amax(clash_mask, dim=(-4, -2)), torch.amax(clash_mask, dim=(-3, -1)))
    return {
        "mean_loss": mean_loss,
        "per_atom_loss_sum": per_atom_loss_sum,
        "per_atom_clash_mask": per_atom_clash_mask,
    }


def within_residue_violations(
    atom14_pred_positions: torch.Tensor,
    atom14_atom_exists: torch.Tensor,
    atom14_dists_lower_bound: torch.Tensor,
    atom14_dists_upper_bound: torch.Tensor,
    tighten_bounds_for_loss: float = 0.0,
    eps: float = 1e-10,
) -> dict[str, torch.Tensor]:
    """Bond, angle and clash violations inside each residue (eq. 46, i == j part).

    Args:
        atom14_pred_positions:    [*, N_res, 14, 3]
        atom14_atom_exists:       [*, N_res, 14]
        atom14_dists_lower_bound: [*, N_res, 14, 14]
        atom14_dists_upper_bound: [*, N_res, 14, 14]
    Returns:
        ``per_atom_loss_sum`` [*, N_res, 14], ``per_atom_violations`` [*, N_res, 14].
    """
    not_self = 1.0 - torch.eye(NUM_ATOM14, device=atom14_atom_exists.device, dtype=atom14_atom_exists.dtype)
    # [*, N_res, 14, 14]
    dists_masks = atom14_atom_exists[..., :, :, None] * atom14_atom_exists[..., :, None, :] * not_self
    dists = torch.sqrt(
        eps
        + torch.sum(
            (atom14_pred_positions[..., :, :, None, :] - atom14_pred_positions[..., :, None, :, :]) ** 2,
            dim=-1,
        )
    )
    dists_to_low_error = torch.relu(atom14_dists_lower_bound + tighten_bounds_for_loss - dists)
    dists_to_high_error = torch.relu(dists - (atom14_dists_upper_bound - tighten_bounds_for_loss))
    loss = dists_masks * (dists_to_low_error + dists_to_high_error)
    per_atom_loss_sum = torch.sum(loss, dim=-2) + torch.sum(loss, dim=-1)

    violations = dists_masks * ((dists < atom14_dists_lower_bound) | (dists > atom14_dists_upper_bound))
    per_atom_violations = torch.maximum(torch.max(violations, dim=-2)[0], torch.max(violations, dim=-1)[0])
    return {"per_atom_loss_sum": per_atom_loss_sum, "per_atom_violations": per_atom_violations}


def _atom14_one_hot(index: int, device: torch.device) -> torch.Tensor:
    """``F.one_hot(index, 14)`` (int64) on ``device``, built once (no host-to-device copy in the step)."""
    return device_table(f"atom14_one_hot:{index}", device, torch.int64,
                        lambda: F.one_hot(torch.tensor(index), num_classes=NUM_ATOM14))  # fmt: skip


def _bounds_table(which: str, bounds: dict[str, np.ndarray], tolerances: tuple[float, float], device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``bounds[which]`` ``[21, 14, 14]`` on ``device`` in ``dtype``, built once per tolerance pair."""
    return device_table(f"atom14_dists_{which}:{tolerances}", device, dtype, lambda: bounds[which])


#: ``make_atom14_dists_bounds`` per ``(overlap_tolerance, bond_length_tolerance_factor)``: a plain dict, filled
#: outside any compiled region (:class:`scalefold.losses.AlphaFoldLoss` fills its tolerances' entry when it is built),
#: because ``torch.compile`` ignores ``functools.cache`` and would trace its thousands of NumPy assignments into
#: the loss's graph (minutes of compile time for a constant table); a compiled loss reads the arrays found here.
_DISTS_BOUNDS: dict[tuple[float, float], dict[str, np.ndarray]] = {}


def prepare_dists_bounds(overlap_tolerance: float, bond_length_tolerance_factor: float) -> dict[str, np.ndarray]:
    """The intra-residue distance bounds for these tolerances, built once (call it outside compiled code)."""
    key = (float(overlap_tolerance), float(bond_length_tolerance_factor))
    bounds = _DISTS_BOUNDS.get(key)
    if bounds is None:
        bounds = _DISTS_BOUNDS[key] = rc.make_atom14_dists_bounds(
            overlap_tolerance=overlap_tolerance, bond_length_tolerance_factor=bond_length_tolerance_factor
        )
    return bounds


def atom37_van_der_waals_radius() -> np.ndarray:
    """[37] van der Waals radius of each atom37 type (element = first letter of the name)."""
    return np.array([rc.van_der_waals_radius[name[0]] for name in rc.atom_types])


def find_structural_violations(
    batch: dict[str, torch.Tensor],
    atom14_pred_positions: torch.Tensor,
    violation_tolerance_factor: float = 12.0,
    clash_overlap_tolerance: float = 1.5,
) -> dict[str, dict[str, torch.Tensor] | torch.Tensor]:
    """All structural-violation terms of a predicted atom14 structure.

    Args:
        batch: with ``atom14_atom_exists``, ``residue_index``, ``aatype``, ``residx_atom14_to_atom37``.
        atom14_pred_positions: [*, N_res, 14, 3]
    Returns:
        nested dict ``between_residues`` / ``within_residues`` / ``total_per_residue_violations_mask``
        (same layout as the reference).
    """
    atom14_atom_exists = batch["atom14_atom_exists"]
    connection_violations = between_residue_bond_loss(
        pred_atom_positions=atom14_pred_positions,
        pred_atom_mask=atom14_atom_exists,
        residue_index=batch["residue_index"],
        aatype=batch["aatype"],
        tolerance_factor_soft=violation_tolerance_factor,
        tolerance_factor_hard=violation_tolerance_factor,
    )

    # [*, N_res, 14]
    device, dtype = atom14_pred_positions.device, atom14_pred_positions.dtype
    atomtype_radius = device_table("atom37_van_der_waals_radius", device, dtype, atom37_van_der_waals_radius)
    atom14_atom_radius = atom14_atom_exists * atomtype_radius[batch["residx_atom14_to_atom37"]]
    between_residue_clashes = between_residue_clash_loss(
        atom14_pred_positions=atom14_pred_positions,
        atom14_atom_exists=atom14_atom_exists,
        atom14_atom_radius=atom14_atom_radius,
        residue_index=batch["residue_index"],
        overlap_tolerance_soft=clash_overlap_tolerance,
        overlap_tolerance_hard=clash_overlap_tolerance,
    )

    tolerances = (clash_overlap_tolerance, violation_tolerance_factor)
    bounds = prepare_dists_bounds(*tolerances)
    residue_violations = within_residue_violations(
        atom14_pred_positions=atom14_pred_positions,
        atom14_atom_exists=atom14_atom_exists,
        atom14_dists_lower_bound=_bounds_table("lower_bound", bounds, tolerances, device, dtype)[batch["aatype"]],
        atom14_dists_upper_bound=_bounds_table("upper_bound", bounds, tolerances, device, dtype)[batch["aatype"]],
        tighten_bounds_for_loss=0.0,
    )

    # [*, N_res]
    per_residue_violations_mask = torch.max(
        torch.stack(
            [
                connection_violations["per_residue_violation_mask"],
                torch.max(between_residue_clashes["per_atom_clash_mask"], dim=-1)[0],
                torch.max(residue_violations["per_atom_violations"], dim=-1)[0],
            ],
            dim=-1,
        ),
        dim=-1,
    )[0]

    return {
        "between_residues": {
            "bonds_c_n_loss_mean": connection_violations["c_n_loss_mean"],
            "angles_ca_c_n_loss_mean": connection_violations["ca_c_n_loss_mean"],
            "angles_c_n_ca_loss_mean": connection_violations["c_n_ca_loss_mean"],
            "connections_per_residue_loss_sum": connection_violations["per_residue_loss_sum"],
            "connections_per_residue_violation_mask": connection_violations["per_residue_violation_mask"],
            "clashes_mean_loss": between_residue_clashes["mean_loss"],
            "clashes_per_atom_loss_sum": between_residue_clashes["per_atom_loss_sum"],
            "clashes_per_atom_clash_mask": between_residue_clashes["per_atom_clash_mask"],
        },
        "within_residues": {
            "per_atom_loss_sum": residue_violations["per_atom_loss_sum"],
            "per_atom_violations": residue_violations["per_atom_violations"],
        },
        "total_per_residue_violations_mask": per_residue_violations_mask,
    }


def violation_loss(
    violations: dict[str, dict[str, torch.Tensor] | torch.Tensor],
    atom14_atom_exists: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Eq. 47: the three between-residue bond terms plus the clash losses per existing atom.

    Returns [*].
    """
    between = violations["between_residues"]
    within = violations["within_residues"]
    num_atoms = torch.sum(atom14_atom_exists, dim=(-1, -2))
    l_clash = torch.sum(between["clashes_per_atom_loss_sum"] + within["per_atom_loss_sum"], dim=(-1, -2))
    l_clash = l_clash / (eps + num_atoms)
    return (
        between["bonds_c_n_loss_mean"]
        + between["angles_ca_c_n_loss_mean"]
        + between["angles_c_n_ca_loss_mean"]
        + l_clash
    )
