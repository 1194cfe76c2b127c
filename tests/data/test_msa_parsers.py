"""a3m / Stockholm / FASTA / .hhr parsers, MSA validation and cross-source dedup."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scalefold.data.parsers import HhrError, MsaError
from scalefold.data.parsers.hhr import parse_hhr
from scalefold.data.parsers.msa import (
    Msa,
    convert_stockholm_to_a3m,
    merge_msas,
    parse_a3m,
    parse_fasta,
    parse_msa_file,
    parse_stockholm,
    sequences_to_hhblits_ids,
    validate_msa,
)

STOCKHOLM = """# STOCKHOLM 1.0
#=GS hit1/1-5 DE first hit
query   AC-DE
hit1/1-5 AQKD-
hit2    -CGDE
//
"""


def test_parse_fasta_descriptions_and_multiline() -> None:
    """FASTA: headers without '>', sequences joined over lines, comments and blanks ignored."""
    seqs, descs = parse_fasta(">a first\nAC\nDE\n\n# comment\n>b\nGG\n")
    assert seqs == ["ACDE", "GG"] and descs == ["a first", "b"]


def test_a3m_lowercase_insertions_become_deletion_counts() -> None:
    """a3m: lower-case residues are removed and counted before the next aligned column."""
    msa = parse_a3m(">q\nACDE\n>h\nAxyC-E\n>g\nA-DEkk\n")
    assert msa.sequences == ["ACDE", "AC-E", "A-DE"]
    assert msa.deletion_matrix == [[0, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0]]
    assert msa.descriptions == ["q", "h", "g"]


def test_stockholm_removes_query_gap_columns_and_counts_deletions() -> None:
    """Stockholm: the query-gap column is dropped; a residue there is a deletion before the next column."""
    msa = parse_stockholm(STOCKHOLM)
    assert msa.sequences == ["ACDE", "AQD-", "-CDE"]
    assert msa.deletion_matrix == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0]]
    assert msa.descriptions == ["query", "hit1/1-5", "hit2"]


def test_stockholm_to_a3m_conversion_is_equivalent(data_dir: Path) -> None:
    """convert_stockholm_to_a3m + parse_a3m == parse_stockholm (toy and real jackhmmer output)."""
    converted = convert_stockholm_to_a3m(STOCKHOLM)
    assert converted.splitlines()[2:4] == [">hit1/1-5 first hit", "AQkD-"]
    real = (data_dir / "alignments" / "query" / "uniref90_hits.sto").read_text()
    for text in (STOCKHOLM, real):
        a, b = parse_a3m(convert_stockholm_to_a3m(text)), parse_stockholm(text)
        assert a.sequences == b.sequences and a.deletion_matrix == b.deletion_matrix


def test_merge_dedups_across_sources_in_order() -> None:
    """merge_msas keeps the first occurrence of each aligned sequence, across sources in order."""
    a = Msa(["ACDE", "AC-E"], [[0] * 4, [0, 1, 0, 0]], ["q", "a1"])
    b = Msa(["ACDE", "AC-E", "GGGG"], [[0] * 4, [0, 5, 0, 0], [1, 0, 0, 0]], ["q", "b1", "b2"])
    merged = merge_msas([a, Msa([], [], []), b])
    assert merged.sequences == ["ACDE", "AC-E", "GGGG"]
    assert merged.deletion_matrix == [[0] * 4, [0, 1, 0, 0], [1, 0, 0, 0]]
    assert merged.descriptions == ["q", "a1", "b2"]


def test_real_msas_reproduce_alphafold_raw_msa(data_dir: Path, reference_dir: Path) -> None:
    """query: uniref90 (sto) + bfd (a3m) + mgnify (sto), deduped → DeepMind's raw `msa`/`deletion_matrix_int`."""
    golden = np.load(reference_dir / "alphafold_raw_features_query.npz")
    root = data_dir / "alignments" / "query"
    sequence = str(golden["sequence"][0])
    msas = [
        parse_msa_file(root / "uniref90_hits.sto", max_sequences=10_000),
        parse_msa_file(root / "bfd_uniclust_hits.a3m"),
        parse_msa_file(root / "mgnify_hits.sto", max_sequences=501),
    ]
    for msa in msas:
        validate_msa(msa, sequence)
    ids, deletions = merge_msas(msas).to_arrays(np.int16)
    np.testing.assert_array_equal(ids, golden["msa"])
    np.testing.assert_array_equal(deletions, golden["deletion_matrix_int"])
    assert ids.dtype == np.int8


