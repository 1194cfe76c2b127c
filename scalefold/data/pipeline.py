"""Raw AlphaFold features -> the model's batch dict; training-set filters and sampling weights.

A *raw feature dict* is what the featurisers produce (AlphaFold's format, e.g.
``reference/alphafold_raw_features_query.npz`` plus the structure of the chain): ``aatype``
(one-hot [N, 21] or indices [N]), ``residue_index``, ``seq_length``, ``between_segment_residues``,
``msa`` (HHblits residue indices [N_seq, N]), ``deletion_matrix_int`` (or ``deletion_matrix``),
``template_aatype`` (one-hot [T, N, 22] in HHblits order), ``template_all_atom_positions``,
``template_all_atom_mask`` (or AlphaFold's ``..._masks``), ``template_sum_probs``,
``all_atom_positions`` [N, 37, 3], ``all_atom_mask`` [N, 37], ``resolution``, ``is_distillation``.
numpy arrays or tensors.

Processing follows the MLPerf HPC OpenFold reference (``process_features``): non-ensembled
transforms once, then one *ensemble* per recycling iteration ``i`` (MSA sampling, masking,
clustering and extra-MSA cropping seeded with ``seed + i``, the residue crop and template
subsampling seeded with ``seed`` so every iteration sees the same window), stacked along a
trailing dimension ``R = num_recycling_iters + 1``. Same raw features and seed -> identical sample,
equal to the reference's.

Note on sizes: ``max_msa_clusters`` is 124 in MLPerf because the model appends one MSA row per
template (4) for the template torsion-angle features, giving 128 rows in the Evoformer.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from scalefold.data import transforms as T
from scalefold.data.transforms.msa import Features
from scalefold.data.transforms.schema import INTEGER_FEATURES

TRAIN, EVAL = "train", "eval"


@dataclass
class FeatureConfig:
    """Data-pipeline hyper-parameters (names as the reference ``AlphaFoldConfig`` keys)."""

    train_sequence_crop_size: int = 256
    max_msa_clusters: int = 124
    max_extra_msa: int = 1024
    templates_enabled: bool = True
    max_templates: int = 4
    shuffle_top_k_prefiltered: int = 20
    embed_template_torsion_angles: bool = True
    num_recycling_iters: int = 3
    masked_msa_enabled: bool = True
    masked_msa_profile_prob: float = 0.1
    masked_msa_same_prob: float = 0.1
    masked_msa_uniform_prob: float = 0.1
    masked_msa_replace_fraction: float = 0.15
    msa_cluster_features: bool = True
    max_distillation_msa_clusters: int = 1000
    use_clamped_fape_probability: float = 0.9
    # Hamming-agreement weight of gaps when assigning extra sequences to clusters.
    gap_agreement_weight: float = 0.0
    # MSA block deletion (Supplementary 1.2.7): defined but not applied by the MLPerf reference.
    msa_block_deletion: bool = False
    msa_fraction_per_block: float = 0.3
    msa_num_blocks: int = 5
    msa_randomize_num_blocks: bool = True

    @classmethod
    def mlperf(cls) -> FeatureConfig:
        """The MLPerf HPC closed-division values (crop 256, 124 clusters, 1024 extra, 4 templates)."""
        return cls()

    @classmethod
    def tiny(cls) -> FeatureConfig:
        """A laptop-sized configuration for tests and demos."""
        return cls(
            train_sequence_crop_size=24, max_msa_clusters=8, max_extra_msa=16, max_templates=2, num_recycling_iters=1
        )

    @classmethod
    def from_reference_config(cls, config: Mapping[str, Any], **overrides: Any) -> FeatureConfig:
        """Pick this dataclass's fields out of a reference ``AlphaFoldConfig`` dict."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names}
        values.update(overrides)
        return cls(**values)

    @property
    def num_ensembles(self) -> int:
        """Size ``R`` of the trailing recycling dimension."""
        return self.num_recycling_iters + 1


# ---------------------------------------------------------------------------------------------
# Raw features -> tensors
# ---------------------------------------------------------------------------------------------


def _tensor(x: Any) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
    if t.is_floating_point():
        return t.to(torch.float32)
    if t.dtype == torch.bool:
        return t.to(torch.float32)
    return t.to(torch.int64)


