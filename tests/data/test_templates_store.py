"""Template features in the training path: precomputed at preprocessing time, stored, selected per sample.

The reference (``TemplateHitFeaturizer.get_templates``: prefilter, rank, shuffle the top 20 with
the sample's seed, featurise until 4 templates) and the stored path (``assess_hits`` once, the
store, ``select_templates`` per sample) must give identical features, on the real query of
``shared/data`` whose hits point at real mmCIF files.
"""

from __future__ import annotations

import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from scalefold import residue_constants as rc
from scalefold.data.dataset import StoreSample
from scalefold.data.pipeline import FeatureConfig, process_training_features, process_validation_features
from scalefold.data.preprocess import scan_template_entries
from scalefold.data.raw_features import build_raw_features, read_alignment_dir
from scalefold.data.store import Store, StoreSchemaError
from scalefold.data.templates import (
    STAGE_OK,
    STAGE_PREFILTER,
    TemplateHitFeaturizer,
    order_prefiltered_hits,
    select_templates,
    template_cutoff,
)

QUERY_CHAIN = "9qry_A"  # a made-up chain id for the real query (no PDB entry of its own)
TEMPLATE_KEYS = ("template_aatype", "template_all_atom_positions", "template_all_atom_masks", "template_sum_probs")
BATCH_TEMPLATE_KEYS = ("template_aatype", "template_all_atom_positions", "template_all_atom_mask", "template_sum_probs")
SMALL = FeatureConfig(train_sequence_crop_size=48, max_msa_clusters=8, max_extra_msa=32, num_recycling_iters=1)


def test_order_prefiltered_hits_shuffles_only_top_k_deterministically():
    """Training: hits ranked by sum_probs, the top k shuffled with random.Random(seed), the rest
    kept in rank order; validation (k=None) keeps the ranking. Same seed -> same order."""
    hits = [(f"h{i}", float(p)) for i, p in enumerate(random.Random(0).sample(range(100), 30))]
    ranked = sorted(hits, key=lambda h: h[1], reverse=True)
    assert order_prefiltered_hits(hits, lambda h: h[1], None, 5) == ranked
    a = order_prefiltered_hits(hits, lambda h: h[1], 20, seed=7)
    b = order_prefiltered_hits(hits, lambda h: h[1], 20, seed=7)
    c = order_prefiltered_hits(hits, lambda h: h[1], 20, seed=8)
    assert a == b and a != c
    assert sorted(a[:20]) == sorted(ranked[:20]) and a[20:] == ranked[20:]


@pytest.fixture(scope="module")
def query(data_dir: Path):
    """The real 73-residue query: sequence, MSAs and its 10 HHsearch hits."""
    directory = data_dir / "alignments" / "query"
    sequence = (directory / "query.fasta").read_text().splitlines()[1].strip()
    msas, hits = read_alignment_dir(directory)
    return sequence, msas, hits


def _featurizer(data_dir: Path, max_hits: int) -> TemplateHitFeaturizer:
    """What ``scalefold preprocess`` builds: release dates and chain ids scanned from the mmCIF dir."""
    release_dates, chain_ids = _scan(data_dir)
    return TemplateHitFeaturizer(
        data_dir / "mmcif", "9999-12-31", max_hits=max_hits, release_dates=release_dates, allowed_chain_ids=chain_ids
    )


_SCANS: dict[Path, tuple] = {}


def _scan(data_dir: Path) -> tuple:
    if data_dir not in _SCANS:
        _SCANS[data_dir] = scan_template_entries(data_dir / "mmcif")
    return _SCANS[data_dir]


