"""Tests for ``scalefold.data.pipeline``: the processed sample equals the reference's batch and
interface; determinism; cropping/padding; validation features; filters and sampling weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scalefold import residue_constants as rc
from scalefold.data import transforms as T
from scalefold.data.pipeline import (
    FeatureConfig,
    TrainingChainFilter,
    aa_frequency_acceptable,
    cluster_sizes,
    process_training_features,
    process_validation_features,
    sample_use_clamped_fape,
    sampling_weights,
    validation_seed,
)
from scalefold.data.transforms import FEATURE_SCHEMA, make_generator
from scalefold.data.transforms.schema import N_CLUST, N_EXTRA_SEQ, N_RES, N_TEMPL

# Our residue index -> HHblits index (inverse of MAP_HHBLITS_AATYPE_TO_OUR_AATYPE).
OURS_TO_HHBLITS = torch.tensor([rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE.index(i) for i in range(22)])


def _raw_from_golden(golden_small: dict) -> dict:
    """Invert the reference pipeline on the golden batch: rebuild the raw MSA (row order recovered
    from the seeded permutations, deletion counts from the deletion-value channels) and raw
    template order, so that re-processing with the golden seed must reproduce the batch."""
    b = {k: v[0] for k, v in golden_small["batch"].items()}
    seed = golden_small["data"]["data_seed"]
    num_res = int(b["seq_length"][0])
    num_clusters = b["msa_row_mask"].shape[0]
    num_extra = int(b["extra_msa_row_mask"][:, 0].sum())
    num_seq = num_clusters + num_extra

    # sample_msa / crop_extra_msa draws of recycling iteration 0 (seed + 0).
    gen = make_generator(seed)
    order = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(num_seq - 1, generator=gen) + 1])
    selected, rest = order[:num_clusters], order[num_clusters:]
    extra_order = rest[torch.randperm(num_extra, generator=make_generator(seed))]

    def deletions(value: torch.Tensor) -> torch.Tensor:
        return torch.round(3 * torch.tan(value * math.pi / 2)).long()

    msa = torch.zeros(num_seq, num_res, dtype=torch.long)
    deletion = torch.zeros(num_seq, num_res, dtype=torch.long)
    msa[selected] = b["true_msa"][:, :num_res, 0]
    deletion[selected] = deletions(b["msa_feat"][:, :num_res, 24, 0])
    msa[extra_order] = b["extra_msa"][:num_extra, :num_res, 0]
    deletion[extra_order] = deletions(b["extra_deletion_value"][:num_extra, :num_res, 0])

    # Template subsampling draws (seed): start index, then permutation.
    gen = make_generator(seed)
    num_templ = b["template_mask"].shape[0]
    assert int(torch.randint(0, num_templ + 1, (1,), generator=gen)[0]) == 0
    perm = torch.randperm(num_templ, generator=gen)
    templ = {}
    for key in ("template_aatype", "template_all_atom_positions", "template_all_atom_mask", "template_sum_probs"):
        value = b[key][..., 0]
        raw_value = torch.empty_like(value)
        raw_value[perm] = value
        templ[key] = raw_value

    return {
        "aatype": torch.nn.functional.one_hot(b["aatype"][:num_res, 0], 21),
        "residue_index": torch.arange(num_res),
        "seq_length": torch.full((num_res,), num_res),
        "between_segment_residues": torch.zeros(num_res, dtype=torch.long),
        "msa": OURS_TO_HHBLITS[msa],
        "deletion_matrix_int": deletion,
        "template_aatype": torch.nn.functional.one_hot(OURS_TO_HHBLITS[templ["template_aatype"][:, :num_res]], 22),
        "template_all_atom_positions": templ["template_all_atom_positions"][:, :num_res],
        "template_all_atom_mask": templ["template_all_atom_mask"][:, :num_res],
        "template_sum_probs": templ["template_sum_probs"],
        "all_atom_positions": b["all_atom_positions"][:num_res, ..., 0],
        "all_atom_mask": b["all_atom_mask"][:num_res, ..., 0],
        "resolution": b["resolution"][:1],
        "is_distillation": torch.tensor(0.0),
    }


def test_training_sample_reproduces_reference_golden_batch(golden_small):
    """Processing the golden chain's raw features with the golden data seed reproduces the
    reference batch -- every key, shape and dtype of both recycling slices; integer and mask
    features (MSA sampling, BERT masking, clustering, crop, template subsampling, padding,
    use_clamped_fape) bit for bit, floating features to float32 rounding.

    Floating features are not compared bitwise: the golden was written on another machine, and
    float32 transcendental functions (``atan`` of the deletion features, the frame square roots)
    differ there in the last ulp at some positions. Torsions on a degenerate frame (the chain
    start's pre-omega) are rounding noise in both implementations and are skipped (see
    test_transforms::test_degenerate_torsion_frame_is_rounding_noise)."""
    raw = _raw_from_golden(golden_small)
    cfg = FeatureConfig.from_reference_config(golden_small["config"])
    sample = process_training_features(raw, cfg, seed=golden_small["data"]["data_seed"])
    golden = {k: v[0] for k, v in golden_small["batch"].items()}
    assert set(sample) == set(golden)
    num_used = golden["aatype"].shape[-1]
    templ_pos = golden["template_all_atom_positions"].movedim(-1, 0)  # [R, N_templ, N_res, 37, 3]
    templ_aatype = golden["template_aatype"].movedim(-1, 0)
    templ_mask = golden["template_all_atom_mask"].movedim(-1, 0)
    degenerate = T.degenerate_torsion_frames(T.torsion_atoms(templ_aatype, templ_pos, templ_mask)[0])
    degenerate = degenerate.movedim(0, -1)[..., None, :].expand(*degenerate.shape[1:], 2, degenerate.shape[0])
    assert degenerate.any() and not (degenerate[..., 0, :] & (golden["template_torsion_angles_mask"] > 0)).any()
    for key, ref in golden.items():
        value = sample[key][..., :num_used]
        assert value.shape == ref.shape and value.dtype == ref.dtype, key
        if key in ("template_torsion_angles_sin_cos", "template_alt_torsion_angles_sin_cos"):
            value, ref = value[~degenerate], ref[~degenerate]
        is_mask = key.endswith("mask") or key.endswith("exists") or key in ("bert_mask", "use_clamped_fape")
        if not ref.is_floating_point() or is_mask:
            torch.testing.assert_close(value, ref, atol=0, rtol=0, msg=key)
        else:
            torch.testing.assert_close(value, ref, atol=5e-6, rtol=1e-6, msg=key)


def test_feature_config_from_reference_config(golden_small):
    """``FeatureConfig`` reads the reference config's data keys; MLPerf defaults are 256/124/1024/4/3."""
    cfg = FeatureConfig.from_reference_config(golden_small["config"])
    assert (cfg.train_sequence_crop_size, cfg.max_msa_clusters, cfg.max_extra_msa, cfg.max_templates) == (24, 8, 16, 2)
    mlperf = FeatureConfig.mlperf()
    assert (mlperf.train_sequence_crop_size, mlperf.max_msa_clusters, mlperf.max_extra_msa) == (256, 124, 1024)
    assert (mlperf.max_templates, mlperf.num_recycling_iters, mlperf.num_ensembles) == (4, 3, 4)


