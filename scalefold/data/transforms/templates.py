"""Template transforms: residue re-indexing and template mask.

Which hits become templates (top-20 shuffle, first 4 usable) is decided when the raw features
are built (:func:`scalefold.data.templates.order_prefiltered_hits`); the pipeline later picks a
random prefix of a random permutation of those (see ``crop_pad``).
"""

from __future__ import annotations

import torch

from scalefold.data.transforms.msa import Features, hhblits_to_our_restypes


def fix_templates_aatype(feats: Features) -> Features:
    """``template_aatype``: one-hot [N_templ, N_res, 22] in HHblits order -> indices in our order.

    Index tensors (already [N_templ, N_res]) are taken as HHblits indices as well.
    """
    aatype = feats["template_aatype"]
    if aatype.shape[0] > 0:
        if aatype.dim() == 3:
            aatype = torch.argmax(aatype, dim=-1)
        feats["template_aatype"] = hhblits_to_our_restypes(aatype)
    else:
        feats["template_aatype"] = aatype.reshape(0, aatype.shape[1]).long()
    return feats


def make_template_mask(feats: Features) -> Features:
    """``template_mask`` [N_templ]: ones for the templates present, zero-padded later."""
    num_templates = feats["template_aatype"].shape[0]
    feats["template_mask"] = torch.ones(num_templates, dtype=torch.float32, device=feats["template_aatype"].device)
    return feats
