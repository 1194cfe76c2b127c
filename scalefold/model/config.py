"""AlphaFold configuration: one dataclass per sub-config, mirroring the MLPerf reference tree.

The field names, nesting and defaults are those of the reference ``AlphaFoldConfig`` (MLPerf HPC
OpenFold, ``openfold/config.py``), so that

* ``AlphaFoldConfig.from_dict(reference_dict)`` accepts the reference's plain dict exactly
  (unknown keys and wrongly typed values raise a ``ValueError`` naming the dotted key), and
* ``AlphaFoldConfig.to_dict()`` gives back the same plain dict.

The stacks, the pointwise attention and the structure module are built from their sub-config
object, e.g. ``EvoformerStack(cfg.evoformer_stack_config)`` (their blocks from the same object);
the small embedders and heads take theirs as keyword arguments.

Presets (:meth:`AlphaFoldConfig.from_preset`):

* ``mlperf`` (alias ``initial_training``) -- the closed-division model of MLPerf HPC OpenFold:
  AlphaFold2 model_1, 93,229,082 parameters, crop 256, 124 clusters, 1024 extra sequences,
  4 templates, dropout 0.15 (MSA) / 0.25 (pair) / 0.1 (structure module);
* ``demo`` -- a CPU-trainable model (c_m 32, c_z 16, 2 Evoformer blocks, crop 64);
* ``tiny`` -- the dimensions of the ``golden_small`` reference run (crop 24, dropout 0), for tests.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------------------------
# Module configs
# --------------------------------------------------------------------------------------------


@dataclass
class InputEmbedderConfig:
    """Algorithm 3-4: target/MSA feature embedding and relative position encoding."""

    tf_dim: int = 22
    msa_dim: int = 49
    c_z: int = 128
    c_m: int = 256
    relpos_k: int = 32


@dataclass
class RecyclingEmbedderConfig:
    """Algorithm 32: recycled first MSA row, pair representation and pseudo-beta distogram."""

    c_m: int = 256
    c_z: int = 128
    min_bin: float = 3.25
    max_bin: float = 20.75
    num_bins: int = 15
    inf: float = 1e8


@dataclass
class TemplateAngleEmbedderConfig:
    """Algorithm 2 line 7: template torsion-angle features -> extra MSA rows."""

    ta_dim: int = 57
    c_m: int = 256


@dataclass
class TemplatePairEmbedderConfig:
    """Algorithm 2 line 9: template pair features -> template pair representation."""

    tp_dim: int = 88
    c_t: int = 64


@dataclass
class TemplatePairStackConfig:
    """Algorithm 16: template pair stack."""

    c_t: int = 64
    c_hidden_tri_att: int = 16
    c_hidden_tri_mul: int = 64
    num_blocks: int = 2
    num_heads_tri: int = 4
    pair_transition_n: int = 2
    dropout_rate: float = 0.25
    inf: float = 1e9
    chunk_size_tri_att: int | None = None


@dataclass
class TemplatePointwiseAttentionConfig:
    """Algorithm 17: attention of the pair representation over templates."""

    c_t: int = 64
    c_z: int = 128
    c_hidden: int = 16
    num_heads: int = 4
    inf: float = 1e5
    chunk_size: int | None = None


@dataclass
class ExtraMSAEmbedderConfig:
    """Algorithm 2 line 15: extra-MSA feature embedding."""

    emsa_dim: int = 25
    c_e: int = 64


@dataclass
class ExtraMSAStackConfig:
    """Algorithm 18: extra-MSA stack (global column attention)."""

    c_e: int = 64
    c_z: int = 128
    c_hidden_msa_att: int = 8
    c_hidden_opm: int = 32
    c_hidden_tri_mul: int = 128
    c_hidden_tri_att: int = 32
    num_heads_msa: int = 8
    num_heads_tri: int = 4
    num_blocks: int = 4
    transition_n: int = 4
    msa_dropout: float = 0.15
    pair_dropout: float = 0.25
    inf: float = 1e9
    eps: float = 1e-8
    eps_opm: float = 1e-3
    chunk_size_msa_att: int | None = None
    chunk_size_opm: int | None = None
    chunk_size_tri_att: int | None = None


@dataclass
class EvoformerStackConfig:
    """Algorithm 6: Evoformer stack."""

    c_m: int = 256
    c_z: int = 128
    c_hidden_msa_att: int = 32
    c_hidden_opm: int = 32
    c_hidden_tri_mul: int = 128
    c_hidden_tri_att: int = 32
    c_s: int = 384
    num_heads_msa: int = 8
    num_heads_tri: int = 4
    num_blocks: int = 48
    transition_n: int = 4
    msa_dropout: float = 0.15
    pair_dropout: float = 0.25
    inf: float = 1e9
    eps_opm: float = 1e-3
    chunk_size_msa_att: int | None = None
    chunk_size_opm: int | None = None
    chunk_size_tri_att: int | None = None


@dataclass
class StructureModuleConfig:
    """Algorithm 20: structure module (IPA, backbone update, angle ResNet)."""

    c_s: int = 384
    c_z: int = 128
    c_hidden_ipa: int = 16
    c_hidden_ang_res: int = 128
    num_heads_ipa: int = 12
    num_qk_points: int = 4
    num_v_points: int = 8
    dropout_rate: float = 0.1
    num_blocks: int = 8
    num_ang_res_blocks: int = 2
    num_angles: int = 7
    scale_factor: float = 10.0
    inf: float = 1e5
    eps: float = 1e-8


@dataclass
class PerResidueLDDTCaPredictorConfig:
    """Algorithm 29: pLDDT head."""

    c_s: int = 384
    c_hidden: int = 128
    num_bins: int = 50


@dataclass
class DistogramHeadConfig:
    """Section 1.9.8: distogram head."""

    c_z: int = 128
    num_bins: int = 64


@dataclass
class MaskedMSAHeadConfig:
    """Section 1.9.9: masked MSA head."""

    c_m: int = 256
    c_out: int = 23


@dataclass
class ExperimentallyResolvedHeadConfig:
    """Section 1.9.10: experimentally-resolved head."""

    c_s: int = 384
    c_out: int = 37


@dataclass
class TMScoreHeadConfig:
    """Section 1.9.7: predicted TM-score / aligned error head."""

    c_z: int = 128
    num_bins: int = 64
    max_bin: int = 31


@dataclass
class AuxiliaryHeadsConfig:
    per_residue_lddt_ca_predictor_config: PerResidueLDDTCaPredictorConfig = field(
        default_factory=PerResidueLDDTCaPredictorConfig
    )
    distogram_head_config: DistogramHeadConfig = field(default_factory=DistogramHeadConfig)
    masked_msa_head_config: MaskedMSAHeadConfig = field(default_factory=MaskedMSAHeadConfig)
    experimentally_resolved_head_config: ExperimentallyResolvedHeadConfig = field(
        default_factory=ExperimentallyResolvedHeadConfig
    )
    tm_score_head_config: TMScoreHeadConfig = field(default_factory=TMScoreHeadConfig)
    tm_score_head_enabled: bool = False


# --------------------------------------------------------------------------------------------
# Loss configs (Supplementary 1.9)
# --------------------------------------------------------------------------------------------


@dataclass
class FAPELossConfig:
    weight: float = 1.0
    backbone_clamp_distance: float = 10.0
    backbone_loss_unit_distance: float = 10.0
    backbone_weight: float = 0.5
    sidechain_clamp_distance: float = 10.0
    sidechain_length_scale: float = 10.0
    sidechain_weight: float = 0.5
    eps: float = 1e-4


@dataclass
class SupervisedChiLossConfig:
    weight: float = 1.0
    chi_weight: float = 0.5
    angle_norm_weight: float = 0.01
    eps: float = 1e-8


@dataclass
class DistogramLossConfig:
    weight: float = 0.3
    min_bin: float = 2.3125
    max_bin: float = 21.6875
    num_bins: int = 64
    eps: float = 1e-8


@dataclass
class MaskedMSALossConfig:
    weight: float = 2.0
    eps: float = 1e-8


@dataclass
class PLDDTLossConfig:
    weight: float = 0.01
    cutoff: float = 15.0
    min_resolution: float = 0.1
    max_resolution: float = 3.0
    num_bins: int = 50
    eps: float = 1e-8


@dataclass
class ExperimentallyResolvedLossConfig:
    weight: float = 0.0
    min_resolution: float = 0.1
    max_resolution: float = 3.0
    eps: float = 1e-8


@dataclass
class ViolationLossConfig:
    weight: float = 0.0
    violation_tolerance_factor: float = 12.0
    clash_overlap_tolerance: float = 1.5
    eps: float = 1e-8


@dataclass
class TMLossConfig:
    enabled: bool = False
    weight: float = 0.0
    min_resolution: float = 0.1
    max_resolution: float = 3.0
    num_bins: int = 64
    max_bin: int = 31
    eps: float = 1e-8


@dataclass
class LossConfig:
    fape_loss_config: FAPELossConfig = field(default_factory=FAPELossConfig)
    supervised_chi_loss_config: SupervisedChiLossConfig = field(default_factory=SupervisedChiLossConfig)
    distogram_loss_config: DistogramLossConfig = field(default_factory=DistogramLossConfig)
    masked_msa_loss_config: MaskedMSALossConfig = field(default_factory=MaskedMSALossConfig)
    plddt_loss_config: PLDDTLossConfig = field(default_factory=PLDDTLossConfig)
    experimentally_resolved_loss_config: ExperimentallyResolvedLossConfig = field(
        default_factory=ExperimentallyResolvedLossConfig
    )
    violation_loss_config: ViolationLossConfig = field(default_factory=ViolationLossConfig)
    tm_loss_config: TMLossConfig = field(default_factory=TMLossConfig)


# --------------------------------------------------------------------------------------------
# Top level
# --------------------------------------------------------------------------------------------


def _names(*names: str):
    return field(default_factory=lambda: list(names))


@dataclass
class AlphaFoldConfig:
    """The whole configuration: model modules, loss, and the global (data / training) values."""

    preset: str = "default"

    # Model modules.
    input_embedder_config: InputEmbedderConfig = field(default_factory=InputEmbedderConfig)
    recycling_embedder_config: RecyclingEmbedderConfig = field(default_factory=RecyclingEmbedderConfig)
    template_angle_embedder_config: TemplateAngleEmbedderConfig = field(default_factory=TemplateAngleEmbedderConfig)
    template_pair_embedder_config: TemplatePairEmbedderConfig = field(default_factory=TemplatePairEmbedderConfig)
    template_pair_stack_config: TemplatePairStackConfig = field(default_factory=TemplatePairStackConfig)
    template_pointwise_attention_config: TemplatePointwiseAttentionConfig = field(
        default_factory=TemplatePointwiseAttentionConfig
    )
    extra_msa_embedder_config: ExtraMSAEmbedderConfig = field(default_factory=ExtraMSAEmbedderConfig)
    extra_msa_stack_config: ExtraMSAStackConfig = field(default_factory=ExtraMSAStackConfig)
    evoformer_stack_config: EvoformerStackConfig = field(default_factory=EvoformerStackConfig)
    structure_module_config: StructureModuleConfig = field(default_factory=StructureModuleConfig)
    auxiliary_heads_config: AuxiliaryHeadsConfig = field(default_factory=AuxiliaryHeadsConfig)

    # Loss.
    loss_config: LossConfig = field(default_factory=LossConfig)
    use_clamped_fape_probability: float = 0.9
    self_distillation_plddt_threshold: float = 50.0

    # Optimisation (MLPerf closed division: clip at global norm 0.1, SWA decay 0.9).
    gradient_clipping: bool = True
    clip_grad_max_norm: float = 0.1
    swa_enabled: bool = True
    swa_decay_rate: float = 0.9

    # Crop size N_res (train mode) and recycling (trailing batch dimension has size n + 1).
    train_sequence_crop_size: int = 256
    num_recycling_iters: int = 3

    # MSA features.
    primary_raw_feature_names: list[str] = _names(
        "aatype", "residue_index", "msa", "num_alignments", "seq_length", "between_segment_residues", "deletion_matrix"
    )
    max_msa_clusters: int = 124  # N_clust
    max_extra_msa: int = 1024  # N_extra_seq
    max_distillation_msa_clusters: int = 1000
    masked_msa_enabled: bool = True
    masked_msa_profile_prob: float = 0.1
    masked_msa_same_prob: float = 0.1
    masked_msa_uniform_prob: float = 0.1
    masked_msa_replace_fraction: float = 0.15
    msa_cluster_features: bool = True

    # Template features.
    templates_enabled: bool = True
    max_templates: int = 4  # N_templ
    shuffle_top_k_prefiltered: int = 20
    embed_template_torsion_angles: bool = True
    template_pair_feat_distogram_min_bin: float = 3.25
    template_pair_feat_distogram_max_bin: float = 50.75
    template_pair_feat_distogram_num_bins: int = 39
    template_pair_feat_use_unit_vector: bool = False
    template_pair_feat_inf: float = 1e5
    template_pair_feat_eps: float = 1e-6
    template_raw_feature_names: list[str] = _names(
        "template_all_atom_positions", "template_sum_probs", "template_aatype", "template_all_atom_mask"
    )

    # Supervised features.
    supervised_raw_features_names: list[str] = _names(
        "all_atom_mask", "all_atom_positions", "resolution", "is_distillation"
    )

    # ---------------------------------------------------------------------------------------

    @classmethod
    def from_preset(
        cls,
        name: str,
        precision: str = "tf32",
        overrides: dict[str, Any] | None = None,
    ) -> AlphaFoldConfig:
        """Build a preset (``mlperf``/``initial_training``, ``demo``, ``tiny``).

        ``precision`` ``fp16``/``amp`` lowers the finite infinities as the reference does;
        ``overrides`` is a nested dict merged on top (same keys as :meth:`to_dict`).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        cfg: dict[str, Any] = {"preset": f"{name}-{precision}"}
        _merge(cfg, PRESETS[name]())
        if precision in ("fp16", "amp"):
            _merge(cfg, _half_precision_settings())
        elif precision not in ("fp32", "tf32", "bf16"):
            raise ValueError(f"unknown precision {precision!r}; expected fp32, tf32, bf16, fp16 or amp")
        if overrides:
            _merge(cfg, copy.deepcopy(overrides))
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> AlphaFoldConfig:
        """Build from a plain (possibly partial) dict such as the reference's ``asdict(config)``.

        Missing keys keep their defaults; unknown keys or values of the wrong type raise a
        ``ValueError`` naming the dotted key.
        """
        return _build(cls, cfg, path="")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict, identical in layout to the reference's ``asdict(config)``."""
        return dataclasses.asdict(self)

    def model_dict(self) -> dict[str, Any]:
        """Just the module sub-configs (the ``*_config`` entries the model is built from)."""
        d = self.to_dict()
        return {k: v for k, v in d.items() if k.endswith("_config") and k != "loss_config"}


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


