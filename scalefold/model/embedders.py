"""Input, recycling, template and extra-MSA embedders (Supplementary 1.5, 1.7, 1.10).

Parameter names follow the MLPerf reference model (``linear_tf_z_i``, ``layer_norm_m``, ...), so
reference checkpoints load strictly. The features these modules consume are built in
:mod:`scalefold.model.features`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from scalefold.model.config import (
    ExtraMSAEmbedderConfig,
    InputEmbedderConfig,
    RecyclingEmbedderConfig,
    TemplateAngleEmbedderConfig,
    TemplatePairEmbedderConfig,
)
from scalefold.model.primitives import LayerNorm, Linear


class InputEmbedder(nn.Module):
    """Algorithm 3 (embeddings for initial representations) with Algorithm 4 (relpos).

    Args:
        tf_dim: channels of ``target_feat`` (22).
        msa_dim: channels of ``msa_feat`` (49).
        c_z: pair representation channels.
        c_m: MSA representation channels.
        relpos_k: relative positions are clipped to ``[-relpos_k, relpos_k]``.
    """

    def __init__(self, cfg: InputEmbedderConfig) -> None:
        super().__init__()
        self.relpos_k = cfg.relpos_k
        self.num_relpos_bins = 2 * cfg.relpos_k + 1
        self.linear_tf_z_i = Linear(cfg.tf_dim, cfg.c_z)
        self.linear_tf_z_j = Linear(cfg.tf_dim, cfg.c_z)
        self.linear_tf_m = Linear(cfg.tf_dim, cfg.c_m)
        self.linear_msa_m = Linear(cfg.msa_dim, cfg.c_m)
        self.linear_relpos = Linear(self.num_relpos_bins, cfg.c_z)

    def relpos(self, residue_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Algorithm 4: one-hot of the clipped offset ``i - j`` -> ``[*, N_res, N_res, c_z]``.

        Offsets are integers, so the nearest-bin one-hot of Algorithm 5 is exactly the one-hot of
        ``clip(i - j, -k, k) + k``.
        """
        offset = residue_index.unsqueeze(-1) - residue_index.unsqueeze(-2)
        # offset: [*, N_res, N_res]
        bins = torch.clamp(offset.long(), -self.relpos_k, self.relpos_k) + self.relpos_k
        one_hot = F.one_hot(bins, num_classes=self.num_relpos_bins).to(dtype)
        return self.linear_relpos(one_hot)

    def forward(
        self,
        target_feat: torch.Tensor,
        residue_index: torch.Tensor,
        msa_feat: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``target_feat`` ``[*, N_res, tf_dim]``, ``residue_index`` ``[*, N_res]``,
        ``msa_feat`` ``[*, N_clust, N_res, msa_dim]`` -> ``m`` ``[*, N_clust, N_res, c_m]``,
        ``z`` ``[*, N_res, N_res, c_z]``."""
        a = self.linear_tf_z_i(target_feat)
        b = self.linear_tf_z_j(target_feat)
        # a, b: [*, N_res, c_z]
        z = self.relpos(residue_index, dtype=b.dtype)
        z = z + a.unsqueeze(-2)
        z = z + b.unsqueeze(-3)
        # z: [*, N_res, N_res, c_z]
        m = self.linear_msa_m(msa_feat)
        m = m + self.linear_tf_m(target_feat).unsqueeze(-3)
        # m: [*, N_clust, N_res, c_m]
        return m, z


class RecyclingEmbedder(nn.Module):
    """Algorithm 32 lines 1-4: embed the previous iteration's first MSA row, pair
    representation and pseudo-beta distogram.

    Args:
        c_m, c_z: representation channels.
        min_bin, max_bin, num_bins: distogram bin centres (Angstrom); edges are their squares.
        inf: upper edge of the last bin (squared Angstrom).
    """

    def __init__(self, cfg: RecyclingEmbedderConfig) -> None:
        super().__init__()
        self.min_bin = cfg.min_bin
        self.max_bin = cfg.max_bin
        self.num_bins = cfg.num_bins
        self.inf = cfg.inf
        self.linear = Linear(cfg.num_bins, cfg.c_z)
        self.layer_norm_m = LayerNorm(cfg.c_m)
        self.layer_norm_z = LayerNorm(cfg.c_z)

    def forward(
        self,
        m0_prev: torch.Tensor,
        z_prev: torch.Tensor,
        x_prev: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``m0_prev`` ``[*, N_res, c_m]``, ``z_prev`` ``[*, N_res, N_res, c_z]``, ``x_prev``
        (pseudo-beta positions) ``[*, N_res, 3]`` -> updates for ``m[..., 0, :, :]`` and ``z``."""
        bins = torch.linspace(self.min_bin, self.max_bin, self.num_bins, dtype=x_prev.dtype, device=x_prev.device)
        lower = bins**2
        upper = torch.cat([lower[1:], lower.new_full((1,), self.inf)])  # new_full: no host-to-device copy
        d2 = torch.sum((x_prev.unsqueeze(-2) - x_prev.unsqueeze(-3)) ** 2, dim=-1, keepdim=True)
        # d2: [*, N_res, N_res, 1]
        dgram = ((d2 > lower) & (d2 < upper)).to(x_prev.dtype)
        z_update = self.linear(dgram) + self.layer_norm_z(z_prev)
        m0_update = self.layer_norm_m(m0_prev)
        return m0_update, z_update


class TemplateAngleEmbedder(nn.Module):
    """Algorithm 2 line 7: ``template_angle_feat`` -> extra MSA rows (Linear, ReLU, Linear)."""

    def __init__(self, cfg: TemplateAngleEmbedderConfig) -> None:
        super().__init__()
        self.linear_1 = Linear(cfg.ta_dim, cfg.c_m, init="relu")
        self.linear_2 = Linear(cfg.c_m, cfg.c_m, init="relu")

    def forward(self, template_angle_feat: torch.Tensor) -> torch.Tensor:
        """``[*, N_templ, N_res, ta_dim]`` -> ``[*, N_templ, N_res, c_m]``."""
        return self.linear_2(torch.relu(self.linear_1(template_angle_feat)))


class TemplatePairEmbedder(nn.Module):
    """Algorithm 2 line 9: ``template_pair_feat`` -> template pair representation."""

    def __init__(self, cfg: TemplatePairEmbedderConfig) -> None:
        super().__init__()
        self.linear = Linear(cfg.tp_dim, cfg.c_t, init="relu")

    def forward(self, template_pair_feat: torch.Tensor) -> torch.Tensor:
        """``[*, N_res, N_res, tp_dim]`` -> ``[*, N_res, N_res, c_t]``."""
        return self.linear(template_pair_feat)


class ExtraMSAEmbedder(nn.Module):
    """Algorithm 2 line 15: ``extra_msa_feat`` -> extra-MSA representation."""

    def __init__(self, cfg: ExtraMSAEmbedderConfig) -> None:
        super().__init__()
        self.linear = Linear(cfg.emsa_dim, cfg.c_e)

    def forward(self, extra_msa_feat: torch.Tensor) -> torch.Tensor:
        """``[*, N_extra_seq, N_res, emsa_dim]`` -> ``[*, N_extra_seq, N_res, c_e]``."""
        return self.linear(extra_msa_feat)


__all__ = [
    "InputEmbedder",
    "RecyclingEmbedder",
    "TemplateAngleEmbedder",
    "TemplatePairEmbedder",
    "ExtraMSAEmbedder",
]