def _assert_same_templates(got: dict, expected: dict) -> None:
    assert list(got["template_domain_names"]) == list(expected["template_domain_names"])
    for key in (*TEMPLATE_KEYS, "template_sequence"):
        assert got[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


@pytest.mark.parametrize("release_date", ["2021-06-01", "2014-01-01"])
def test_select_templates_equals_reference_featurizer(data_dir, query, release_date):
    """For every seed (training) and without shuffle (validation), templates chosen from the
    precomputed outcomes equal the featurizer's own top-20-shuffle-then-4 result; templates
    released after the query date minus 60 days never appear."""
    sequence, _, hits = query
    cutoff = template_cutoff(release_date)
    reference = _featurizer(data_dir, max_hits=4)
    outcomes = _featurizer(data_dir, max_hits=1 << 30).assess_hits(sequence, hits, max_template_date=cutoff)
    assert len(outcomes) == len(hits)
    ok = [o.template.domain_name for o in outcomes if o.stage == STAGE_OK]
    assert len(ok) >= 4
    late = {o.reason for o in outcomes if o.stage == STAGE_PREFILTER}
    assert ("released_after_cutoff" in late) == (release_date == "2014-01-01")

    chosen = set()
    for seed in range(12):
        got = select_templates(outcomes, len(sequence), 4, shuffle_top_k=20, shuffling_seed=seed)
        expected = reference.get_templates(
            sequence, hits, max_template_date=cutoff, shuffle_top_k=20, shuffling_seed=seed
        ).features
        _assert_same_templates(got, expected)
        chosen.add(tuple(got["template_domain_names"]))
    assert len(chosen) > 1  # the seed matters (which 4 are kept, or their order)
    got = select_templates(outcomes, len(sequence), 4)
    _assert_same_templates(got, reference.get_templates(sequence, hits, max_template_date=cutoff).features)
    if release_date == "2014-01-01":
        dates = {"4zey": "2015-05-06", "5kc1": "2016-10-05"}  # released after the cutoff
        assert not any(name.split("_")[0] in dates for name in ok)


def _structure(sequence: str) -> tuple[np.ndarray, np.ndarray]:
    """Stand-in coordinates for the query (it has no PDB entry); only the templates are compared."""
    rng = np.random.default_rng(0)
    aatype = np.array([rc.restype_order.get(a, rc.restype_num) for a in sequence])
    mask = rc.restype_atom37_mask[aatype].astype(np.float32)  # [N, 37]
    positions = (rng.normal(size=(len(sequence), 37, 3)) * 3 + np.arange(len(sequence))[:, None, None] * 3.8) * mask[
        ..., None
    ]
    return positions.astype(np.float32), mask


@pytest.fixture(scope="module")
def query_store(data_dir, query, tmp_path_factory):
    """A store holding the real query with its MSA, hits and precomputed template structures."""
    sequence, msas, hits = query
    release_date = "2021-06-01"
    outcomes = _featurizer(data_dir, max_hits=1 << 30).assess_hits(
        sequence, hits, query_pdb_id="9qry", max_template_date=template_cutoff(release_date)
    )
    raw = build_raw_features(sequence, QUERY_CHAIN, msas)
    positions, mask = _structure(sequence)
    path = tmp_path_factory.mktemp("templates") / "query.h5"
    with Store.create(path) as writer:
        writer.add_chain(
            QUERY_CHAIN,
            sequence=sequence,
            all_atom_positions=positions,
            all_atom_mask=mask,
            release_date=release_date,
            resolution=2.0,
            cluster_id=1,
            msa=raw["msa"],
            deletion_matrix=raw["deletion_matrix_int"],
            template_hits=hits,
            template_outcomes=outcomes,
        )
    return path, release_date


def test_store_round_trips_template_outcomes(data_dir, query, query_store):
    """Outcomes read back from the store equal those computed (stage, reason, coordinates)."""
    sequence, _, hits = query
    path, release_date = query_store
    expected = _featurizer(data_dir, max_hits=1 << 30).assess_hits(
        sequence, hits, query_pdb_id="9qry", max_template_date=template_cutoff(release_date)
    )
    with Store.open(path) as store:
        got = store.get(QUERY_CHAIN)["template_outcomes"]
    assert [(o.stage, o.reason, o.sum_probs) for o in got] == [(o.stage, o.reason, o.sum_probs) for o in expected]
    for a, b in zip(got, expected):
        if b.template is None:
            assert a.template is None
            continue
        assert a.template.domain_name == b.template.domain_name and a.template.residues == b.template.residues
        np.testing.assert_array_equal(a.template.query_index, b.template.query_index)
        np.testing.assert_array_equal(a.template.all_atom_positions, b.template.all_atom_positions)
        np.testing.assert_array_equal(a.template.all_atom_mask, b.template.all_atom_mask)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_training_batch_templates_equal_direct_raw_pipeline(data_dir, query, query_store, mode):
    """A StoreSample batch equals the direct raw pipeline (hhr + mmCIF dir + featurizer with the
    query's cutoff, the top-20 shuffle seeded with the sample seed, max 4 templates): template
    aatype / positions / mask / sum_probs and every other feature, exactly."""
    sequence, msas, hits = query
    path, release_date = query_store
    sample = StoreSample(str(path), [QUERY_CHAIN], SMALL, mode=mode)
    positions, mask = _structure(sequence)
    featurizer = _featurizer(data_dir, max_hits=SMALL.max_templates)
    seeds = (3, 11) if mode == "train" else (0,)
    for seed in seeds:
        batch = sample(0, seed)
        if mode == "eval":
            from scalefold.data.pipeline import validation_seed

            seed = validation_seed(QUERY_CHAIN)
        raw = build_raw_features(
            sequence,
            QUERY_CHAIN,
            msas,
            hits,
            featurizer,
            query_pdb_id="9qry",
            max_template_date=template_cutoff(release_date),
            shuffle_top_k=SMALL.shuffle_top_k_prefiltered if mode == "train" else None,
            shuffling_seed=seed,
        )
        assert len(raw["template_domain_names"]) == SMALL.max_templates
        raw.update(
            all_atom_positions=positions,
            all_atom_mask=mask,
            resolution=np.array([2.0], np.float32),
            is_distillation=np.array(0.0, np.float32),
        )
        process = process_training_features if mode == "train" else process_validation_features
        expected = process(raw, SMALL, seed)
        assert set(batch) == set(expected)
        for key in BATCH_TEMPLATE_KEYS:
            assert batch[key].shape[1:] == expected[key].shape
        assert float(batch["template_mask"].sum()) > 0  # templates really are present
        for key, value in expected.items():
            assert torch.equal(batch[key][0], value), key


def test_chain_with_unassessed_hits_fails_clearly(query, tmp_path):
    """Hits stored without template structures (no outcomes) give a clear error when sampled."""
    sequence, msas, hits = query
    positions, mask = _structure(sequence)
    path = tmp_path / "no_structures.h5"
    with Store.create(path) as writer:
        writer.add_chain(
            QUERY_CHAIN, sequence=sequence, all_atom_positions=positions, all_atom_mask=mask, template_hits=hits
        )
    with pytest.raises(ValueError, match="no precomputed template structure.*scalefold preprocess"):
        StoreSample(str(path), [QUERY_CHAIN], SMALL)(0, 1)


def test_schema_1_store_is_refused_with_its_meaning(tmp_path):
    """A store of the previous schema (hits without structures) is refused, saying why and what to do."""
    path = tmp_path / "old.h5"
    with Store.create(path) as writer:
        writer.add_chain(
            "1abc_A", sequence="AC", all_atom_positions=np.zeros((2, 37, 3)), all_atom_mask=np.zeros((2, 37))
        )
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 1
    with pytest.raises(StoreSchemaError, match=r"version 1 \(template hits without template structures\).*preprocess"):
        Store.open(path)