def _mlperf() -> dict[str, Any]:
    """Reference ``initial_training``: the defaults above (crop 256, 124 clusters, 1024 extra)."""
    return {"train_sequence_crop_size": 256, "max_msa_clusters": 124, "max_extra_msa": 1024}


def _small(
    c_m: int,
    c_z: int,
    c_s: int,
    c_t: int,
    c_e: int,
    evoformer_blocks: int,
    msa_dropout: float,
    pair_dropout: float,
    sm_dropout: float,
) -> dict[str, Any]:
    """A scaled-down AlphaFold with the reference's layout (shared by ``demo`` and ``tiny``)."""
    return {
        "input_embedder_config": {"c_z": c_z, "c_m": c_m},
        "recycling_embedder_config": {"c_m": c_m, "c_z": c_z},
        "template_angle_embedder_config": {"c_m": c_m},
        "template_pair_embedder_config": {"c_t": c_t},
        "template_pair_stack_config": {
            "c_t": c_t,
            "c_hidden_tri_att": 8,
            "c_hidden_tri_mul": 16,
            "num_blocks": 1,
            "num_heads_tri": 2,
            "dropout_rate": pair_dropout,
        },
        "template_pointwise_attention_config": {"c_t": c_t, "c_z": c_z, "c_hidden": 8, "num_heads": 2},
        "extra_msa_embedder_config": {"c_e": c_e},
        "extra_msa_stack_config": {
            "c_e": c_e,
            "c_z": c_z,
            "c_hidden_msa_att": 4,
            "c_hidden_opm": 8,
            "c_hidden_tri_mul": 16,
            "c_hidden_tri_att": 8,
            "num_heads_msa": 4,
            "num_heads_tri": 2,
            "num_blocks": 1,
            "msa_dropout": msa_dropout,
            "pair_dropout": pair_dropout,
        },
        "evoformer_stack_config": {
            "c_m": c_m,
            "c_z": c_z,
            "c_hidden_msa_att": 8,
            "c_hidden_opm": 8,
            "c_hidden_tri_mul": 16,
            "c_hidden_tri_att": 8,
            "c_s": c_s,
            "num_heads_msa": 4,
            "num_heads_tri": 2,
            "num_blocks": evoformer_blocks,
            "msa_dropout": msa_dropout,
            "pair_dropout": pair_dropout,
        },
        "structure_module_config": {
            "c_s": c_s,
            "c_z": c_z,
            "c_hidden_ipa": 8,
            "c_hidden_ang_res": 16,
            "num_heads_ipa": 4,
            "dropout_rate": sm_dropout,
            "num_blocks": 2,
        },
        "auxiliary_heads_config": {
            "per_residue_lddt_ca_predictor_config": {"c_s": c_s, "c_hidden": 16},
            "distogram_head_config": {"c_z": c_z},
            "masked_msa_head_config": {"c_m": c_m},
            "experimentally_resolved_head_config": {"c_s": c_s},
            "tm_score_head_config": {"c_z": c_z},
        },
    }


