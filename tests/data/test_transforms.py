"""Tests for ``scalefold.data.transforms``: geometry goldens, MSA/template/crop transforms."""

from __future__ import annotations

import pytest
import torch

from scalefold.data import transforms as T
from scalefold.data.transforms.msa import (
    MSA_NUM_CLASSES,
    hhblits_profile_reference,
    nearest_neighbor_clusters_reference,
)


def _last_slice(golden_small: dict) -> dict:
    """Golden batch without the batch dim, last recycling slice."""
    return {k: v[0, ..., -1] for k, v in golden_small["batch"].items()}


def _structure_features(batch: dict, dtype: torch.dtype) -> dict:
    return T.structure_features(
        batch["aatype"], batch["all_atom_positions"].to(dtype), batch["all_atom_mask"].to(dtype)
    )


def test_structure_features_match_reference_golden(golden_small):
    """atom14 maps/ground truth, rigid-group frames, backbone frames, pseudo-beta and chi angles
    recomputed from aatype + atom37 equal the reference pipeline's tensors (<= 1e-5, float32)
    at the unpadded residues."""
    batch = _last_slice(golden_small)
    num_res = int(batch["seq_length"])
    feats = _structure_features(batch, torch.float32)
    expected_keys = {
        "atom14_atom_exists", "residx_atom14_to_atom37", "residx_atom37_to_atom14", "atom37_atom_exists",
        "atom14_gt_exists", "atom14_gt_positions", "atom14_alt_gt_positions", "atom14_alt_gt_exists",
        "atom14_atom_is_ambiguous", "rigidgroups_gt_frames", "rigidgroups_alt_gt_frames", "rigidgroups_gt_exists",
        "rigidgroups_group_exists", "rigidgroups_group_is_ambiguous", "backbone_rigid_tensor",
        "backbone_rigid_mask", "pseudo_beta", "pseudo_beta_mask", "chi_angles_sin_cos", "chi_mask",
    }  # fmt: skip
    assert set(feats) == expected_keys
    for key, value in feats.items():
        ref = batch[key]
        assert value.shape == ref.shape, key
        assert value.dtype == ref.dtype, key
        torch.testing.assert_close(value[:num_res], ref[:num_res], atol=1e-5, rtol=0, msg=key)


def test_template_features_match_reference_golden(golden_small):
    """Template torsion angles (sin/cos, alternative, mask) and pseudo-beta recomputed from the
    template aatype/atom37 equal the reference's (<= 1e-5) at unpadded residues. Torsions with a
    degenerate frame (the first residue's pre-omega, built on the zero pad) are rounding noise in
    both implementations: they must be masked, finite and of norm <= 1, not equal."""
    batch = _last_slice(golden_small)
    num_res = int(batch["seq_length"])
    aatype, positions, mask = (
        batch["template_aatype"], batch["template_all_atom_positions"], batch["template_all_atom_mask"]
    )  # fmt: skip
    feats = T.template_structure_features(aatype, positions, mask)
    degenerate = T.degenerate_torsion_frames(T.torsion_atoms(aatype, positions, mask)[0])[:, :num_res]
    assert degenerate[:, 0, 0].all()  # the chain start's pre-omega
    assert not degenerate[feats["template_torsion_angles_mask"][:, :num_res] > 0].any()
    for key, value in feats.items():
        value, ref = value[:, :num_res], batch[key][:, :num_res]
        if key.endswith("sin_cos"):
            noise = value[degenerate]  # [K, 2]
            assert torch.isfinite(noise).all() and (noise.norm(dim=-1) <= 1 + 1e-6).all(), key
            value, ref = value[~degenerate], ref[~degenerate]
        torch.testing.assert_close(value, ref, atol=1e-5, rtol=0, msg=key)


