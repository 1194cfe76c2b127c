"""AlphaFold2 losses (supplement section 1.9), numerically equal to the MLPerf HPC reference.

One concept per module: FAPE (``fape``), torsion angles (``chi``), distogram, masked MSA, pLDDT,
experimentally resolved, structural violations, TM (predicted aligned error), ground-truth
renaming, and ``AlphaFoldLoss`` combining them.
"""

from scalefold.losses.alphafold_loss import LOSS_TERMS, AlphaFoldLoss, last_recycling_slice
from scalefold.losses.chi import supervised_chi_loss
from scalefold.losses.distogram import distogram_loss
from scalefold.losses.experimentally_resolved import experimentally_resolved_loss
from scalefold.losses.fape import backbone_fape_loss, compute_fape, fape_loss, sidechain_fape_loss
from scalefold.losses.masked_msa import masked_msa_loss
from scalefold.losses.plddt import plddt_loss
from scalefold.losses.renaming import compute_renamed_ground_truth
from scalefold.losses.tm import tm_loss
from scalefold.losses.violations import find_structural_violations, violation_loss

__all__ = [
    "LOSS_TERMS",
    "AlphaFoldLoss",
    "last_recycling_slice",
    "backbone_fape_loss",
    "compute_fape",
    "compute_renamed_ground_truth",
    "distogram_loss",
    "experimentally_resolved_loss",
    "fape_loss",
    "find_structural_violations",
    "masked_msa_loss",
    "plddt_loss",
    "sidechain_fape_loss",
    "supervised_chi_loss",
    "tm_loss",
    "violation_loss",
]