def _demo(c_m: int = 32, c_z: int = 16, c_s: int = 64) -> dict[str, Any]:
    """CPU-trainable: c_m 32, c_z 16, 2 Evoformer blocks, crop 64, reference dropout rates."""
    cfg = _small(
        c_m=c_m, c_z=c_z, c_s=c_s, c_t=16, c_e=16, evoformer_blocks=2, msa_dropout=0.15, pair_dropout=0.25, sm_dropout=0.1
    )
    cfg.update({"train_sequence_crop_size": 64, "max_msa_clusters": 16, "max_extra_msa": 32, "max_templates": 2})
    return cfg


def _demo_wide() -> dict[str, Any]:
    """The model the demo presets train (bench/RESULTS.md, sections 5c-5d): the narrow ``demo`` model with
    c_m 64, c_z 64, c_s 128 (538 k parameters, 3.5x; 1.26x its step time on one CPU core in one measurement,
    the step being dispatch-bound), whose from-scratch curve climbed about twice as fast per step and did
    not flatten at 0.4. 2 structure-module iterations here; the ``demo`` training preset runs 4."""
    return _demo(c_m=64, c_z=64, c_s=128)


def _tiny() -> dict[str, Any]:
    """The ``golden_small`` dimensions: crop 24, 8 clusters, 16 extra, 2 templates, no dropout."""
    cfg = _small(
        c_m=32, c_z=16, c_s=32, c_t=16, c_e=16, evoformer_blocks=2, msa_dropout=0.0, pair_dropout=0.0, sm_dropout=0.0
    )
    cfg.update({"train_sequence_crop_size": 24, "max_msa_clusters": 8, "max_extra_msa": 16, "max_templates": 2})
    return cfg


