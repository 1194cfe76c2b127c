"""The AlphaFold2 monomer model (Supplementary Algorithm 2), as trained by MLPerf HPC OpenFold.

One forward pass runs the recycling iterations over the trailing dimension ``R`` of every batch
tensor: iterations ``0 .. R-2`` without autograd, the last one with it (Algorithm 30/31 in
training: only the final pass is differentiated). Each iteration:

1. input embedding (Alg. 3-5) and recycling embedding of the previous first MSA row, pair
   representation and pseudo-beta positions (Alg. 32, detached);
2. template embedding (Alg. 2 lines 7-13): template pair features -> pair embedder -> template
   pair stack (Alg. 16) -> pointwise attention (Alg. 17) added to the pair representation;
   template torsion-angle features -> extra MSA rows appended to the cluster MSA;
3. extra-MSA embedding and stack (Alg. 18), Evoformer (Alg. 6), structure module (Alg. 20);
then the auxiliary heads run on the last iteration's outputs.

Output keys (last iteration): ``msa`` (cluster rows only), ``pair``, ``single``, ``sm_*``,
``final_atom_positions``, ``final_atom_mask``, ``final_affine_tensor`` and the heads' outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Union

import torch
import torch.nn as nn

from scalefold.config.recompute import parse_checkpointing
from scalefold.model import features
from scalefold.model.all_atom import atom14_to_atom37, pseudo_beta_fn
from scalefold.model.config import AlphaFoldConfig
from scalefold.model.embedders import (
    ExtraMSAEmbedder,
    InputEmbedder,
    RecyclingEmbedder,
    TemplateAngleEmbedder,
    TemplatePairEmbedder,
)
from scalefold.model.evoformer import EvoformerStack
from scalefold.model.extra_msa import ExtraMSAStack
from scalefold.model.heads import AuxiliaryHeads
from scalefold.model.memory import CHECKPOINT_STACKS, checkpointed_blocks, stack_request
from scalefold.model.parallel import ParallelStack
from scalefold.model.primitives import LayerNorm, Linear, WeightCasts
from scalefold.model.structure_module import StructureModule
from scalefold.model.template import TemplatePairStack, TemplatePointwiseAttention

NUM_ATOM37 = 37

Recycled = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (m0, z, atom37 positions)


class AlphaFold(nn.Module):
    """AlphaFold2 (Supplementary Algorithm 2) with the MLPerf reference's parameter names.

    Args:
        config: an :class:`AlphaFoldConfig` or the reference's plain config dict.
        activation_checkpointing: recompute block activations in backward during training
            (the reference does so for the differentiated iteration); numerics are unchanged. A
            policy (:func:`~scalefold.model.memory.parse_checkpointing`): ``True`` / ``"on"`` every
            block, ``False`` / ``"off"`` none, ``N`` the first ``N`` blocks in forward order
            (template pair, extra MSA, Evoformer); ``"auto"`` must be resolved first.
        parallel_evoformer: HelixFold's Parallel Evoformer (outer product mean at the end of each
            Evoformer block; required by Branch Parallelism). Not part of the reference model.
    """

    def __init__(
        self,
        config: Union[AlphaFoldConfig, Mapping[str, Any]],
        activation_checkpointing: bool | int | str = True,
        parallel_evoformer: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(config, AlphaFoldConfig):
            config = AlphaFoldConfig.from_dict(dict(config))
        self.config = config
        self.activation_checkpointing = parse_checkpointing(activation_checkpointing)
        self.templates_enabled = config.templates_enabled
        self.embed_template_torsion_angles = config.embed_template_torsion_angles

        self.input_embedder = InputEmbedder(config.input_embedder_config)
        self.recycling_embedder = RecyclingEmbedder(config.recycling_embedder_config)
        if self.templates_enabled:
            self.template_angle_embedder = TemplateAngleEmbedder(config.template_angle_embedder_config)
            self.template_pair_embedder = TemplatePairEmbedder(config.template_pair_embedder_config)
            self.template_pair_stack = TemplatePairStack(config.template_pair_stack_config)
            self.template_pointwise_attention = TemplatePointwiseAttention(config.template_pointwise_attention_config)
        self.extra_msa_embedder = ExtraMSAEmbedder(config.extra_msa_embedder_config)
        self.extra_msa_stack = ExtraMSAStack(config.extra_msa_stack_config)
        self.parallel_evoformer = parallel_evoformer
        self.evoformer_stack = EvoformerStack(config.evoformer_stack_config, parallel=parallel_evoformer)
        self.structure_module = StructureModule(config.structure_module_config)
        self.auxiliary_heads = AuxiliaryHeads(config.auxiliary_heads_config)
        self.checkpointed_blocks()  # an unresolved "auto" or an N beyond the blocks is refused here
        # each weight cast to bf16 once per forward under autocast, shared by the passes and the recomputation
        self._weight_casts = WeightCasts()
        for module in self.modules():
            if isinstance(module, (Linear, LayerNorm)):
                module.weight_casts = self._weight_casts
        for unit in self._cast_units():  # a block's weights cast in one go
            self._weight_casts.group(unit)

        self._model_features = features.required_features("model", templates_enabled=self.templates_enabled)
        self._feature_symbols = {
            "tf_dim": config.input_embedder_config.tf_dim,
            "msa_dim": config.input_embedder_config.msa_dim,
        }

    # ------------------------------------------------------------------------------------------

    def _cast_units(self) -> list[list[nn.Module]]:
        """The modules whose weights are cast together: each block of a stack, and the rest of each top-level
        module (the embedders, the heads, a stack's own layers)."""
        units: list[list[nn.Module]] = []
        for child in self.children():
            blocks = getattr(child, "blocks", None)
            inner = [list(block.modules()) for block in blocks] if isinstance(blocks, nn.ModuleList) else []
            seen = {id(m) for unit in inner for m in unit}
            units += inner + [[m for m in child.modules() if id(m) not in seen]]
        return units

    def parallel_stacks(self) -> list[ParallelStack]:
        """The stacks DAP shards (and BP splits, for the Parallel Evoformer), in module order: the
        model's whole interface to :func:`scalefold.distributed.parallelize.parallelize`."""
        stacks: list[ParallelStack] = [self.template_pair_stack] if self.templates_enabled else []
        return stacks + [self.extra_msa_stack, self.evoformer_stack]

    def checkpointed_blocks(self) -> dict[str, int]:
        """``{stack name: blocks that recompute in the grad pass}`` under ``activation_checkpointing``
        (the stacks this model has, in forward order; training with grad only)."""
        stacks = [(name, len(getattr(self, name).blocks)) for name in CHECKPOINT_STACKS if hasattr(self, name)]
        return checkpointed_blocks(self.activation_checkpointing, stacks)

    def validate_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """Raise ``ValueError`` naming the feature if a model input is missing or malformed."""
        return features.validate_batch(batch, self._model_features, symbols=self._feature_symbols)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch``: feature dict with leading batch and trailing recycling dimensions.

        Returns the last iteration's outputs (see module docstring).
        """
        self.validate_batch(batch)
        self._weight_casts.begin()
        try:
            return self._forward(batch)
        finally:
            self._weight_casts.end(backward_follows=torch.is_grad_enabled())

    def _forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        num_iters = batch["aatype"].shape[-1]
        grad_enabled = torch.is_grad_enabled()
        recycled: Recycled | None = None
        outputs: dict[str, torch.Tensor] = {}
        plan = self.checkpointed_blocks() if self.training else False
        for it in range(num_iters):
            is_last = it == num_iters - 1
            feats = {name: batch[name][..., it] for name in self._model_features}
            if is_last and torch.is_autocast_enabled(batch["aatype"].device.type):
                # Weight casts cached under no_grad would carry no grad (pytorch/pytorch#65766); and the
                # cache would keep the no-grad passes' casts for the grad pass. On the batch's device
                # (the no-argument form asks about CUDA only: CPU autocast kept them).
                torch.clear_autocast_cache()
            with torch.set_grad_enabled(grad_enabled and is_last):
                outputs, recycled = self.iteration(
                    feats,
                    recycled,
                    gradient_checkpointing=plan if is_last else False,
                )
            if not is_last:
                # m0_prev is a view of the pass's whole final MSA: copy the row out, so that the next pass
                # does not hold N_seq rows for one (the values are the same)
                m0_prev, z_prev, x_prev = recycled
                recycled = (m0_prev.detach().clone(), z_prev.detach(), x_prev.detach())
        outputs.update(self.auxiliary_heads(outputs))
        return outputs

    def iteration(
        self,
        feats: Mapping[str, torch.Tensor],
        recycled: Recycled | None,
        gradient_checkpointing: bool | Mapping[str, int] = False,
    ) -> tuple[dict[str, torch.Tensor], Recycled]:
        """One pass of Algorithm 2 on one recycling slice of the batch (no trailing ``R``).

        ``recycled`` is ``(m0_prev, z_prev, x_prev)`` from the previous pass, ``None`` at first.
        ``gradient_checkpointing``: every block recomputes (``True``), none, or ``{stack: leading blocks
        that recompute}``.
        """
        recompute = partial(stack_request, gradient_checkpointing)
        seq_mask = feats["seq_mask"]
        pair_mask = seq_mask.unsqueeze(-1) * seq_mask.unsqueeze(-2)
        # pair_mask: [B, N_res, N_res]
        msa_mask = feats["msa_mask"]
        # msa_mask: [B, N_clust, N_res]
        n_clust = feats["msa_feat"].shape[-3]

        m, z = self.embed_inputs_and_recycling(feats, recycled)
        if self.templates_enabled:
            m, z, msa_mask = self.embed_templates(feats, m, z, msa_mask, pair_mask, recompute("template_pair_stack"))
        z = self.embed_extra_msa(feats, z, pair_mask, m.dtype, recompute("extra_msa_stack"))

        # Evoformer (Alg. 6).
        m, z, s = self.evoformer_stack(
            m,
            z,
            msa_mask=msa_mask.to(m.dtype),
            pair_mask=pair_mask.to(z.dtype),
            gradient_checkpointing=recompute("evoformer_stack"),
        )
        # m: [B, N_seq, N_res, C_m], z: [B, N_res, N_res, C_z], s: [B, N_res, C_s]

        outputs: dict[str, torch.Tensor] = {"msa": m[..., :n_clust, :, :], "pair": z, "single": s}
        outputs.update(self.predict_structure(feats, s, z, seq_mask))
        return outputs, (m[..., 0, :, :], z, outputs["final_atom_positions"])

    def embed_inputs_and_recycling(
        self, feats: Mapping[str, torch.Tensor], recycled: Recycled | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embedding (Alg. 3-5) plus the recycling embedding (Alg. 32) of the previous pass's
        first MSA row, pair representation and pseudo-beta positions (zeros at the first pass).

        Returns ``m`` ``[B, N_clust, N_res, C_m]`` and ``z`` ``[B, N_res, N_res, C_z]``.
        """
        m, z = self.input_embedder(feats["target_feat"], feats["residue_index"], feats["msa_feat"])
        # m: [B, N_clust, N_res, C_m], z: [B, N_res, N_res, C_z]

        # Recycling (Alg. 32): zeros at the first pass.
        if recycled is None:
            batch_size, n_res = feats["aatype"].shape
            m0_prev = m.new_zeros(m.shape[:-3] + m.shape[-2:])
            z_prev = torch.zeros_like(z)
            x_prev = z.new_zeros((batch_size, n_res, NUM_ATOM37, 3))
        else:
            m0_prev, z_prev, x_prev = recycled
        x_prev = pseudo_beta_fn(feats["aatype"], x_prev).to(z.dtype)
        # x_prev: [B, N_res, 3]
        m0_update, z_update = self.recycling_embedder(m0_prev, z_prev, x_prev)
        m = torch.cat([m[..., :1, :, :] + m0_update.unsqueeze(-3), m[..., 1:, :, :]], dim=-3)
        z = z + z_update
        return m, z

    def embed_templates(
        self,
        feats: Mapping[str, torch.Tensor],
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        gradient_checkpointing: bool | int = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Templates (Alg. 2 lines 7-13): the template pair embedding added to ``z`` and, with
        ``embed_template_torsion_angles``, one template torsion-angle row per template appended to
        the MSA ``m`` and its mask. Returns ``(m, z, msa_mask)``; ``m``: ``[B, N_seq, N_res, C_m]``,
        ``N_seq = N_clust + N_templ``."""
        z = z + self.embed_template_pair(feats, z, pair_mask, gradient_checkpointing)
        if self.embed_template_torsion_angles:
            angle_feat = features.build_template_angle_feat(
                feats["template_aatype"],
                feats["template_torsion_angles_sin_cos"],
                feats["template_alt_torsion_angles_sin_cos"],
                feats["template_torsion_angles_mask"],
            )
            a = self.template_angle_embedder(angle_feat)
            # a: [B, N_templ, N_res, C_m]
            m = torch.cat([m, a], dim=-3)
            template_row_mask = feats["template_torsion_angles_mask"][..., features.PSI_TORSION_INDEX]
            msa_mask = torch.cat([msa_mask, template_row_mask], dim=-2)
            # m: [B, N_seq, N_res, C_m], N_seq = N_clust + N_templ
        return m, z, msa_mask

    def embed_extra_msa(
        self,
        feats: Mapping[str, torch.Tensor],
        z: torch.Tensor,
        pair_mask: torch.Tensor,
        dtype: torch.dtype,
        gradient_checkpointing: bool | int = False,
    ) -> torch.Tensor:
        """Extra MSA embedding and stack (Alg. 18): updates ``z`` only; the masks are cast to
        ``dtype`` (the MSA representation's)."""
        extra_feat = features.build_extra_msa_feat(
            feats["extra_msa"], feats["extra_has_deletion"], feats["extra_deletion_value"]
        )
        e = self.extra_msa_embedder(extra_feat)
        # e: [B, N_extra_seq, N_res, C_e]
        return self.extra_msa_stack(
            e,
            z,
            msa_mask=feats["extra_msa_mask"].to(dtype),
            pair_mask=pair_mask.to(dtype),
            gradient_checkpointing=gradient_checkpointing,
        )

    def predict_structure(
        self, feats: Mapping[str, torch.Tensor], s: torch.Tensor, z: torch.Tensor, seq_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Structure module (Alg. 20) outputs ``sm_*`` plus the final iteration's atom37
        positions and mask and backbone frames (``final_atom_positions``, ``final_atom_mask``,
        ``final_affine_tensor``)."""
        outputs = dict(self.structure_module(s=s, z=z, aatype=feats["aatype"], mask=seq_mask.to(s.dtype)))
        outputs["final_atom_positions"] = atom14_to_atom37(outputs["sm_positions"][:, -1], feats)
        outputs["final_atom_mask"] = feats["atom37_atom_exists"]
        outputs["final_affine_tensor"] = outputs["sm_frames"][:, -1]
        return outputs

    def embed_template_pair(
        self,
        feats: Mapping[str, torch.Tensor],
        z: torch.Tensor,
        pair_mask: torch.Tensor,
        gradient_checkpointing: bool | int = False,
    ) -> torch.Tensor:
        """Template pair features -> embedder -> pair stack -> pointwise attention.

        Returns the pair update ``[B, N_res, N_res, C_z]``, zero for samples without templates.
        """
        cfg = self.config
        t = features.build_template_pair_feat(
            feats["template_aatype"],
            feats["template_pseudo_beta"],
            feats["template_pseudo_beta_mask"],
            feats["template_all_atom_positions"],
            feats["template_all_atom_mask"],
            min_bin=cfg.template_pair_feat_distogram_min_bin,
            max_bin=cfg.template_pair_feat_distogram_max_bin,
            num_bins=cfg.template_pair_feat_distogram_num_bins,
            use_unit_vector=cfg.template_pair_feat_use_unit_vector,
            inf=cfg.template_pair_feat_inf,
            eps=cfg.template_pair_feat_eps,
        ).to(z.dtype)
        # t: [B, N_templ, N_res, N_res, tp_dim]
        t = self.template_pair_embedder(t)
        t = self.template_pair_stack(t, mask=pair_mask.to(z.dtype), gradient_checkpointing=gradient_checkpointing)
        # t: [B, N_templ, N_res, N_res, C_t]
        template_mask = feats["template_mask"]
        t = self.template_pointwise_attention(t, z, template_mask=template_mask.to(z.dtype))
        # t: [B, N_res, N_res, C_z]
        has_template = (torch.sum(template_mask, dim=-1) > 0).to(t.dtype)
        return t * has_template.view(has_template.shape + (1, 1, 1))


__all__ = ["AlphaFold"]
