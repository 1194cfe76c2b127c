"""Renaming of symmetric ground-truth atoms (supplement 1.8.5, Algorithm 26).

Some side chains have pairs of atoms that are equivalent under a 180° flip (e.g. ASP OD1/OD2,
PHE CD1/CD2). For every residue we pick the naming of the ground truth (original or swapped)
whose intra-structure distances agree better with the prediction — measured against the
non-ambiguous atoms of the whole chain — and use it in all side-chain losses.
"""

from __future__ import annotations

import torch


def _atom14_distances(positions: torch.Tensor, eps: float) -> torch.Tensor:
    """[*, N_res, 14, 3] -> [*, N_res, 14, N_res, 14] all atom-pair distances."""
    diff = positions[..., :, None, :, None, :] - positions[..., None, :, None, :, :]
    # [*, N_res, N_res, 14, 14] ordering as in the reference: (res_i, res_j, atom_i, atom_j)
    return torch.sqrt(eps + torch.sum(diff**2, dim=-1))


def compute_renamed_ground_truth(
    batch: dict[str, torch.Tensor],
    atom14_pred_positions: torch.Tensor,
    eps: float = 1e-10,
) -> dict[str, torch.Tensor]:
    """Pick, per residue, the ground-truth naming closest to the prediction.

    Args:
        batch: with ``atom14_gt_positions`` [*, N_res, 14, 3], ``atom14_alt_gt_positions``
            [*, N_res, 14, 3], ``atom14_atom_is_ambiguous`` [*, N_res, 14], ``atom14_gt_exists``
            [*, N_res, 14] and ``atom14_alt_gt_exists`` [*, N_res, 14].
        atom14_pred_positions: [*, N_res, 14, 3] predicted positions (final structure-module
            iteration).
    Returns:
        ``alt_naming_is_better`` [*, N_res] (1.0 where the swapped naming is used),
        ``renamed_atom14_gt_positions`` [*, N_res, 14, 3], ``renamed_atom14_gt_exists`` [*, N_res, 14].
    """
    gt_positions = batch["atom14_gt_positions"]
    alt_gt_positions = batch["atom14_alt_gt_positions"]
    gt_exists = batch["atom14_gt_exists"]
    is_ambiguous = batch["atom14_atom_is_ambiguous"]

    # [*, N_res, N_res, 14, 14]
    pred_dists = _atom14_distances(atom14_pred_positions, eps)
    gt_dists = _atom14_distances(gt_positions, eps)
    alt_gt_dists = _atom14_distances(alt_gt_positions, eps)

    # Smooth |d_pred - d_gt| for both namings.
    dist_error = torch.sqrt(eps + (pred_dists - gt_dists) ** 2)
    alt_dist_error = torch.sqrt(eps + (pred_dists - alt_gt_dists) ** 2)

    # Pairs (ambiguous atom of residue i, non-ambiguous atom of residue j), both resolved.
    # [*, N_res, N_res, 14, 14]
    mask = (
        gt_exists[..., None, :, None]
        * is_ambiguous[..., None, :, None]
        * gt_exists[..., None, :, None, :]
        * (1.0 - is_ambiguous[..., None, :, None, :])
    )

    # [*, N_res]
    per_res_error = torch.sum(mask * dist_error, dim=(-1, -2, -3))
    alt_per_res_error = torch.sum(mask * alt_dist_error, dim=(-1, -2, -3))
    alt_naming_is_better = (alt_per_res_error < per_res_error).to(atom14_pred_positions.dtype)

    use_alt = alt_naming_is_better
    renamed_positions = (1.0 - use_alt[..., None, None]) * gt_positions + use_alt[..., None, None] * alt_gt_positions
    renamed_exists = (1.0 - use_alt[..., None]) * gt_exists + use_alt[..., None] * batch["atom14_alt_gt_exists"]
    return {
        "alt_naming_is_better": alt_naming_is_better,
        "renamed_atom14_gt_positions": renamed_positions,
        "renamed_atom14_gt_exists": renamed_exists,
    }