def _half_precision_settings() -> dict[str, Any]:
    """fp16 cannot hold 1e9: the reference lowers every finite infinity to 1e4."""
    inf = 1e4
    return {
        "recycling_embedder_config": {"inf": inf},
        "template_pair_stack_config": {"inf": inf},
        "template_pointwise_attention_config": {"inf": inf},
        "extra_msa_stack_config": {"inf": inf},
        "evoformer_stack_config": {"inf": inf},
        "structure_module_config": {"inf": inf},
        "template_pair_feat_inf": inf,
    }


PRESETS = {
    "mlperf": _mlperf,
    "initial_training": _mlperf,
    "demo": _demo,
    "demo-wide": _demo_wide,
    "tiny": _tiny,
}


# --------------------------------------------------------------------------------------------
# Strict dict -> dataclass conversion
# --------------------------------------------------------------------------------------------


def _merge(left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    for key, value in right.items():
        if isinstance(value, dict) and isinstance(left.get(key), dict):
            _merge(left[key], value)
        else:
            left[key] = value
    return left


def _build(cls: type, data: Any, path: str) -> Any:
    where = path or "<root>"
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"config {where}: expected a dict for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"config {where}: unknown key(s) {unknown} for {cls.__name__}; valid keys: {names}")
    kwargs = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        kwargs[name] = _convert(hints[name], value, key)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config {key}: expected a list, got {value!r}")
        return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config {key}: expected a bool, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config {key}: expected an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config {key}: expected a float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"config {key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config {key}: unsupported field type {tp!r}")  # pragma: no cover


__all__ = [
    "AlphaFoldConfig",
    "InputEmbedderConfig",
    "RecyclingEmbedderConfig",
    "TemplateAngleEmbedderConfig",
    "TemplatePairEmbedderConfig",
    "TemplatePairStackConfig",
    "TemplatePointwiseAttentionConfig",
    "ExtraMSAEmbedderConfig",
    "ExtraMSAStackConfig",
    "EvoformerStackConfig",
    "StructureModuleConfig",
    "AuxiliaryHeadsConfig",
    "LossConfig",
    "PRESETS",
]
