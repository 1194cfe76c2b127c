"""Structure-quality metrics: lDDT and the CA-only lDDT that MLPerf evaluates.

lDDT (Mariani et al. 2013; AF2 supplement 1.9.6) scores, for every atom, the fraction of its
true neighbours within ``cutoff`` whose predicted distance is preserved within 0.5, 1, 2 and 4 Å
(averaged over the four thresholds). The MLPerf HPC OpenFold benchmark's quality metric is the
CA-only lDDT averaged over the chain (``validation_lddt_ca``), then over targets.

Numerics follow the MLPerf reference (``openfold/loss.py::lddt``) exactly, including where
``eps`` enters: a residue with no scored neighbour gets score ``eps / eps = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Index of the C-alpha atom in the atom37 layout (``residue_constants.atom_order["CA"]``).
CA_ATOM37_INDEX = 1
#: Distance-difference thresholds (Å) of the lDDT score.
LDDT_THRESHOLDS = (0.5, 1.0, 2.0, 4.0)
#: ``eps`` the reference's ``compute_validation_metrics`` passes for the evaluation metric.
VALIDATION_LDDT_EPS = 1e-8


def _distance_matrix(positions: torch.Tensor, eps: float) -> torch.Tensor:
    """[*, N, 3] -> [*, N, N] pairwise distances, ``sqrt(eps + |x_i - x_j|^2)``."""
    diff = positions[..., None, :] - positions[..., None, :, :]
    return torch.sqrt(eps + torch.sum(diff**2, dim=-1))


def lddt(
    all_atom_pred_pos: torch.Tensor,
    all_atom_positions: torch.Tensor,
    all_atom_mask: torch.Tensor,
    cutoff: float = 15.0,
    eps: float = 1e-10,
    per_residue: bool = True,
    thresholds: Sequence[float] = LDDT_THRESHOLDS,
) -> torch.Tensor:
    """lDDT of one point per residue.

    Args:
        all_atom_pred_pos:  [*, N, 3] predicted positions
        all_atom_positions: [*, N, 3] true positions
        all_atom_mask:      [*, N, 1] 1 where the true position is known
        cutoff: inclusion radius (Å) measured on the true structure.
        eps: regulariser of the distances and of the normalisation.
        per_residue: return [*, N] per-residue scores, else [*] over the whole chain.
    Returns:
        [*, N] or [*] scores in [0, 1].
    """
    n = all_atom_mask.shape[-2]
    dmat_true = _distance_matrix(all_atom_positions, eps)
    dmat_pred = _distance_matrix(all_atom_pred_pos, eps)

    # [*, N, N] pairs that are scored: true distance inside the cutoff, both atoms known, i != j.
    not_self = 1.0 - torch.eye(n, device=all_atom_mask.device, dtype=all_atom_mask.dtype)
    dists_to_score = (dmat_true < cutoff) * all_atom_mask * torch.swapdims(all_atom_mask, -2, -1) * not_self

    dist_l1 = torch.abs(dmat_true - dmat_pred)
    score = sum((dist_l1 < t).to(dist_l1.dtype) for t in thresholds)
    score = score * (1.0 / len(thresholds))

    dims = (-1,) if per_residue else (-2, -1)
    norm = 1.0 / (eps + torch.sum(dists_to_score, dim=dims))
    return norm * (eps + torch.sum(dists_to_score * score, dim=dims))


def lddt_ca(
    all_atom_pred_pos: torch.Tensor,
    all_atom_positions: torch.Tensor,
    all_atom_mask: torch.Tensor,
    cutoff: float = 15.0,
    eps: float = 1e-10,
    per_residue: bool = True,
) -> torch.Tensor:
    """lDDT of the C-alpha atoms.

    Args:
        all_atom_pred_pos:  [*, N_res, 37, 3] predicted atom37 positions
        all_atom_positions: [*, N_res, 37, 3] true atom37 positions
        all_atom_mask:      [*, N_res, 37] true atom mask
    Returns:
        [*, N_res] if ``per_residue`` else [*].
    """
    ca = CA_ATOM37_INDEX
    return lddt(
        all_atom_pred_pos[..., ca, :],
        all_atom_positions[..., ca, :],
        all_atom_mask[..., ca : ca + 1],  # [*, N_res, 1]
        cutoff=cutoff,
        eps=eps,
        per_residue=per_residue,
    )


def validation_lddt_ca(
    predicted_atom_positions: torch.Tensor,
    target_atom_positions: torch.Tensor,
    atom_mask: torch.Tensor,
    cutoff: float = 15.0,
) -> torch.Tensor:
    """The MLPerf evaluation metric: chain-level CA lDDT with the reference's validation ``eps``
    (``compute_validation_metrics(..., {"lddt_ca"})``). Shapes as :func:`lddt_ca`; returns [*]."""
    return lddt_ca(
        predicted_atom_positions,
        target_atom_positions,
        atom_mask,
        cutoff=cutoff,
        eps=VALIDATION_LDDT_EPS,
        per_residue=False,
    )