def test_degenerate_torsion_frame_is_rounding_noise(golden_small):
    """Why the comparison above skips degenerate frames: moving one backbone coordinate of the
    first template residue by a single float32 ulp changes its pre-omega (sin, cos) to a
    different unit vector, while every well-defined torsion moves by < 1e-5."""
    batch = _last_slice(golden_small)
    aatype = batch["template_aatype"][1:2, :4]
    positions = batch["template_all_atom_positions"][1:2, :4].clone()
    mask = batch["template_all_atom_mask"][1:2, :4]
    degenerate = T.degenerate_torsion_frames(T.torsion_atoms(aatype, positions, mask)[0])
    base = T.torsion_angles(aatype, positions, mask)[0]
    outcomes = set()
    for atom in range(2):  # N, CA
        for axis in range(3):
            for direction in (-1.0, 1.0):
                moved = positions.clone()
                value = moved[0, 0, atom, axis]
                moved[0, 0, atom, axis] = torch.nextafter(value, value + direction)
                out = T.torsion_angles(aatype, moved, mask)[0]
                outcomes.add(tuple(round(v, 3) for v in out[0, 0, 0].tolist()))
                torch.testing.assert_close(out[~degenerate], base[~degenerate], atol=1e-5, rtol=0)
    assert len(outcomes) > 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_structure_features_follow_input_dtype(golden_small, dtype):
    """Geometry runs in float64 and bf16: floating outputs take the input dtype and stay close
    to the float32 result (float64: 1e-4; bf16: coarse, positions within 0.5 A)."""
    batch = _last_slice(golden_small)
    num_res = int(batch["seq_length"])
    ref = _structure_features(batch, torch.float32)
    out = _structure_features(batch, dtype)
    for key, value in out.items():
        if ref[key].is_floating_point():
            assert value.dtype == dtype, key
    tol = 1e-4 if dtype == torch.float64 else 0.5
    for key in ("atom14_gt_positions", "pseudo_beta", "backbone_rigid_tensor"):
        torch.testing.assert_close(out[key][:num_res].float(), ref[key][:num_res], atol=tol, rtol=0, msg=key)
    if dtype == torch.float64:
        torch.testing.assert_close(
            out["chi_angles_sin_cos"][:num_res].float(), ref["chi_angles_sin_cos"][:num_res], atol=1e-4, rtol=0
        )


def test_frames_are_rotations(golden_small):
    """Ground-truth frames that exist are proper rotations (R R^T = I, det = +1)."""
    batch = _last_slice(golden_small)
    feats = _structure_features(batch, torch.float64)
    exists = feats["rigidgroups_gt_exists"].bool()
    rot = feats["rigidgroups_gt_frames"][..., :3, :3][exists]
    eye = torch.eye(3, dtype=rot.dtype).expand_as(rot)
    torch.testing.assert_close(rot @ rot.transpose(-1, -2), eye, atol=1e-6, rtol=0)  # eps in the norms
    torch.testing.assert_close(torch.linalg.det(rot), torch.ones(rot.shape[0], dtype=rot.dtype), atol=1e-6, rtol=0)