@pytest.fixture(scope="module")
def query_raw(reference_dir) -> dict:
    """DeepMind's raw features of the 73-residue ``query`` (1136 MSA rows, 8 templates) plus a
    synthetic structure (the query has no experimental one)."""
    raw = dict(np.load(reference_dir / "alphafold_raw_features_query.npz"))
    num_res = raw["aatype"].shape[0]
    rng = np.random.default_rng(0)
    aatype = raw["aatype"].argmax(-1)
    raw["all_atom_positions"] = rng.normal(scale=10.0, size=(num_res, 37, 3)).astype(np.float32)
    raw["all_atom_mask"] = rc.STANDARD_ATOM_MASK[aatype].astype(np.float32)
    raw["resolution"] = np.array([2.0], dtype=np.float32)
    return raw


SMALL = FeatureConfig(
    train_sequence_crop_size=32, max_msa_clusters=8, max_extra_msa=16, max_templates=2, num_recycling_iters=2
)


def test_sample_matches_reference_interface(reference_dir, query_raw):
    """Every key of ``feature_shapes.tsv`` is present with its symbolic shape (at a small config)
    plus the trailing recycling dim R = num_recycling_iters + 1, and its dtype; nothing else."""
    sample = process_training_features(query_raw, SMALL, seed=11)
    sizes = {N_RES: 32, N_CLUST: 8, N_EXTRA_SEQ: 16, N_TEMPL: 2}
    rows = [line.split("\t") for line in (reference_dir / "feature_shapes.tsv").read_text().splitlines()[1:]]
    inputs = {r[1]: r for r in rows if r[0] == "input"}
    assert set(sample) == set(inputs)
    for key, row in inputs.items():
        dims = row[2].strip("[]").split(", ")
        assert dims[0] == "B" and dims[-1] == "R", key
        expected = tuple(sizes[d] if d in sizes else int(d) for d in dims[1:-1]) + (SMALL.num_recycling_iters + 1,)
        assert tuple(sample[key].shape) == expected, key
        assert str(sample[key].dtype) == f"torch.{row[4]}", key


