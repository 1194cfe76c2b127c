"""Feature transforms of the training/validation pipeline, one concept per module.

* :mod:`.schema`    -- the batch interface (every feature's symbolic shape);
* :mod:`.geometry`  -- supervision features from aatype + atom37 (atom14, frames, torsions, pseudo-beta);
* :mod:`.msa`       -- MSA clustering, BERT masking, cluster profiles, ``msa_feat`` / ``target_feat``;
* :mod:`.templates` -- template residue re-indexing, template mask;
* :mod:`.crop_pad`  -- contiguous crop, template subsampling, padding to fixed shapes.

:mod:`scalefold.data.pipeline` composes them into a processed sample.
"""

from scalefold.data.transforms.crop_pad import (
    filter_features,
    pad_to_schema,
    random_crop_and_subsample_templates,
    schema_sizes,
)
from scalefold.data.transforms.geometry import (
    atom14_ground_truth,
    atom14_masks,
    backbone_frames,
    degenerate_torsion_frames,
    frames_from_3_points,
    pseudo_beta,
    rigid_group_frames,
    structure_features,
    template_structure_features,
    torsion_angles,
    torsion_atoms,
)
from scalefold.data.transforms.msa import (
    block_delete_msa,
    correct_msa_restypes,
    crop_extra_msa,
    make_generator,
    make_hhblits_profile,
    make_masked_msa,
    make_msa_feat,
    make_msa_mask,
    nearest_neighbor_clusters,
    sample_msa,
    summarize_clusters,
)
from scalefold.data.transforms.schema import FEATURE_SCHEMA, INTEGER_FEATURES
from scalefold.data.transforms.templates import fix_templates_aatype, make_template_mask

__all__ = [
    "FEATURE_SCHEMA",
    "INTEGER_FEATURES",
    "atom14_ground_truth",
    "atom14_masks",
    "backbone_frames",
    "block_delete_msa",
    "degenerate_torsion_frames",
    "correct_msa_restypes",
    "crop_extra_msa",
    "filter_features",
    "fix_templates_aatype",
    "frames_from_3_points",
    "make_generator",
    "make_hhblits_profile",
    "make_masked_msa",
    "make_msa_feat",
    "make_msa_mask",
    "make_template_mask",
    "nearest_neighbor_clusters",
    "pad_to_schema",
    "pseudo_beta",
    "random_crop_and_subsample_templates",
    "rigid_group_frames",
    "sample_msa",
    "schema_sizes",
    "structure_features",
    "summarize_clusters",
    "template_structure_features",
    "torsion_angles",
    "torsion_atoms",
]