def _scalar(x: Any) -> torch.Tensor:
    return _tensor(x).reshape(-1)[0]


def raw_features_to_tensors(raw: Mapping[str, Any], mode: str, templates_enabled: bool = True) -> Features:
    """Select and convert the raw features the pipeline reads (float32 / int64 tensors)."""
    aatype = _tensor(raw["aatype"])
    if aatype.dim() == 2:  # one-hot [N, 21]
        aatype = torch.argmax(aatype, dim=-1)
    num_res = aatype.shape[0]
    feats: Features = {
        "aatype": aatype,
        "residue_index": _tensor(raw["residue_index"]) if "residue_index" in raw else torch.arange(num_res),
        "seq_length": _scalar(raw["seq_length"]) if "seq_length" in raw else torch.tensor(num_res),
        "between_segment_residues": _tensor(raw.get("between_segment_residues", np.zeros(num_res, np.int64))),
    }
    if "msa" in raw:
        feats["msa"] = _tensor(raw["msa"])
        deletions = raw["deletion_matrix_int"] if "deletion_matrix_int" in raw else raw["deletion_matrix"]
        feats["deletion_matrix"] = _tensor(deletions).to(torch.float32)
    else:  # single-sequence MSA: the query itself (our order -> HHblits order)
        to_hhblits = torch.tensor(
            [T.msa.rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE.index(i) for i in range(22)], dtype=torch.int64
        )
        feats["msa"] = to_hhblits[aatype][None]
        feats["deletion_matrix"] = torch.zeros(1, num_res)

    if templates_enabled:
        mask_key = "template_all_atom_mask" if "template_all_atom_mask" in raw else "template_all_atom_masks"
        if "template_aatype" in raw and len(raw["template_aatype"]) > 0:
            feats["template_aatype"] = _tensor(raw["template_aatype"])
            feats["template_all_atom_positions"] = _tensor(raw["template_all_atom_positions"])
            feats["template_all_atom_mask"] = _tensor(raw[mask_key])
            num_templ = feats["template_aatype"].shape[0]
            feats["template_sum_probs"] = _tensor(raw.get("template_sum_probs", np.zeros((num_templ, 1)))).reshape(
                num_templ, 1
            )
        else:
            feats["template_aatype"] = torch.zeros(0, num_res, dtype=torch.int64)
            feats["template_all_atom_positions"] = torch.zeros(0, num_res, 37, 3)
            feats["template_all_atom_mask"] = torch.zeros(0, num_res, 37)
            feats["template_sum_probs"] = torch.zeros(0, 1)

    if mode in (TRAIN, EVAL):
        feats["all_atom_positions"] = _tensor(raw["all_atom_positions"])
        feats["all_atom_mask"] = _tensor(raw["all_atom_mask"])
        resolution = raw.get("resolution")
        feats["resolution"] = torch.tensor(0.0) if resolution is None else _scalar(resolution).to(torch.float32)
        feats["is_distillation"] = _scalar(raw.get("is_distillation", 0.0)).to(torch.float32)
    return feats


# ---------------------------------------------------------------------------------------------
# Processing
# ---------------------------------------------------------------------------------------------


def _nonensembled(feats: Features, cfg: FeatureConfig, mode: str) -> Features:
    """Transforms applied once per sample (before the per-recycling ensembles)."""
    feats = T.correct_msa_restypes(feats)
    feats["seq_mask"] = torch.ones(feats["aatype"].shape, dtype=torch.float32)
    feats = T.make_msa_mask(feats)
    feats = T.make_hhblits_profile(feats)
    if cfg.templates_enabled:
        feats = T.fix_templates_aatype(feats)
        feats = T.make_template_mask(feats)
        templ = T.template_structure_features(
            feats["template_aatype"], feats["template_all_atom_positions"], feats["template_all_atom_mask"]
        )
        feats["template_pseudo_beta"] = templ["template_pseudo_beta"]
        feats["template_pseudo_beta_mask"] = templ["template_pseudo_beta_mask"]
        if cfg.embed_template_torsion_angles:
            for key in (
                "template_torsion_angles_sin_cos",
                "template_alt_torsion_angles_sin_cos",
                "template_torsion_angles_mask",
            ):
                feats[key] = templ[key]
    feats.update(T.atom14_masks(feats["aatype"]))
    if mode in (TRAIN, EVAL):
        feats.update(T.structure_features(feats["aatype"], feats["all_atom_positions"], feats["all_atom_mask"]))
    return feats


