"""Raw features (sequence, MSA, templates) against DeepMind's, plus unit tests of their pieces.

The golden file ``reference/alphafold_raw_features_query.npz`` holds AlphaFold's raw features for
``data/alignments/query``; its templates were featurised with every template mmCIF available,
while ``data/mmcif`` lacks 1hf9, so that template is dropped from the reference before comparing.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from scalefold import residue_constants as rc
from scalefold.data.parsers.hhr import TemplateHit
from scalefold.data.parsers.mmcif import MmcifChain, MmcifEntry
from scalefold.data.parsers.msa import Msa
from scalefold.data.raw_features import (
    build_raw_features,
    build_raw_features_from_alignment_dir,
    make_msa_features,
    make_sequence_features,
)
from scalefold.data.templates import (
    KalignAligner,
    OverlapAligner,
    TemplateFilter,
    TemplateHitFeaturizer,
    build_query_to_hit_mapping,
)

MISSING_TEMPLATE = "1hf9_B"  # its mmCIF is not in data/mmcif
MAX_TEMPLATE_DATE = "2021-09-16"
COORDINATE_TOLERANCE = 1e-3  # Å
INTEGER_KEYS = (
    "aatype", "between_segment_residues", "residue_index", "seq_length",
    "msa", "deletion_matrix_int", "num_alignments", "template_aatype", "template_all_atom_masks",
)  # fmt: skip
STRING_KEYS = ("domain_name", "sequence", "template_domain_names", "template_sequence")


# ----------------------------------------------------------------------------------------------
# golden: the real query


@pytest.fixture(scope="module")
def golden(reference_dir) -> dict:
    path = reference_dir / "alphafold_raw_features_query.npz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    reference = dict(np.load(path, allow_pickle=False))
    keep = [i for i, name in enumerate(reference["template_domain_names"]) if name != MISSING_TEMPLATE]
    for key in list(reference):
        if key.startswith("template_"):
            reference[key] = reference[key][keep]
    return reference


def _query_features(data_dir, aligner=None, zero_center=True):
    featurizer = TemplateHitFeaturizer(data_dir / "mmcif", MAX_TEMPLATE_DATE, aligner=aligner, zero_center=zero_center)
    return build_raw_features_from_alignment_dir(data_dir / "alignments" / "query", featurizer)


@pytest.mark.parametrize("aligner", ["default", "python"])
def test_golden_raw_features_match_alphafold(data_dir, golden, aligner):
    """Every raw feature of the query equals DeepMind's: integer/one-hot/string arrays exactly
    (same shape and dtype kind), template coordinates to 1e-3 Å -- with kalign (when on PATH) and
    with the pure-Python realignment fallback. DeepMind keeps templates in the deposited frame
    (``zero_center=False``) and stores ``template_aatype`` as float32 one-hot (the MLPerf reference
    and ScaleFold: int32, same values)."""
    features = _query_features(data_dir, OverlapAligner() if aligner == "python" else None, zero_center=False)
    assert set(features) == set(golden)
    for key in INTEGER_KEYS + STRING_KEYS + ("template_sum_probs",):
        assert features[key].shape == golden[key].shape, key
        if key != "template_aatype":
            assert features[key].dtype.kind == golden[key].dtype.kind, key
        np.testing.assert_array_equal(features[key], golden[key], err_msg=key)
    assert features["template_aatype"].dtype == np.int32
    positions = features["template_all_atom_positions"]
    assert positions.shape == golden["template_all_atom_positions"].shape
    np.testing.assert_allclose(positions, golden["template_all_atom_positions"], atol=COORDINATE_TOLERANCE, rtol=0)


def test_templates_are_zero_centred_per_template_chain(data_dir):
    """By default (MLPerf reference) each template is its deposited coordinates minus one vector: the
    mean of the resolved atoms of the *whole* template chain (not only the aligned residues), in
    float32; unresolved atoms stay exactly 0 and nothing else changes."""
    from scalefold.data.parsers.mmcif import parse_mmcif

    centred = _query_features(data_dir)
    deposited = _query_features(data_dir, zero_center=False)
    for key in centred:
        if key != "template_all_atom_positions":
            np.testing.assert_array_equal(centred[key], deposited[key], err_msg=key)
    mask = centred["template_all_atom_masks"] > 0  # [T, N, 37]
    for t, name in enumerate(centred["template_domain_names"]):
        pdb_id, chain_id = str(name).split("_")
        chain = parse_mmcif(data_dir / "mmcif" / f"{pdb_id}.cif").chains[chain_id]
        resolved = chain.all_atom_mask > 0
        translation = chain.all_atom_positions[resolved].mean(axis=0)  # [3] float32, the reference's
        assert translation.dtype == np.float32 and np.abs(translation).max() > 1.0
        got, want = centred["template_all_atom_positions"][t], deposited["template_all_atom_positions"][t]
        np.testing.assert_array_equal(got[mask[t]], want[mask[t]] - translation, err_msg=str(name))
        assert not got[~mask[t]].any()


def test_golden_template_skips_are_explained(data_dir):
    """Hits without a usable structure are skipped with a reason, not dropped silently: 1hf9 (mmCIF
    absent) as ``mmcif_missing``, both 5kc1 chains (aligned residues unresolved) as
    ``no_resolved_atoms``; the other 7 hits become templates, sorted by sum_probs."""
    from scalefold.data.raw_features import read_alignment_dir

    _, hits = read_alignment_dir(data_dir / "alignments" / "query")
    featurizer = TemplateHitFeaturizer(data_dir / "mmcif", MAX_TEMPLATE_DATE)
    query = (data_dir / "alignments" / "query" / "query.fasta").read_text().split()[1]
    result = featurizer.get_templates(query, hits)
    reasons = {s.name.split()[0]: s.reason for s in result.skipped}
    assert reasons == {"1HF9_B": "mmcif_missing", "5KC1_F": "no_resolved_atoms", "5KC1_J": "no_resolved_atoms"}
    assert list(result.features["template_domain_names"]) == [
        "3u8v_A", "2crb_A", "4zey_A", "1psm_A", "3zee_A", "4i6p_A", "2q2k_A",
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# sequence and MSA features


def test_sequence_features_follow_alphafold():
    """aatype is one-hot over our 20 residues + X (unknown letters -> X); index/length features
    are int32; strings are kept as one-element arrays."""
    features = make_sequence_features("ARXB", "q", 4)
    assert features["aatype"].dtype == np.int32 and features["aatype"].shape == (4, 21)
    np.testing.assert_array_equal(features["aatype"].argmax(-1), [0, 1, 20, 20])
    np.testing.assert_array_equal(features["residue_index"], [0, 1, 2, 3])
    np.testing.assert_array_equal(features["seq_length"], [4, 4, 4, 4])
    assert features["sequence"][0] == "ARXB" and features["domain_name"][0] == "q"


def test_msa_dedup_across_sources_keeps_first_occurrence():
    """Rows are deduplicated across sources in the order given; the first occurrence's deletion
    row is kept; ``msa`` uses HHblits ids and num_alignments counts the unique rows."""
    uniref = Msa(["ACD", "AC-", "ACE"], [[0, 0, 0], [0, 2, 0], [1, 0, 0]], ["q", "u1", "u2"])
    bfd = Msa(["ACD", "ACE", "WCD"], [[0, 0, 0], [0, 0, 9], [0, 3, 0]], ["q", "b1", "b2"])
    mgnify = Msa(["ACD", "AC-"], [[0, 0, 0], [5, 5, 5]], ["q", "m1"])
    features = make_msa_features([uniref, bfd, mgnify])
    hh = rc.HHBLITS_AA_TO_ID
    expected_rows = ["ACD", "AC-", "ACE", "WCD"]
    np.testing.assert_array_equal(features["msa"], [[hh[c] for c in row] for row in expected_rows])
    np.testing.assert_array_equal(features["deletion_matrix_int"], [[0, 0, 0], [0, 2, 0], [1, 0, 0], [0, 3, 0]])
    np.testing.assert_array_equal(features["num_alignments"], [4, 4, 4])
    assert features["msa"].dtype == np.int32 and features["deletion_matrix_int"].dtype == np.int32


def test_build_raw_features_without_msa_or_templates_uses_the_query():
    """No MSA: the query alone forms the MSA; no templates: zero-template arrays with full shapes."""
    features = build_raw_features("ACDE", "q", [])
    np.testing.assert_array_equal(features["msa"], [[rc.HHBLITS_AA_TO_ID[c] for c in "ACDE"]])
    assert features["template_all_atom_positions"].shape == (0, 4, 37, 3)
    assert features["template_aatype"].shape == (0, 4) and features["template_aatype"].dtype == np.int32


# ----------------------------------------------------------------------------------------------
# template mapping on a synthetic structure


CHAIN_SEQUENCE = "MKTAYIAKQRQISFVKSHFSRQLEERLG"  # 28 residues


def _entry(sequence=CHAIN_SEQUENCE, chain_id="A", release_date="2000-01-01", unresolved=()):
    """A fake mmCIF entry whose residue i has every backbone atom at x = i (easy to track)."""
    n = len(sequence)
    positions = np.zeros((n, rc.atom_type_num, 3), np.float32)
    mask = np.zeros((n, rc.atom_type_num), np.float32)
    for i in range(n):
        if i in unresolved:
            continue
        for atom in ("N", "CA", "C", "O", "CB"):
            positions[i, rc.atom_order[atom]] = (float(i), float(rc.atom_order[atom]), 0.0)
            mask[i, rc.atom_order[atom]] = 1.0
    chain = MmcifChain(chain_id, chain_id, "1", sequence, ("ALA",) * n, positions, mask, (None,) * n)
    return MmcifEntry("1abc", None, "X-RAY DIFFRACTION", release_date, 2.0, {chain_id: chain})


def _hit(query_segment, hit_segment, query_start, hit_start, name="1ABC_A test", sum_probs=10.0):
    """An hhr hit whose aligned segments start at 0-based ``query_start`` / ``hit_start``."""

    def indices(segment, start):
        out, k = [], start
        for c in segment:
            out.append(-1 if c == "-" else k)
            k += c != "-"
        return out

    return TemplateHit(
        index=1,
        name=name,
        aligned_cols=sum(a != "-" and b != "-" for a, b in zip(query_segment, hit_segment)),
        sum_probs=sum_probs,
        query=query_segment,
        hit_sequence=hit_segment,
        indices_query=indices(query_segment, query_start),
        indices_hit=indices(hit_segment, hit_start),
    )


def test_query_to_hit_mapping_skips_gap_columns():
    """The mapping shifts both index lists to the aligned segment and drops gap columns."""
    query = "GGGACDEFGHIK"
    hit = _hit("ACD-EFGHIK", "ACDWE-GHIK", query_start=3, hit_start=10)
    mapping = build_query_to_hit_mapping(hit.query, hit.hit_sequence, hit.indices_hit, hit.indices_query, query)
    # query residues 3,4,5 -> hit 0,1,2 ; W inserted in the hit (hit 3) ; query E(6) -> hit E(4)
    # query F(7) faces a gap ; query G..K (8..11) -> hit 5..8
    assert mapping == {3: 0, 4: 1, 5: 2, 6: 4, 8: 5, 9: 6, 10: 7, 11: 8}


def _featurizer(entry, **kwargs):
    kwargs.setdefault("aligner", OverlapAligner())
    return TemplateHitFeaturizer(None, "2020-01-01", load_structure=lambda pdb_id: entry, **kwargs)


def test_template_coordinates_land_on_mapped_query_positions():
    """Each mapped query position receives the atoms of its template residue (offset of the hit in
    the chain included), zero-centred over the whole chain (residue i has x = i, so the mean x of
    its 28 residues is 13.5); unmapped positions are gaps with zero atoms."""
    query = "PPPAYIAKQRQISFVKPP"  # 18 residues, positions 3..16 align to chain residues 3..16
    segment = CHAIN_SEQUENCE[3:17]
    hit = _hit(query[3:17], segment, query_start=3, hit_start=3)
    result = _featurizer(_entry()).get_templates(query, [hit])
    features = result.features
    assert features["template_sequence"][0] == "---" + segment + "-"
    ca = rc.atom_order["CA"]
    np.testing.assert_array_equal(features["template_all_atom_positions"][0, 3:17, ca, 0], np.arange(3, 17) - 13.5)
    assert not features["template_all_atom_positions"][0, [0, 1, 2, 17]].any()
    assert features["template_all_atom_masks"][0, [0, 1, 2, 17]].sum() == 0
    np.testing.assert_array_equal(features["template_aatype"][0, 0], np.eye(22)[21])  # gap
    assert features["template_sum_probs"].shape == (1, 1)


def test_prefilter_rejects_with_specific_reasons():
    """Release date after the cutoff, too small aligned fraction, near-duplicate of the query and
    too-short hits are all dropped before any structure is read, each with its own reason."""
    query = CHAIN_SEQUENCE
    hits = [
        _hit(query[2:26], query[2:26], 2, 2, name="1ABC_A dup"),  # 24/28 = 0.857 < 0.95: kept
        _hit(query, query, 0, 0, name="1ABC_A exact"),  # 28/28 > 0.95: duplicate
        _hit(query[0:2], query[0:2], 0, 0, name="1ABC_A tiny"),  # align ratio 2/28 <= 0.1
        _hit(query[0:9] + "--", query[0:9] + "WW", 0, 0, name="1ABC_A short"),  # 11 residues ... ok
        _hit(query[0:9], query[0:9], 0, 0, name="1ABC_A nine"),  # 9 residues < 10
        _hit(query[0:12], query[0:12], 0, 0, name="9NEW_A late"),
    ]
    featurizer = _featurizer(_entry(), release_dates={"9new": "2022-01-01"})
    result = featurizer.get_templates(query, hits)
    reasons = {s.name.split()[1]: (s.stage, s.reason) for s in result.skipped}
    assert reasons["exact"] == ("prefilter", "duplicate_of_query")
    assert reasons["tiny"] == ("prefilter", "align_ratio_too_small")
    assert reasons["nine"] == ("prefilter", "too_short")
    assert reasons["late"] == ("prefilter", "released_after_cutoff")
    assert "dup" not in reasons


def test_max_hits_and_sum_probs_order():
    """Templates come out best ``sum_probs`` first and stop at ``max_hits``."""
    query = CHAIN_SEQUENCE
    hits = [
        _hit(query[0:12], query[0:12], 0, 0, name="1ABC_A low", sum_probs=1.0),
        _hit(query[5:20], query[5:20], 5, 5, name="1ABC_A high", sum_probs=9.0),
        _hit(query[3:18], query[3:18], 3, 3, name="1ABC_A mid", sum_probs=5.0),
    ]
    result = _featurizer(_entry(), max_hits=2).get_templates(query, hits)
    np.testing.assert_array_equal(result.features["template_sum_probs"][:, 0], [9.0, 5.0])


def test_missing_structure_and_unresolved_residues_are_skipped():
    """A hit whose mmCIF is missing, or whose aligned residues have no resolved atoms, yields no
    template and a logged reason; the result then has zero templates."""
    query = CHAIN_SEQUENCE

    def missing(pdb_id):
        raise FileNotFoundError(pdb_id)

    hit = _hit(query[0:12], query[0:12], 0, 0)
    featurizer = TemplateHitFeaturizer(None, "2020-01-01", load_structure=missing, aligner=OverlapAligner())
    result = featurizer.get_templates(query, [hit])
    assert [s.reason for s in result.skipped] == ["mmcif_missing"]
    assert result.features["template_aatype"].shape == (0, len(query))
    result = _featurizer(_entry(unresolved=range(12))).get_templates(query, [hit])
    assert [s.reason for s in result.skipped] == ["no_resolved_atoms"]


def _realignment_case():
    """PDB70 holds a version of the template with one mutation and one extra residue."""
    old = CHAIN_SEQUENCE[4:24]
    mutated = old[:6] + "W" + old[7:13] + "G" + old[13:]  # 21 residues, not in the chain
    query = "PP" + mutated + "PP"
    return query, _hit(mutated, mutated, 2, 0)


@pytest.mark.parametrize("aligner", ["python", "kalign"])
def test_realignment_when_hit_sequence_differs_from_mmcif(aligner):
    """When the hit sequence is not in the mmCIF chain it is realigned to the chain (kalign or the
    pure-Python fallback, named in the warning); query positions then carry the chain's residues
    and coordinates, the inserted hit residue stays a gap, identity < 90 % rejects the hit."""
    if aligner == "kalign":
        path = shutil.which("kalign")
        if path is None:
            pytest.skip("kalign not on PATH")
        backend = KalignAligner(path)
    else:
        backend = OverlapAligner()
    query, hit = _realignment_case()
    result = _featurizer(_entry(), aligner=backend).get_templates(query, [hit])
    assert result.skipped == [] and len(result.warnings) == 1 and backend.name in result.warnings[0]
    sequence = result.features["template_sequence"][0]
    chain = CHAIN_SEQUENCE[4:24]
    # query 2..22 = mutated hit; the inserted G (hit index 13 -> query 15) has no chain residue
    assert sequence == "--" + chain[:13] + "-" + chain[13:] + "--"
    ca = rc.atom_order["CA"]
    x = result.features["template_all_atom_positions"][0, :, ca, 0]
    x = x + 13.5  # undo the zero-centring (mean x of the 28 chain residues): residue i has x = i
    np.testing.assert_array_equal(x[2:15], np.arange(4, 17))
    np.testing.assert_array_equal(x[16:23], np.arange(17, 24))
    assert result.features["template_all_atom_masks"][0, 15].sum() == 0

    strict = _featurizer(_entry(), aligner=backend, filters=TemplateFilter(min_realign_identity=0.99))
    result = strict.get_templates(query, [hit])
    assert [s.reason for s in result.skipped] == ["realign_low_identity"]


def test_python_aligner_places_fragment_inside_chain():
    """The fallback aligner's free end gaps let a fragment sit inside the full chain, with an
    internal gap where the chain has an extra residue."""
    first, second = OverlapAligner().align("AYIAKISFV", CHAIN_SEQUENCE)
    assert second == CHAIN_SEQUENCE
    assert first == "---AYIAK---ISFV" + "-" * 13


def test_allowed_chain_set_and_own_entry_are_rejected():
    """Training filters: chains outside the allowed template set and the query's own PDB entry
    are dropped by the prefilter."""
    query = CHAIN_SEQUENCE
    hits = [
        _hit(query[0:12], query[0:12], 0, 0, name="1ABC_A a"),
        _hit(query[0:12], query[0:12], 0, 0, name="2XYZ_B b"),
    ]
    result = _featurizer(_entry(), allowed_chain_ids={"1abc_A"}).get_templates(query, hits, query_pdb_id="1ABC")
    assert {s.name.split()[1]: s.reason for s in result.skipped} == {
        "a": "template_is_query",
        "b": "not_in_template_set",
    }


def test_hit_to_a_chain_that_is_not_a_protein_chain_is_dropped():
    """A hit whose chain id is not a protein chain of its entry and whose sequence needs realignment
    is dropped (``chain_not_found``), as the reference drops it (no atoms under that chain id) --
    even when the entry has a single protein chain to realign to."""
    query, hit = _realignment_case()
    hit = TemplateHit(**{**hit.__dict__, "name": "1ABC_Z test"})
    result = _featurizer(_entry()).get_templates(query, [hit])
    assert [s.reason for s in result.skipped] == ["chain_not_found"]
    assert result.features["template_aatype"].shape == (0, len(query))
