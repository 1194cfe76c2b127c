"""Masked MSA (BERT) loss (supplement 1.9.9, eq. 42).

Cross entropy between the predicted residue distribution at every masked MSA position and the
true MSA token, averaged over the masked positions.
"""

from __future__ import annotations

import torch

from scalefold.losses.common import one_hot_cross_entropy


def masked_msa_loss(
    logits: torch.Tensor,
    true_msa: torch.Tensor,
    bert_mask: torch.Tensor,
    eps: float = 1e-8,
    fp16_scale: float = 0.5,
) -> torch.Tensor:
    """Args:
        logits:    [*, N_seq, N_res, 23] predicted token distribution
        true_msa:  [*, N_seq, N_res] int64 true tokens
        bert_mask: [*, N_seq, N_res] 1 where the token was masked/replaced
        fp16_scale: the reference divides by ``sum(fp16_scale * mask)`` and multiplies back, to
            keep the denominator in fp16 range; kept so the result matches to rounding.
    Returns:
        [*] loss.
    """
    # [*, N_seq, N_res]
    errors = one_hot_cross_entropy(logits, true_msa)
    loss = torch.sum(errors * bert_mask, dim=-1)
    denom = eps + torch.sum(fp16_scale * bert_mask, dim=(-1, -2))
    loss = loss / denom[..., None]
    loss = torch.sum(loss, dim=-1)
    return loss * fp16_scale
