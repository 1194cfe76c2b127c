"""Distogram loss (supplement 1.9.8, eq. 41).

Cross entropy between the predicted pair distogram and the one-hot binned true Cβ–Cβ distance
(Cα for glycine: ``pseudo_beta``), averaged over residue pairs where both pseudo-β atoms exist.
"""

from __future__ import annotations

import torch

from scalefold.losses.common import one_hot_cross_entropy


def distogram_bin_index(pseudo_beta: torch.Tensor, min_bin: float, max_bin: float, num_bins: int) -> torch.Tensor:
    """Bin index of every pairwise distance: the number of the ``num_bins - 1`` evenly spaced
    boundaries in ``[min_bin, max_bin]`` that the distance exceeds (compared in squared form).

    Args:
        pseudo_beta: [*, N_res, 3]
    Returns:
        [*, N_res, N_res] int64 in ``[0, num_bins - 1]``.
    """
    boundaries = torch.linspace(min_bin, max_bin, num_bins - 1, device=pseudo_beta.device)
    boundaries = boundaries**2
    # [*, N_res, N_res, 1]
    sq_dists = torch.sum((pseudo_beta[..., None, :] - pseudo_beta[..., None, :, :]) ** 2, dim=-1, keepdim=True)
    return torch.sum(sq_dists > boundaries, dim=-1)


def distogram_loss(
    logits: torch.Tensor,
    pseudo_beta: torch.Tensor,
    pseudo_beta_mask: torch.Tensor,
    min_bin: float = 2.3125,
    max_bin: float = 21.6875,
    num_bins: int = 64,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Args:
        logits:           [*, N_res, N_res, num_bins]
        pseudo_beta:      [*, N_res, 3]
        pseudo_beta_mask: [*, N_res]
    Returns:
        [*] loss.
    """
    true_bins = distogram_bin_index(pseudo_beta, min_bin, max_bin, num_bins)
    # [*, N_res, N_res]
    errors = one_hot_cross_entropy(logits, true_bins)
    square_mask = pseudo_beta_mask[..., None] * pseudo_beta_mask[..., None, :]

    # Mean over pairs, reduced one axis at a time (fp16-friendly, as the reference).
    denom = eps + torch.sum(square_mask, dim=(-1, -2))
    mean = torch.sum(errors * square_mask, dim=-1)
    mean = mean / denom[..., None]
    return torch.sum(mean, dim=-1)
