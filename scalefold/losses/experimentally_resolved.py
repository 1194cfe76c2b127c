"""Experimentally-resolved loss (supplement 1.9.10, eq. 43).

Per-atom sigmoid cross entropy between the predicted "is this atom resolved" logits and the
ground-truth atom mask, averaged over the atoms that exist for each residue type; applied only to
structures whose resolution lies in ``[min_resolution, max_resolution]``.
"""

from __future__ import annotations

import torch

from scalefold.losses.common import resolution_filter, sigmoid_cross_entropy


def experimentally_resolved_loss(
    logits: torch.Tensor,
    atom37_atom_exists: torch.Tensor,
    all_atom_mask: torch.Tensor,
    resolution: torch.Tensor,
    min_resolution: float = 0.1,
    max_resolution: float = 3.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Args:
        logits:             [*, N_res, 37]
        atom37_atom_exists: [*, N_res, 37] atoms that exist for the residue type
        all_atom_mask:      [*, N_res, 37] atoms resolved in the experiment (the target)
        resolution:         [*]
    Returns:
        [*] loss.
    """
    errors = sigmoid_cross_entropy(logits, all_atom_mask)
    # [*, N_res]
    loss = torch.sum(errors * atom37_atom_exists, dim=-1)
    loss = loss / (eps + torch.sum(atom37_atom_exists, dim=(-1, -2)))[..., None]
    loss = torch.sum(loss, dim=-1)
    return loss * resolution_filter(resolution, min_resolution, max_resolution)