def _random_msa_feats(num_seq: int, num_res: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    msa = torch.randint(0, MSA_NUM_CLASSES, (num_seq, num_res), generator=g)
    feats = {
        "msa": msa,
        "deletion_matrix": torch.randint(0, 4, (num_seq, num_res), generator=g).float(),
        "aatype": msa[0].clamp(max=20),
        "between_segment_residues": torch.zeros(num_res, dtype=torch.long),
    }
    feats = T.make_msa_mask(feats)
    return T.make_hhblits_profile(feats)


def test_masked_msa_fractions_are_statistically_sane():
    """On a large random MSA ~15 % of positions are selected for BERT masking; of those ~70 % get
    the [MASK] token; unselected positions are unchanged and ``true_msa`` is the original."""
    feats = _random_msa_feats(400, 100)
    original = feats["msa"].clone()
    out = T.make_masked_msa(dict(feats), 0.1, 0.1, 0.1, 0.15, T.make_generator(3))
    bert_mask = out["bert_mask"].bool()
    assert torch.equal(out["true_msa"], original)
    assert torch.equal(out["msa"][~bert_mask], original[~bert_mask])
    assert abs(bert_mask.float().mean().item() - 0.15) < 0.01
    masked_token = (out["msa"][bert_mask] == 22).float().mean().item()
    assert abs(masked_token - 0.7) < 0.03
    unchanged = (out["msa"][bert_mask] == original[bert_mask]).float().mean().item()
    assert 0.1 < unchanged < 0.2  # "same" 10 % plus chance hits of the uniform/profile draws


def test_sample_msa_keeps_query_and_partitions_rows():
    """Cluster sampling keeps the query as row 0; selected + extra rows are a permutation of the MSA."""
    feats = _random_msa_feats(30, 12)
    out = T.sample_msa(dict(feats), 8, T.make_generator(1))
    assert torch.equal(out["msa"][0], feats["msa"][0])
    assert out["msa"].shape[0] == 8 and out["extra_msa"].shape[0] == 22
    rows = torch.cat([out["msa"], out["extra_msa"]])
    as_set = sorted(map(tuple, rows.tolist()))
    assert as_set == sorted(map(tuple, feats["msa"].tolist()))


def test_clustering_assigns_extra_rows_to_most_similar_centre():
    """An extra sequence identical to a cluster centre joins that cluster; cluster profiles are
    distributions over the 23 classes wherever the cluster has residues."""
    feats = _random_msa_feats(20, 15)
    feats = T.sample_msa(feats, 5, T.make_generator(2))
    feats["extra_msa"][0] = feats["msa"][3]
    feats = T.nearest_neighbor_clusters(feats)
    assert int(feats["extra_cluster_assignment"][0]) == 3
    feats = T.summarize_clusters(feats)
    torch.testing.assert_close(feats["cluster_profile"].sum(-1), torch.ones(5, 15), atol=1e-5, rtol=0)
    feats = T.make_msa_feat(feats)
    assert feats["msa_feat"].shape == (5, 15, 49)
    assert feats["target_feat"].shape == (15, 22)


@pytest.mark.parametrize(
    ("num_clusters", "num_extra", "num_res", "gap_weight"),
    [(124, 900, 64, 0.0), (8, 50, 13, 1.0), (5, 200, 30, 0.5), (4, 0, 10, 0.0)],
)
def test_cluster_assignment_fast_path_equals_one_hot_reference(num_clusters, num_extra, num_res, gap_weight):
    """The embedding-bag cluster assignment equals the one-hot matmul reference (masked centres
    with [MASK] tokens, masked extra rows, ties to the lowest centre; gaps weighted or not)."""
    g = torch.Generator().manual_seed(num_extra)
    feats = {
        "msa": torch.randint(0, 23, (num_clusters, num_res), generator=g),
        "msa_mask": (torch.rand(num_clusters, num_res, generator=g) > 0.1).float(),
        "extra_msa": torch.randint(0, 22, (num_extra, num_res), generator=g),
        "extra_msa_mask": (torch.rand(num_extra, num_res, generator=g) > 0.1).float(),
    }
    feats["msa"][1] = feats["msa"][0]  # identical centres: ties must go to the first
    fast = T.nearest_neighbor_clusters(dict(feats), gap_weight)["extra_cluster_assignment"]
    reference = nearest_neighbor_clusters_reference(dict(feats), gap_weight)["extra_cluster_assignment"]
    assert fast.dtype == torch.int64 and torch.equal(fast, reference)
    if num_extra:
        assert fast.unique().numel() > 1


@pytest.mark.parametrize(("num_seq", "num_res"), [(1, 7), (37, 11), (3000, 64)])
def test_hhblits_profile_bincount_equals_one_hot_mean(num_seq, num_res):
    """The bincount profile equals the mean one-hot of the MSA bit for bit."""
    msa = torch.randint(0, MSA_NUM_CLASSES, (num_seq, num_res), generator=torch.Generator().manual_seed(num_seq))
    fast = T.make_hhblits_profile({"msa": msa})["hhblits_profile"]
    assert fast.dtype == torch.float32 and torch.equal(fast, hhblits_profile_reference(msa))


def test_block_deletion_keeps_query():
    """MSA block deletion (optional, off in MLPerf) never removes the query row."""
    feats = _random_msa_feats(50, 10)
    out = T.block_delete_msa(dict(feats), 0.3, 5, False, T.make_generator(0))
    assert torch.equal(out["msa"][0], feats["msa"][0])
    assert out["msa"].shape[0] < 50 and out["msa_mask"].shape[0] == out["msa"].shape[0]


def test_crop_and_pad_window_and_zero_padding():
    """The crop takes one contiguous window of ``crop`` residues for every N_res feature; padding
    adds zeros up to the fixed sizes."""
    num_res, crop = 40, 16
    feats = {
        "aatype": torch.arange(num_res) % 20,
        "residue_index": torch.arange(num_res),
        "seq_length": torch.tensor(num_res),
        "seq_mask": torch.ones(num_res),
        "msa_mask": torch.ones(3, num_res),
        "msa_row_mask": torch.ones(3),
        "template_mask": torch.ones(3),
        "template_aatype": torch.arange(3)[:, None].expand(3, num_res).clone(),
    }
    out = T.random_crop_and_subsample_templates(dict(feats), crop, 2, True, T.make_generator(5))
    start = int(out["residue_index"][0])
    assert torch.equal(out["residue_index"], torch.arange(start, start + crop))
    assert out["msa_mask"].shape == (3, crop) and int(out["seq_length"]) == crop
    assert out["template_mask"].shape[0] <= 2
    padded = T.pad_to_schema(out, T.schema_sizes(20, 5, 7, 2))
    assert padded["msa_mask"].shape == (5, 20)
    assert padded["msa_mask"][3:].abs().sum() == 0 and padded["seq_mask"][crop:].abs().sum() == 0


def test_schema_equals_reference_interface(reference_dir):
    """``FEATURE_SCHEMA`` lists exactly the reference batch's input features with their dtypes."""
    rows = [line.split("\t") for line in (reference_dir / "feature_shapes.tsv").read_text().splitlines()[1:]]
    inputs = {r[1]: r for r in rows if r[0] == "input"}
    assert set(inputs) == set(T.FEATURE_SCHEMA)
    for key, row in inputs.items():
        assert (row[4] == "int64") == (key in T.INTEGER_FEATURES), key