def test_same_index_and_seed_give_identical_samples(query_raw):
    """(raw, seed) -> sample is deterministic; another seed changes the MSA sampling/masking;
    recycling slices differ from each other (per-iteration seeds) but share one crop window."""
    a = process_training_features(query_raw, SMALL, seed=123)
    b = process_training_features(query_raw, SMALL, seed=123)
    c = process_training_features(query_raw, SMALL, seed=124)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["msa_feat"], c["msa_feat"])
    assert not torch.equal(a["msa_feat"][..., 0], a["msa_feat"][..., 1])
    assert torch.equal(a["residue_index"][..., 0], a["residue_index"][..., 1])


def test_padding_never_leaks(query_raw):
    """A chain shorter than the crop: residue, MSA-row and template padding is all zeros and every
    mask is zero there."""
    cfg = FeatureConfig(
        train_sequence_crop_size=96, max_msa_clusters=8, max_extra_msa=16, max_templates=4, num_recycling_iters=1
    )
    sample = process_training_features(query_raw, cfg, seed=3)
    num_res = query_raw["aatype"].shape[0]
    assert torch.all(sample["seq_length"] == num_res)
    for key, schema in FEATURE_SCHEMA.items():
        if N_RES in schema:
            dim = schema.index(N_RES)
            padded = sample[key].narrow(dim, num_res, 96 - num_res)
            assert padded.abs().sum() == 0, key
    assert sample["seq_mask"][:num_res].min() == 1
    num_templ = sample["template_mask"].sum(0)
    for r in range(cfg.num_ensembles):
        n = int(num_templ[r])
        assert sample["template_all_atom_mask"][n:, ..., r].abs().sum() == 0
        assert sample["template_aatype"][n:, ..., r].abs().sum() == 0


def test_crop_length_and_contiguous_window(query_raw):
    """A chain longer than the crop yields exactly ``crop`` residues of one contiguous window."""
    cfg = FeatureConfig(
        train_sequence_crop_size=20, max_msa_clusters=4, max_extra_msa=8, max_templates=2, num_recycling_iters=1
    )
    for seed in (0, 1, 2):
        sample = process_training_features(query_raw, cfg, seed=seed)
        assert torch.all(sample["seq_length"] == 20)
        assert torch.all(sample["seq_mask"] == 1)
        idx = sample["residue_index"][:, 0]
        assert torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + 20))


