"""Side-chain and backbone torsion-angle loss (supplement 1.9.1, Algorithm 27).

For every structure-module iteration, the squared chord distance between predicted and true
chi angles (as unit (sin, cos) vectors), taking for π-periodic chis (ASP chi2, GLU chi3, PHE/TYR
chi2) the better of the true angle and the angle + π; plus a small penalty keeping the
*unnormalised* predicted (sin, cos) pairs of all 7 torsions near unit length (eq. 28).
"""

from __future__ import annotations

import torch

from scalefold import residue_constants as rc
from scalefold.losses.common import device_table, masked_mean

#: The 7 predicted torsions are (omega, phi, psi, chi1..chi4); chi losses use the last 4.
FIRST_CHI_INDEX = 3


def chi_pi_periodic_mask(aatype: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[*, N_res] residue types -> [*, N_res, 4] 1.0 where that chi is π-periodic."""
    table = device_table("chi_pi_periodic", aatype.device, dtype, lambda: rc.chi_pi_periodic)  # [21, 4]
    return table[aatype]


def supervised_chi_loss(
    angles_sin_cos: torch.Tensor,
    unnormalized_angles_sin_cos: torch.Tensor,
    aatype: torch.Tensor,
    seq_mask: torch.Tensor,
    chi_mask: torch.Tensor,
    chi_angles_sin_cos: torch.Tensor,
    chi_weight: float = 0.5,
    angle_norm_weight: float = 0.01,
    eps: float = 1e-6,
    mean_eps: float = 1e-4,
) -> torch.Tensor:
    """Args:
        angles_sin_cos:              [*, N_iter, N_res, 7, 2] predicted (normalised) torsions
        unnormalized_angles_sin_cos: [*, N_iter, N_res, 7, 2] the same before normalisation
        aatype:                      [*, N_res]
        seq_mask:                    [*, N_res]
        chi_mask:                    [*, N_res, 4] which true chis exist
        chi_angles_sin_cos:          [*, N_res, 4, 2] true chis
        chi_weight, angle_norm_weight: weights of the two terms (eq. 28).
        eps: regulariser inside the norm of the unnormalised angles.
        mean_eps: regulariser of the masked means' denominators.
    Returns:
        [*] loss.
    """
    # [*, N_iter, N_res, 4, 2]
    pred_chi = angles_sin_cos[..., FIRST_CHI_INDEX:, :]
    # [*, 1, N_res, 4, 2]
    true_chi = chi_angles_sin_cos.unsqueeze(-4)
    # A π shift flips the sign of both sin and cos. [*, 1, N_res, 4, 1]
    pi_periodic = chi_pi_periodic_mask(aatype, angles_sin_cos.dtype)
    shift_sign = (1 - 2 * pi_periodic).unsqueeze(-1).unsqueeze(-4)
    true_chi_shifted = shift_sign * true_chi

    # [*, N_iter, N_res, 4]
    sq_chi_error = torch.sum((true_chi - pred_chi) ** 2, dim=-1)
    sq_chi_error_shifted = torch.sum((true_chi_shifted - pred_chi) ** 2, dim=-1)
    sq_chi_error = torch.minimum(sq_chi_error, sq_chi_error_shifted)
    sq_chi_loss = masked_mean(chi_mask.unsqueeze(-3), sq_chi_error, dim=(-1, -2, -3), eps=mean_eps)

    # Angle-norm penalty on all 7 torsions. [*, N_iter, N_res, 7]
    angle_norm = torch.sqrt(torch.sum(unnormalized_angles_sin_cos**2, dim=-1) + eps)
    norm_error = torch.abs(angle_norm - 1.0)
    angle_norm_loss = masked_mean(seq_mask[..., None, :, None], norm_error, dim=(-1, -2, -3), eps=mean_eps)
    return chi_weight * sq_chi_loss + angle_norm_weight * angle_norm_loss
