"""Auxiliary heads (Supplementary 1.9.6-1.9.10): pLDDT, distogram, masked MSA,
experimentally resolved and the optional predicted-TM / aligned-error head.

Output keys (as the reference): ``lddt_logits``, ``plddt``, ``distogram_logits``,
``masked_msa_logits``, ``experimentally_resolved_logits`` and, with the TM head,
``tm_logits``, ``predicted_tm_score``, ``aligned_confidence_probs``,
``predicted_aligned_error``, ``max_predicted_aligned_error``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from scalefold.model.config import (
    AuxiliaryHeadsConfig,
    DistogramHeadConfig,
    ExperimentallyResolvedHeadConfig,
    MaskedMSAHeadConfig,
    PerResidueLDDTCaPredictorConfig,
    TMScoreHeadConfig,
)
from scalefold.model.primitives import LayerNorm, Linear

PLDDT_SCALE = 100.0
TM_MIN_NUM_RES = 19  # d0 of the TM-score is clipped at N = 19 residues


class PerResidueLDDTCaPredictor(nn.Module):
    """Algorithm 29: per-residue lDDT-Ca logits from the structure module's single repr."""

    def __init__(self, cfg: PerResidueLDDTCaPredictorConfig) -> None:
        super().__init__()
        self.layer_norm = LayerNorm(cfg.c_s)
        self.linear_1 = Linear(cfg.c_s, cfg.c_hidden, init="relu")
        self.linear_2 = Linear(cfg.c_hidden, cfg.c_hidden, init="relu")
        self.linear_3 = Linear(cfg.c_hidden, cfg.num_bins, init="final")

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """``[*, N_res, c_s]`` -> ``[*, N_res, num_bins]``."""
        s = self.layer_norm(s)
        s = torch.relu(self.linear_1(s))
        s = torch.relu(self.linear_2(s))
        return self.linear_3(s)


class DistogramHead(nn.Module):
    """Section 1.9.8: symmetrised distogram logits from the pair representation."""

    def __init__(self, cfg: DistogramHeadConfig) -> None:
        super().__init__()
        self.linear = Linear(cfg.c_z, cfg.num_bins, init="final")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``[*, N_res, N_res, c_z]`` -> ``[*, N_res, N_res, num_bins]``."""
        if _autocast_fp16(z):  # the symmetrised sum can overflow in fp16
            with torch.autocast(device_type=z.device.type, enabled=False):
                return self._logits(z.float())
        return self._logits(z)

    def _logits(self, z: torch.Tensor) -> torch.Tensor:
        logits = self.linear(z)
        return logits + logits.transpose(-2, -3)


class MaskedMSAHead(nn.Module):
    """Section 1.9.9: logits over the 23 MSA classes for every cluster row."""

    def __init__(self, cfg: MaskedMSAHeadConfig) -> None:
        super().__init__()
        self.linear = Linear(cfg.c_m, cfg.c_out, init="final")

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        """``[*, N_clust, N_res, c_m]`` -> ``[*, N_clust, N_res, c_out]``."""
        return self.linear(m)


class ExperimentallyResolvedHead(nn.Module):
    """Section 1.9.10: per-atom (atom37) logits of being experimentally resolved."""

    def __init__(self, cfg: ExperimentallyResolvedHeadConfig) -> None:
        super().__init__()
        self.linear = Linear(cfg.c_s, cfg.c_out, init="final")

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """``[*, N_res, c_s]`` -> ``[*, N_res, c_out]``."""
        return self.linear(s)


class TMScoreHead(nn.Module):
    """Section 1.9.7: aligned-error logits for the predicted TM-score."""

    def __init__(self, cfg: TMScoreHeadConfig) -> None:
        super().__init__()
        self.num_bins = cfg.num_bins
        self.max_bin = cfg.max_bin
        self.linear = Linear(cfg.c_z, cfg.num_bins, init="final")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``[*, N_res, N_res, c_z]`` -> ``[*, N_res, N_res, num_bins]``."""
        return self.linear(z)