def _ensemble(feats: Features, cfg: FeatureConfig, mode: str, seed: int, iteration: int, crop_size: int) -> Features:
    """One recycling iteration's sample: MSA sampling/masking/clustering, crop, padding."""
    feats = dict(feats)  # transforms replace entries, never modify tensors in place
    ensemble_seed = seed + iteration
    if cfg.msa_block_deletion and mode == TRAIN:
        feats = T.block_delete_msa(
            feats,
            cfg.msa_fraction_per_block,
            cfg.msa_num_blocks,
            cfg.msa_randomize_num_blocks,
            T.make_generator(ensemble_seed),
        )
    if mode == TRAIN and float(feats["is_distillation"]) == 1.0:
        feats = T.sample_msa(
            feats, cfg.max_distillation_msa_clusters, T.make_generator(ensemble_seed), keep_extra=False
        )
    feats = T.sample_msa(feats, cfg.max_msa_clusters, T.make_generator(ensemble_seed), keep_extra=True)
    if cfg.masked_msa_enabled:
        # Masking comes before clustering so cluster profiles do not leak the masked residues.
        feats = T.make_masked_msa(
            feats,
            cfg.masked_msa_profile_prob,
            cfg.masked_msa_same_prob,
            cfg.masked_msa_uniform_prob,
            cfg.masked_msa_replace_fraction,
            T.make_generator(ensemble_seed),
        )
    if cfg.msa_cluster_features:
        feats = T.nearest_neighbor_clusters(feats, cfg.gap_agreement_weight)
        feats = T.summarize_clusters(feats)
    if cfg.max_extra_msa:
        feats = T.crop_extra_msa(feats, cfg.max_extra_msa, T.make_generator(ensemble_seed))
    else:
        feats = T.msa.delete_extra_msa(feats)
    feats = T.make_msa_feat(feats)
    feats = T.filter_features(feats)
    feats = T.random_crop_and_subsample_templates(
        feats, crop_size, cfg.max_templates, subsample_templates=(mode == TRAIN), generator=T.make_generator(seed)
    )
    sizes = T.schema_sizes(crop_size, cfg.max_msa_clusters, cfg.max_extra_msa, cfg.max_templates)
    return T.pad_to_schema(feats, sizes)


def process_features(raw: Mapping[str, Any], cfg: FeatureConfig, mode: str, seed: int) -> Features:
    """Raw features -> sample dict (no batch dim; trailing recycling dim ``R``)."""
    if mode not in (TRAIN, EVAL):
        raise ValueError(f"mode must be {TRAIN!r} or {EVAL!r}, got {mode!r}")
    feats = raw_features_to_tensors(raw, mode, cfg.templates_enabled)
    crop_size = cfg.train_sequence_crop_size if mode == TRAIN else int(feats["seq_length"])
    feats = _nonensembled(feats, cfg, mode)
    ensembles = [_ensemble(feats, cfg, mode, seed, i, crop_size) for i in range(cfg.num_ensembles)]
    sample = {key: torch.stack([e[key] for e in ensembles], dim=-1) for key in ensembles[0]}
    if mode == TRAIN:
        use_clamped = sample_use_clamped_fape(seed, cfg.use_clamped_fape_probability)
        sample["use_clamped_fape"] = torch.full((cfg.num_ensembles,), use_clamped, dtype=torch.float32)
    for key, value in sample.items():
        sample[key] = value.to(torch.int64 if key in INTEGER_FEATURES else torch.float32)
    return sample


def sample_use_clamped_fape(seed: int, probability: float) -> float:
    """1.0 with probability ``probability`` (per sample, from ``random.Random(seed)``), else 0.0."""
    return float(random.Random(seed).uniform(0, 1) < probability)


