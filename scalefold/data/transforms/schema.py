"""The training-batch interface: every feature's symbolic shape (without batch and recycling dims).

This is the reference pipeline's ``FEATURE_SHAPES`` (MLPerf HPC OpenFold), restated from
``reference/feature_shapes.tsv``. Symbolic dimensions are the strings below; integers are fixed
sizes. The processed sample carries one more trailing dimension ``R = num_recycling_iters + 1``
and the loader adds a leading batch dimension ``B``.
"""

from __future__ import annotations

from typing import Union

N_RES = "N_res"
N_CLUST = "N_clust"
N_EXTRA_SEQ = "N_extra_seq"
N_TEMPL = "N_templ"

Dim = Union[str, int]

FEATURE_SCHEMA: dict[str, tuple[Dim, ...]] = {
    "aatype": (N_RES,),
    "all_atom_mask": (N_RES, 37),
    "all_atom_positions": (N_RES, 37, 3),
    "atom14_alt_gt_exists": (N_RES, 14),
    "atom14_alt_gt_positions": (N_RES, 14, 3),
    "atom14_atom_exists": (N_RES, 14),
    "atom14_atom_is_ambiguous": (N_RES, 14),
    "atom14_gt_exists": (N_RES, 14),
    "atom14_gt_positions": (N_RES, 14, 3),
    "atom37_atom_exists": (N_RES, 37),
    "backbone_rigid_mask": (N_RES,),
    "backbone_rigid_tensor": (N_RES, 4, 4),
    "bert_mask": (N_CLUST, N_RES),
    "chi_angles_sin_cos": (N_RES, 4, 2),
    "chi_mask": (N_RES, 4),
    "extra_deletion_value": (N_EXTRA_SEQ, N_RES),
    "extra_has_deletion": (N_EXTRA_SEQ, N_RES),
    "extra_msa": (N_EXTRA_SEQ, N_RES),
    "extra_msa_mask": (N_EXTRA_SEQ, N_RES),
    "extra_msa_row_mask": (N_EXTRA_SEQ,),
    "is_distillation": (),
    "msa_feat": (N_CLUST, N_RES, 49),
    "msa_mask": (N_CLUST, N_RES),
    "msa_row_mask": (N_CLUST,),
    "pseudo_beta": (N_RES, 3),
    "pseudo_beta_mask": (N_RES,),
    "residue_index": (N_RES,),
    "residx_atom14_to_atom37": (N_RES, 14),
    "residx_atom37_to_atom14": (N_RES, 37),
    "resolution": (),
    "rigidgroups_alt_gt_frames": (N_RES, 8, 4, 4),
    "rigidgroups_group_exists": (N_RES, 8),
    "rigidgroups_group_is_ambiguous": (N_RES, 8),
    "rigidgroups_gt_exists": (N_RES, 8),
    "rigidgroups_gt_frames": (N_RES, 8, 4, 4),
    "seq_length": (),
    "seq_mask": (N_RES,),
    "target_feat": (N_RES, 22),
    "template_aatype": (N_TEMPL, N_RES),
    "template_all_atom_mask": (N_TEMPL, N_RES, 37),
    "template_all_atom_positions": (N_TEMPL, N_RES, 37, 3),
    "template_alt_torsion_angles_sin_cos": (N_TEMPL, N_RES, 7, 2),
    "template_mask": (N_TEMPL,),
    "template_pseudo_beta": (N_TEMPL, N_RES, 3),
    "template_pseudo_beta_mask": (N_TEMPL, N_RES),
    "template_sum_probs": (N_TEMPL, 1),
    "template_torsion_angles_mask": (N_TEMPL, N_RES, 7),
    "template_torsion_angles_sin_cos": (N_TEMPL, N_RES, 7, 2),
    "true_msa": (N_CLUST, N_RES),
    "use_clamped_fape": (),
}

#: Features stored as int64; every other feature is float32.
INTEGER_FEATURES = frozenset(
    {
        "aatype",
        "extra_msa",
        "residue_index",
        "residx_atom14_to_atom37",
        "residx_atom37_to_atom14",
        "seq_length",
        "template_aatype",
        "true_msa",
    }
)


def concrete_shape(key: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """Shape of feature ``key`` with symbolic dims resolved through ``sizes``."""
    return tuple(sizes[d] if isinstance(d, str) else d for d in FEATURE_SCHEMA[key])