class AuxiliaryHeads(nn.Module):
    """All auxiliary heads. Constructed as ``AuxiliaryHeads(config.auxiliary_heads_config)``."""

    def __init__(self, cfg: AuxiliaryHeadsConfig) -> None:
        super().__init__()
        self.plddt = PerResidueLDDTCaPredictor(cfg.per_residue_lddt_ca_predictor_config)
        self.distogram = DistogramHead(cfg.distogram_head_config)
        self.masked_msa = MaskedMSAHead(cfg.masked_msa_head_config)
        self.experimentally_resolved = ExperimentallyResolvedHead(cfg.experimentally_resolved_head_config)
        self.tm_score_head_enabled = cfg.tm_score_head_enabled
        if cfg.tm_score_head_enabled:
            self.tm = TMScoreHead(cfg.tm_score_head_config)

    def forward(self, outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reads ``sm_single``, ``pair``, ``msa`` and ``single`` from the trunk outputs."""
        aux: dict[str, torch.Tensor] = {}
        aux["lddt_logits"] = self.plddt(outputs["sm_single"])
        aux["plddt"] = compute_plddt(aux["lddt_logits"])
        aux["distogram_logits"] = self.distogram(outputs["pair"])
        aux["masked_msa_logits"] = self.masked_msa(outputs["msa"])
        aux["experimentally_resolved_logits"] = self.experimentally_resolved(outputs["single"])
        if self.tm_score_head_enabled:
            aux["tm_logits"] = self.tm(outputs["pair"])
            aux["predicted_tm_score"] = compute_tm(aux["tm_logits"], max_bin=self.tm.max_bin, num_bins=self.tm.num_bins)
            aux.update(
                compute_predicted_aligned_error(aux["tm_logits"], max_bin=self.tm.max_bin, num_bins=self.tm.num_bins)
            )
        return aux


# --------------------------------------------------------------------------------------------
# Confidence metrics from logits
# --------------------------------------------------------------------------------------------
# Bin centres / edges are built in the default dtype (float32) and promoted, exactly as the
# reference does, so float64 runs agree with it to rounding.


def compute_plddt(logits: torch.Tensor) -> torch.Tensor:
    """Expected per-residue lDDT-Ca (x100) from ``[*, N_res, num_bins]`` logits."""
    num_bins = logits.shape[-1]
    width = 1.0 / num_bins
    centres = torch.arange(0.5 * width, 1.0, width, device=logits.device)
    probs = torch.softmax(logits, dim=-1)
    return torch.sum(probs * centres, dim=-1) * PLDDT_SCALE


def _bin_centres(edges: torch.Tensor) -> torch.Tensor:
    step = edges[1] - edges[0]
    centres = edges + step / 2
    return torch.cat([centres, (centres[-1] + step).unsqueeze(-1)], dim=0)


def compute_predicted_aligned_error(
    logits: torch.Tensor, max_bin: int = 31, num_bins: int = 64
) -> dict[str, torch.Tensor]:
    """Aligned-error probabilities, expected aligned error ``[*, N_res, N_res]`` and its maximum."""
    edges = torch.linspace(0, max_bin, steps=num_bins - 1, device=logits.device)
    centres = _bin_centres(edges)
    probs = torch.softmax(logits, dim=-1)
    return {
        "aligned_confidence_probs": probs,
        "predicted_aligned_error": torch.sum(probs * centres, dim=-1),
        "max_predicted_aligned_error": centres[-1],
    }


def compute_tm(
    logits: torch.Tensor,
    residue_weights: torch.Tensor | None = None,
    max_bin: int = 31,
    num_bins: int = 64,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Predicted TM-score (Supplementary 1.9.7, eq. 40): the best per-alignment score."""
    if residue_weights is None:
        residue_weights = logits.new_ones(logits.shape[-2])
    edges = torch.linspace(0, max_bin, steps=num_bins - 1, device=logits.device)
    centres = _bin_centres(edges)
    n = max(logits.shape[-2], TM_MIN_NUM_RES)
    d0 = 1.24 * (n - 15) ** (1.0 / 3) - 1.8
    probs = torch.softmax(logits, dim=-1)
    tm_per_bin = 1.0 / (1 + centres**2 / d0**2)
    predicted_tm_term = torch.sum(probs * tm_per_bin, dim=-1)
    normed_weights = residue_weights / (eps + residue_weights.sum())
    per_alignment = torch.sum(predicted_tm_term * normed_weights, dim=-1)
    weighted = per_alignment * residue_weights
    argmax = (weighted == torch.max(weighted)).nonzero()[0]
    return per_alignment[tuple(argmax)]


def _autocast_fp16(x: torch.Tensor) -> bool:
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return False
    return torch.get_autocast_dtype(device) == torch.float16


__all__ = [
    "AuxiliaryHeads",
    "PerResidueLDDTCaPredictor",
    "DistogramHead",
    "MaskedMSAHead",
    "ExperimentallyResolvedHead",
    "TMScoreHead",
    "compute_plddt",
    "compute_tm",
    "compute_predicted_aligned_error",
]
