"""Contiguous crop, template subsampling and zero-padding to the fixed training shapes.

Supplementary 1.2.8 (residue cropping) and 1.2.9; the MLPerf reference crops one contiguous
window (no spatial cropping) and uses the same crop for every recycling iteration.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scalefold.data.transforms.msa import Features
from scalefold.data.transforms.schema import FEATURE_SCHEMA, N_CLUST, N_EXTRA_SEQ, N_RES, N_TEMPL


def filter_features(feats: Features) -> Features:
    """Keep only the features of the batch interface (``FEATURE_SCHEMA``)."""
    return {k: v for k, v in feats.items() if k in FEATURE_SCHEMA}


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """Uniform integer in ``[low, high]`` (inclusive)."""
    return int(torch.randint(low=low, high=high + 1, size=(1,), generator=generator)[0])


def random_crop_and_subsample_templates(
    feats: Features,
    crop_size: int,
    max_templates: int,
    subsample_templates: bool,
    generator: torch.Generator,
) -> Features:
    """Crop every ``N_res`` dim to one random window of ``min(L, crop_size)`` residues.

    With ``subsample_templates`` the templates are randomly permuted and a random number of
    them dropped (start index uniform in ``[0, N_templ]``, as the reference); at most
    ``max_templates`` remain. Draw order: template start, template permutation, crop start.
    ``seq_length`` becomes the cropped length.
    """
    seq_length = int(feats["seq_length"])
    num_res_crop = min(seq_length, crop_size)
    num_templates = feats["template_mask"].shape[-1] if "template_mask" in feats else 0
    subsample_templates = subsample_templates and num_templates > 0

    if subsample_templates:
        templ_start = _randint(0, num_templates, generator)
        templ_order = torch.randperm(num_templates, generator=generator)
    else:
        templ_start = 0
    num_templ_crop = min(num_templates - templ_start, max_templates)
    res_start = _randint(0, seq_length - num_res_crop, generator)

    for key, tensor in feats.items():
        schema = FEATURE_SCHEMA[key]
        is_template = key.startswith("template")
        if not is_template and N_RES not in schema:
            continue
        if is_template and subsample_templates:
            tensor = tensor[templ_order.to(tensor.device)]
        slices = []
        for dim, size in zip(schema, tensor.shape):
            if dim == N_TEMPL and is_template:
                slices.append(slice(templ_start, templ_start + num_templ_crop))
            elif dim == N_RES:
                slices.append(slice(res_start, res_start + num_res_crop))
            else:
                slices.append(slice(0, size))
        feats[key] = tensor[tuple(slices)]

    feats["seq_length"] = torch.full_like(feats["seq_length"], num_res_crop)
    return feats


def pad_to_schema(feats: Features, sizes: dict[str, int]) -> Features:
    """Zero-pad every feature to its fixed shape; ``sizes`` maps symbolic dims to lengths."""
    for key, tensor in feats.items():
        schema = FEATURE_SCHEMA[key]
        if len(schema) != tensor.dim():
            raise ValueError(f"feature {key!r} has shape {tuple(tensor.shape)}, schema {schema}")
        padding = []
        for dim, size in reversed(list(zip(schema, tensor.shape))):
            target = sizes.get(dim, size) if isinstance(dim, str) else size
            if target < size:
                raise ValueError(f"feature {key!r}: dim {dim} has {size} > {target}")
            padding += [0, target - size]
        if any(padding):
            feats[key] = F.pad(tensor, padding)
    return feats


def schema_sizes(num_res: int, num_clusters: int, num_extra: int, num_templates: int) -> dict[str, int]:
    """The ``sizes`` dict for :func:`pad_to_schema`."""
    return {N_RES: num_res, N_CLUST: num_clusters, N_EXTRA_SEQ: num_extra, N_TEMPL: num_templates}