def test_every_shipped_alignment_parses_and_validates(data_dir: Path) -> None:
    """All a3m/sto/fasta files under alignments/ parse and are as wide as their first row."""
    files = [p for p in sorted((data_dir / "alignments").rglob("*")) if p.suffix in (".a3m", ".sto", ".fasta")]
    assert len(files) >= 10
    for path in files:
        msa = parse_msa_file(path)
        validate_msa(msa, path=str(path))
        assert len(msa) >= 1


def test_invalid_character_is_a_clear_error(tmp_path: Path) -> None:
    """An aligned row with a character outside the HHblits alphabet → MsaError(msa_invalid_character) naming file."""
    bad = tmp_path / "bad.a3m"
    bad.write_text(">q\nACDE\n>h\nAC*E\n")
    msa = parse_msa_file(bad)
    with pytest.raises(MsaError) as info:
        validate_msa(msa, "ACDE", path=str(bad))
    assert info.value.reason == "msa_invalid_character" and str(bad) in str(info.value) and "*" in str(info.value)
    with pytest.raises(MsaError):
        sequences_to_hhblits_ids(["AC*E"])


def test_query_length_mismatch_and_empty_msa(tmp_path: Path) -> None:
    """Rows of the wrong width → msa_query_length_mismatch; no sequences → empty_msa."""
    msa = parse_a3m(">q\nACDE\n>h\nACD\n")
    with pytest.raises(MsaError) as info:
        validate_msa(msa, "ACDE")
    assert info.value.reason == "msa_query_length_mismatch"
    with pytest.raises(MsaError) as info:
        validate_msa(parse_a3m(">q\nACDE\n"), "ACDEF")
    assert info.value.reason == "msa_query_length_mismatch"
    empty = tmp_path / "empty.a3m"
    empty.write_text("")
    with pytest.raises(MsaError) as info:
        validate_msa(parse_msa_file(empty), "ACDE", path=str(empty))
    assert info.value.reason == "empty_msa"


def test_hhr_hits_parsed_as_alphafold(data_dir: Path) -> None:
    """query/pdb70_hits.hhr: 10 hits; hit 1 (1HF9_B) fields and 0-based residue indices."""
    hits = parse_hhr((data_dir / "alignments" / "query" / "pdb70_hits.hhr").read_text())
    assert len(hits) == 10
    first = hits[0]
    assert (first.index, first.aligned_cols, first.sum_probs) == (1, 22, 13.1)
    assert first.name.startswith("1HF9_B ATPASE INHIBITOR") and (first.pdb_id, first.chain_id) == ("1hf9", "B")
    assert first.query == "AEHHHKAAEHHEQAAKHHHAAA" and first.hit_sequence == "ISHHAKEIERLQKEIERHKQSI"
    assert first.indices_query == list(range(6, 28)) and first.indices_hit == list(range(9, 31))
    assert [h.name[:6] for h in hits[1:3]] == ["2CRB_A", "4ZEY_A"]
    assert len(parse_hhr((data_dir / "alignments" / "6kwc_1" / "hhsearch_output.hhr").read_text())) == 60


def test_hhr_gaps_and_bad_summary() -> None:
    """Gaps give index -1; a paragraph without the Probab= summary line → HhrError."""
    text = (
        "No 1\n>1ABC_A test\n"
        "Probab=9.0  E-value=1  Score=2.0  Aligned_cols=3  Identities=10%  Similarity=0.1  Sum_probs=2.5  Template_Neff=1.0\n"
        "Q query            2 AC-D    4 (10)\n"
        "T 1ABC_A           5 A-GD    7 (20)\n"
    )
    hit = parse_hhr(text)[0]
    assert hit.indices_query == [1, 2, -1, 3] and hit.indices_hit == [4, -1, 5, 6]
    with pytest.raises(HhrError):
        parse_hhr("No 1\n>1ABC_A test\nnonsense\n", path="x.hhr")