def process_training_features(raw: Mapping[str, Any], cfg: FeatureConfig, seed: int) -> Features:
    """A training sample: cropped to ``train_sequence_crop_size``, templates subsampled, padded to
    fixed shapes, ``use_clamped_fape`` drawn with probability ``use_clamped_fape_probability``.
    Deterministic in ``seed`` (the sampler's ``(index, seed)`` pair picks raw features and seed)."""
    return process_features(raw, cfg, TRAIN, seed)


def process_validation_features(raw: Mapping[str, Any], cfg: FeatureConfig, seed: int = 0) -> Features:
    """A validation sample: the full chain (no crop, ``N_res`` = chain length), top templates in
    order. The reference seeds each target with :func:`validation_seed` of its chain id."""
    return process_features(raw, cfg, EVAL, seed)


def validation_seed(chain_id: str) -> int:
    """The reference's fixed per-target seed: ``random.Random(chain_id).getrandbits(64)``."""
    return random.Random(chain_id).getrandbits(64)


# ---------------------------------------------------------------------------------------------
# Training-set filters and sampling weights (Supplementary 1.2.5)
# ---------------------------------------------------------------------------------------------

UNKNOWN_CLUSTER = -1


@dataclass
class TrainingChainFilter:
    """Which PDB chains enter the training set (MLPerf: 594,595 chains)."""

    min_release_date: str = "1900-01-01"
    max_release_date: str = "2021-09-16"
    max_resolution: float = 9.0
    max_aa_frequency: float = 0.8

    def keep(self, release_date: Any, resolution: float | None, sequence: str, cluster_id: int | None) -> bool:
        """True if one chain passes every filter."""
        date = _date_string(release_date)
        if not (self.min_release_date <= date <= self.max_release_date):
            return False
        if resolution is not None and not math.isnan(float(resolution)) and not float(resolution) < self.max_resolution:
            return False
        if not aa_frequency_acceptable(sequence, self.max_aa_frequency):
            return False
        return cluster_id is not None and int(cluster_id) != UNKNOWN_CLUSTER

    def mask(
        self,
        release_dates: Sequence[Any],
        resolutions: Sequence[float | None],
        sequences: Sequence[str],
        cluster_ids: Sequence[int | None],
    ) -> np.ndarray:
        """Boolean keep-mask over a chain table given as columns."""
        return np.array(
            [self.keep(*row) for row in zip(release_dates, resolutions, sequences, cluster_ids)], dtype=bool
        ).reshape(-1)


def _date_string(date: Any) -> str:
    if isinstance(date, (datetime.date, datetime.datetime)):
        return date.strftime("%Y-%m-%d")
    if isinstance(date, bytes):
        date = date.decode()
    return str(date)[:10]


def aa_frequency_acceptable(sequence: str, max_aa_frequency: float = 0.8) -> bool:
    """The most frequent residue makes up at most ``max_aa_frequency`` of the sequence."""
    if not sequence:
        return False
    return Counter(sequence).most_common(1)[0][1] / len(sequence) <= max_aa_frequency


def cluster_sizes(cluster_ids: Iterable[int | None]) -> np.ndarray:
    """Number of chains in each chain's cluster (within the given table); 0 for unknown clusters."""
    ids = [UNKNOWN_CLUSTER if c is None else int(c) for c in cluster_ids]
    counts = Counter(ids)
    return np.array([0 if c == UNKNOWN_CLUSTER else counts[c] for c in ids], dtype=np.int64)


def sampling_weights(
    sequence_lengths: Sequence[int],
    cluster_ids: Sequence[int | None],
    min_length: int = 256,
    max_length: int = 512,
) -> np.ndarray:
    """Per-chain sampling weight ``max(min(L, 512), 256) / 512 / sqrt(cluster_size)`` (float64).

    Cluster sizes are counted within the given (already filtered) table; a chain without a
    cluster gets factor 1. Samplers draw ``(index, seed)`` pairs multinomially with replacement.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.float64).reshape(-1)
    length_factor = np.maximum(np.minimum(lengths, max_length), min_length) / max_length
    sizes = cluster_sizes(cluster_ids).astype(np.float64)
    cluster_factor = np.where(sizes > 0, 1.0 / np.sqrt(np.maximum(sizes, 1.0)), 1.0)
    return length_factor * cluster_factor
