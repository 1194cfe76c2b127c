"""The AlphaFold2 training loss (supplement 1.9, eq. 7), as in the MLPerf HPC OpenFold reference.

``L = 1.0 L_FAPE + 1.0 L_chi(+0.01 angle norm) + 0.3 L_dist + 2.0 L_msa + 0.01 L_pLDDT
+ 0.0 L_exp_resolved + 0.0 L_viol`` (weights from the loss config), multiplied per sample by
``sqrt(min(seq_length, crop_size))`` ("to decrease the relative importance of short sequences").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from scalefold.losses.chi import supervised_chi_loss
from scalefold.losses.distogram import distogram_loss
from scalefold.losses.experimentally_resolved import experimentally_resolved_loss
from scalefold.losses.fape import fape_loss
from scalefold.losses.masked_msa import masked_msa_loss
from scalefold.losses.plddt import plddt_loss
from scalefold.losses.renaming import compute_renamed_ground_truth
from scalefold.losses.tm import tm_loss
from scalefold.losses.violations import find_structural_violations, prepare_dists_bounds, violation_loss

#: Loss terms in the order they are summed (and reported).
LOSS_TERMS = (
    "fape",
    "supervised_chi",
    "distogram",
    "masked_msa",
    "plddt_loss",
    "experimentally_resolved",
    "violation",
    "tm",
)
#: Config section of each term.
_SECTION = {
    "fape": "fape_loss_config",
    "supervised_chi": "supervised_chi_loss_config",
    "distogram": "distogram_loss_config",
    "masked_msa": "masked_msa_loss_config",
    "plddt_loss": "plddt_loss_config",
    "experimentally_resolved": "experimentally_resolved_loss_config",
    "violation": "violation_loss_config",
    "tm": "tm_loss_config",
}


def _as_dict(cfg: Any) -> dict[str, Any]:
    """A config section (mapping, dataclass or plain object) as a dict."""
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return dict(vars(cfg))


def last_recycling_slice(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``t[..., -1]`` for every tensor of a batch with the trailing recycling dimension.

    The loss supervises only the last recycling iteration (the one run with gradients).
    """
    return {k: (v[..., -1] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


class AlphaFoldLoss(nn.Module):
    """AlphaFold2 loss. ``loss, terms = loss_fn(outputs, batch)``.

    Args:
        loss_config: mapping (or dataclass) with the sections ``fape_loss_config``,
            ``supervised_chi_loss_config``, ``distogram_loss_config``, ``masked_msa_loss_config``,
            ``plddt_loss_config``, ``experimentally_resolved_loss_config``,
            ``violation_loss_config`` and ``tm_loss_config`` (keys as in the reference config).
        crop_size: ``N`` of the ``sqrt(min(seq_length, N))`` scale. ``None`` (the reference's
            behaviour) takes the batch's residue dimension, which is the crop size because
            training batches are padded to it.
        batch_has_recycling_dim: the batch carries the trailing recycling dimension and the
            loss slices ``[..., -1]`` itself (the trainer's batch); ``False`` for a sliced batch.

    ``forward(outputs, batch)`` returns ``(loss, terms)``: ``loss`` is the batch mean of the
    scaled weighted total (the tensor to back-propagate); ``terms`` holds detached batch means of
    every unweighted term, ``weighted_total_loss``, ``scaled_weighted_total_loss`` and
    ``loss_backpropagated``.
    """

    def __init__(
        self,
        loss_config: Any,
        crop_size: int | None = None,
        batch_has_recycling_dim: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = {term: _as_dict(_get(loss_config, section)) for term, section in _SECTION.items()}
        self.tm_enabled = bool(self.cfg["tm"].get("enabled", False))
        self.crop_size = crop_size
        self.batch_has_recycling_dim = batch_has_recycling_dim
        viol_cfg = self.cfg["violation"]
        if "clash_overlap_tolerance" in viol_cfg and "violation_tolerance_factor" in viol_cfg:
            # the violation term's constant tables built here, eagerly: never traced into a compiled loss
            prepare_dists_bounds(viol_cfg["clash_overlap_tolerance"], viol_cfg["violation_tolerance_factor"])

    def weight(self, term: str) -> float:
        return float(self.cfg[term]["weight"])

    def compute_terms(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Unweighted per-sample loss terms ``[B]`` for an already-sliced batch."""
        batch, violations = self.renamed_batch_and_violations(outputs, batch)
        terms = self.structure_terms(outputs, batch)
        terms.update(self.head_terms(outputs, batch))
        terms["violation"] = violation_loss(
            violations, atom14_atom_exists=batch["atom14_atom_exists"], eps=self.cfg["violation"]["eps"]
        )
        if self.tm_enabled:
            terms["tm"] = self.tm_term(outputs, batch)
        return terms

    def renamed_batch_and_violations(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(batch, violations)``: a copy of ``batch`` with the renamed ground truth of the
        symmetric side chains (supplement 1.8.5, Alg. 26) added if missing, and the structural
        violations of the final structure-module iteration (supplement 1.9.11; the model's own
        ``violations`` output when present)."""
        batch = dict(batch)
        # Final structure-module iteration. [B, N_res, 14, 3]
        atom14_pred_positions = outputs["sm_positions"][:, -1]
        viol_cfg = self.cfg["violation"]
        violations = outputs.get("violations")
        if violations is None:
            violations = find_structural_violations(
                batch=batch,
                atom14_pred_positions=atom14_pred_positions,
                violation_tolerance_factor=viol_cfg["violation_tolerance_factor"],
                clash_overlap_tolerance=viol_cfg["clash_overlap_tolerance"],
            )
        if "renamed_atom14_gt_positions" not in batch:
            batch.update(compute_renamed_ground_truth(batch, atom14_pred_positions))
        return batch, violations

    def structure_terms(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The structure-module terms: ``fape`` (backbone + side-chain FAPE, supplement
        1.9.2-1.9.3, Alg. 28) and ``supervised_chi`` (torsion-angle loss with the angle-norm term, 1.9.1, Alg. 27)."""
        terms: dict[str, torch.Tensor] = {}
        c = self.cfg["fape"]
        terms["fape"] = fape_loss(
            outputs,
            batch,
            backbone_clamp_distance=c["backbone_clamp_distance"],
            backbone_loss_unit_distance=c["backbone_loss_unit_distance"],
            backbone_weight=c["backbone_weight"],
            sidechain_clamp_distance=c["sidechain_clamp_distance"],
            sidechain_length_scale=c["sidechain_length_scale"],
            sidechain_weight=c["sidechain_weight"],
            eps=c["eps"],
        )
        c = self.cfg["supervised_chi"]
        terms["supervised_chi"] = supervised_chi_loss(
            angles_sin_cos=outputs["sm_angles"],
            unnormalized_angles_sin_cos=outputs["sm_unnormalized_angles"],
            aatype=batch["aatype"],
            seq_mask=batch["seq_mask"],
            chi_mask=batch["chi_mask"],
            chi_angles_sin_cos=batch["chi_angles_sin_cos"],
            chi_weight=c["chi_weight"],
            angle_norm_weight=c["angle_norm_weight"],
            eps=c["eps"],
        )
        return terms

    def head_terms(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The auxiliary-head terms: ``distogram`` (supplement 1.9.8), ``masked_msa`` (1.9.9),
        ``plddt_loss`` (1.9.6) and ``experimentally_resolved`` (1.9.10)."""
        cfg = self.cfg
        terms: dict[str, torch.Tensor] = {}
        c = cfg["distogram"]
        terms["distogram"] = distogram_loss(
            logits=outputs["distogram_logits"],
            pseudo_beta=batch["pseudo_beta"],
            pseudo_beta_mask=batch["pseudo_beta_mask"],
            min_bin=c["min_bin"],
            max_bin=c["max_bin"],
            num_bins=c["num_bins"],
            eps=c["eps"],
        )
        terms["masked_msa"] = masked_msa_loss(
            logits=outputs["masked_msa_logits"],
            true_msa=batch["true_msa"],
            bert_mask=batch["bert_mask"],
            eps=cfg["masked_msa"]["eps"],
        )
        c = cfg["plddt_loss"]
        terms["plddt_loss"] = plddt_loss(
            logits=outputs["lddt_logits"],
            all_atom_pred_pos=outputs["final_atom_positions"],
            all_atom_positions=batch["all_atom_positions"],
            all_atom_mask=batch["all_atom_mask"],
            resolution=batch["resolution"],
            cutoff=c["cutoff"],
            num_bins=c["num_bins"],
            min_resolution=c["min_resolution"],
            max_resolution=c["max_resolution"],
            eps=c["eps"],
        )
        c = cfg["experimentally_resolved"]
        terms["experimentally_resolved"] = experimentally_resolved_loss(
            logits=outputs["experimentally_resolved_logits"],
            atom37_atom_exists=batch["atom37_atom_exists"],
            all_atom_mask=batch["all_atom_mask"],
            resolution=batch["resolution"],
            min_resolution=c["min_resolution"],
            max_resolution=c["max_resolution"],
            eps=c["eps"],
        )
        return terms

    def tm_term(self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The predicted-TM-score head's loss (supplement 1.9.7), ``[B]``."""
        c = self.cfg["tm"]
        return tm_loss(
            logits=outputs["tm_logits"],
            final_affine_tensor=outputs["final_affine_tensor"],
            backbone_rigid_tensor=batch["backbone_rigid_tensor"],
            backbone_rigid_mask=batch["backbone_rigid_mask"],
            resolution=batch["resolution"],
            max_bin=c["max_bin"],
            num_bins=c["num_bins"],
            min_resolution=c["min_resolution"],
            max_resolution=c["max_resolution"],
            eps=c["eps"],
        )

    def length_scale(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``sqrt(min(seq_length, crop_size))`` per sample, ``[B]``.

        Computed in float32 like the reference (``seq_length.float()``), so float64 runs match
        it bitwise.
        """
        seq_length = batch["seq_length"].to(torch.float32)
        crop_size = self.crop_size if self.crop_size is not None else batch["aatype"].shape[-1]
        return torch.sqrt(torch.minimum(seq_length, torch.full_like(seq_length, float(crop_size))))

    def forward(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.batch_has_recycling_dim:
            batch = last_recycling_slice(batch)
        batch_size = batch["aatype"].shape[0]

        terms = self.compute_terms(outputs, batch)
        weighted: dict[str, torch.Tensor] = {}
        for name, value in terms.items():
            if value.shape != (batch_size,):
                raise ValueError(f"loss term {name} has shape {tuple(value.shape)}, expected ({batch_size},)")
            w = value * self.weight(name)
            # As the reference: drop a non-finite term from this step rather than poison it -- decided on the
            # device (no host read inside the training step; the step's report carries the raw term, so the
            # loop sees it and skips the step). Finite terms pass through unchanged, gradients included.
            weighted[name] = torch.where(torch.isfinite(w).all(), w, torch.zeros_like(w))

        weighted_total_loss = sum(weighted.values())
        scaled_weighted_total_loss = self.length_scale(batch) * weighted_total_loss
        loss = scaled_weighted_total_loss.mean()

        report = {name: value.detach().clone().mean() for name, value in terms.items()}
        report["weighted_total_loss"] = weighted_total_loss.detach().clone().mean()
        report["scaled_weighted_total_loss"] = scaled_weighted_total_loss.detach().clone().mean()
        report["loss_backpropagated"] = loss.detach().clone()
        return loss, report


def _get(cfg: Any, key: str) -> Any:
    return cfg[key] if isinstance(cfg, Mapping) else getattr(cfg, key)
