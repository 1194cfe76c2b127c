"""Template transforms: hit ordering for training, residue re-indexing, template mask.

Supplementary 1.2.3 (template search) / 1.2.9: in training the top ``k`` (20) prefiltered hits
are shuffled before the first ``max_templates`` (4) that featurise successfully are kept; the
pipeline later picks a random prefix of a random permutation of those (see ``crop_pad``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from scalefold.data.transforms.msa import Features, hhblits_to_our_restypes

Hit = TypeVar("Hit")


def order_template_hits(
    hits: Sequence[Hit],
    sum_probs: Callable[[Hit], float],
    shuffle_top_k: int | None,
    seed: int | None,
) -> list[Hit]:
    """Order prefiltered hits for featurisation: best ``sum_probs`` first, top ``k`` shuffled.

    ``shuffle_top_k=None`` (validation) keeps the ranking. The shuffle is Python's
    ``random.Random(seed).shuffle``, as in the reference featuriser, so it is deterministic in
    ``seed``. The caller featurises hits in the returned order and stops after ``max_templates``.
    """
    ranked = sorted(hits, key=sum_probs, reverse=True)
    if shuffle_top_k is None:
        return ranked
    top, rest = ranked[:shuffle_top_k], ranked[shuffle_top_k:]
    random.Random(seed).shuffle(top)
    return top + rest


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