def test_validation_features_full_chain_fixed_seed(query_raw):
    """Validation: no crop (N_res = chain length), top templates in order (no subsampling), no
    ``use_clamped_fape``; deterministic; the reference's per-target seed is a 64-bit hash."""
    cfg = FeatureConfig(max_msa_clusters=8, max_extra_msa=16, max_templates=4, num_recycling_iters=1)
    a = process_validation_features(query_raw, cfg, seed=validation_seed("7abc_A"))
    b = process_validation_features(query_raw, cfg, seed=validation_seed("7abc_A"))
    num_res = query_raw["aatype"].shape[0]
    assert a["aatype"].shape == (num_res, 2)
    assert "use_clamped_fape" not in a
    assert torch.all(a["template_mask"] == 1)  # 8 hits available, the first 4 kept
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert 0 <= validation_seed("7abc_A") < 2**64


def test_use_clamped_fape_probability():
    """``use_clamped_fape`` is 1 for ~90 % of seeds."""
    values = [sample_use_clamped_fape(seed, 0.9) for seed in range(4000)]
    assert abs(np.mean(values) - 0.9) < 0.02


def test_training_filters():
    """Release date <= cutoff, resolution < 9 A or missing, most frequent residue <= 80 %, known
    cluster: each rule rejects exactly its violators."""
    f = TrainingChainFilter()
    good = ("2020-01-01", 2.0, "ACDEFGHIK", 5)
    assert f.keep(*good)
    assert f.keep("2021-09-16", None, "ACDE", 1) and f.keep("2021-09-16", float("nan"), "ACDE", 1)
    assert not f.keep("2021-09-17", 2.0, "ACDE", 1)
    assert not f.keep("2020-01-01", 9.0, "ACDE", 1)
    assert not f.keep("2020-01-01", 2.0, "AAAAAAAAAC", 1)  # 90 % alanine
    assert f.keep("2020-01-01", 2.0, "AAAAAAAACC", 1)  # exactly 80 %
    assert not f.keep("2020-01-01", 2.0, "ACDE", -1) and not f.keep("2020-01-01", 2.0, "ACDE", None)
    assert not aa_frequency_acceptable("")
    mask = f.mask(["2020-01-01", "2022-01-01"], [1.0, 1.0], ["ACDE", "ACDE"], [1, 1])
    assert mask.tolist() == [True, False]


def test_sampling_weights():
    """weight = max(min(L, 512), 256) / 512 / sqrt(cluster size), sizes counted in the table."""
    lengths = [100, 300, 600, 300, 50]
    clusters = [1, 1, 2, 1, -1]
    assert cluster_sizes(clusters).tolist() == [3, 3, 1, 3, 0]
    w = sampling_weights(lengths, clusters)
    expected = [0.5 / math.sqrt(3), 300 / 512 / math.sqrt(3), 1.0, 300 / 512 / math.sqrt(3), 0.5]
    np.testing.assert_allclose(w, expected, rtol=1e-12)
    assert w.dtype == np.float64


def test_chain_without_templates_or_msa(query_raw):
    """A chain with no template hits and no MSA still yields the full interface: the MSA is the
    query alone, template features are all zeros with ``template_mask`` 0."""
    raw = {
        k: v for k, v in query_raw.items() if not k.startswith("template") and k not in ("msa", "deletion_matrix_int")
    }
    sample = process_training_features(raw, SMALL, seed=5)
    assert set(sample) == set(FEATURE_SCHEMA)
    assert sample["template_mask"].abs().sum() == 0 and sample["template_all_atom_positions"].abs().sum() == 0
    assert torch.all(sample["msa_row_mask"][0] == 1) and sample["msa_row_mask"][1:].abs().sum() == 0
    assert sample["extra_msa_row_mask"].abs().sum() == 0
    num_res = min(query_raw["aatype"].shape[0], 32)
    assert torch.equal(sample["true_msa"][0, :num_res], sample["aatype"][:num_res])
