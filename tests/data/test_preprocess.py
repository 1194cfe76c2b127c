"""``scalefold preprocess`` (bad input skipped and reported), ``data-stats``, and the MLPerf layout reader."""

from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from scalefold.commands.data import add_parsers, store_stats
from scalefold.data.mlperf_layout import MlperfLayout, PickleNotAllowedError, convert_to_store
from scalefold.data.parsers.mmcif import parse_mmcif
from scalefold.data.preprocess import preprocess, report_path
from scalefold.data.store import Store
from scalefold.data.templates import zero_center_positions

HHR = (
    "No 1\n>1ABC_A test\n"
    "Probab=9.0  E-value=1  Score=2.0  Aligned_cols=3  Identities=10%  Similarity=0.1  Sum_probs=2.5  Template_Neff=1.0\n"
    "Q query            2 AC-D    4 (70)\n"
    "T 1ABC_A           5 A-GD    7 (20)\n"
)


@pytest.fixture()
def mixed_inputs(data_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two good entries, an edge case, a truncated and a garbage mmCIF; alignments for 2q2k (A good, B broken)."""
    mmcif = tmp_path / "mmcif"
    (mmcif / "sub").mkdir(parents=True)
    for name in ("1aki.cif", "2q2k.cif"):
        shutil.copy(data_dir / "mmcif" / name, mmcif / name)
    shutil.copy(data_dir / "mmcif" / "edge_cases" / "altloc.cif", mmcif / "sub" / "altloc.cif")
    (mmcif / "9trn.cif").write_bytes((data_dir / "mmcif" / "1aki.cif").read_bytes()[:60_000])
    (mmcif / "9bad.cif").write_text("not an mmCIF\n")
    alignments = tmp_path / "alignments"
    shutil.copytree(data_dir / "alignments" / "2q2k_A", alignments / "2q2k_A")
    (alignments / "2q2k_B").mkdir()
    bad = (data_dir / "alignments" / "2q2k_B" / "bfd_uniclust_hits.a3m").read_text().splitlines()
    bad[3] = bad[3][:5] + "*" + bad[3][6:]  # an invalid character in the first hit
    (alignments / "2q2k_B" / "bfd_uniclust_hits.a3m").write_text("\n".join(bad) + "\n")
    (alignments / "2q2k_A" / "pdb70_hits.hhr").write_text(HHR)
    return mmcif, alignments


def test_preprocess_skips_bad_input_and_reports_it(mixed_inputs, tmp_path: Path) -> None:
    """Good chains are written; corrupt files, a bad a3m and chains without alignments are skipped by reason."""
    mmcif, alignments = mixed_inputs
    out = tmp_path / "store.h5"
    report = preprocess(mmcif, alignments, out, workers=2, progress=False)
    assert json.loads(report_path(out).read_text()) == report
    assert report["files_total"] == 5 and report["files_failed"] == 2
    assert report["chains_written"] == 1
    skipped = report["skipped"]
    assert skipped["corrupt_mmcif"]["count"] == 2
    assert {e["file"].rsplit("/", 1)[-1] for e in skipped["corrupt_mmcif"]["examples"]} == {"9trn.cif", "9bad.cif"}
    assert skipped["msa_invalid_character"]["count"] == 1
    example = skipped["msa_invalid_character"]["examples"][0]
    assert example["chain"] == "2q2k_B" and "bfd_uniclust_hits.a3m" in example["message"]
    assert skipped["missing_alignment"]["count"] == 2  # 1aki_A, altloc_A
    with Store.open(out) as s:
        assert s.chain_ids == ["2q2k_A"]
        chain = s.get("2q2k_A")
        reference = parse_mmcif(mmcif / "2q2k.cif").chains["A"]
        assert chain["sequence"] == reference.sequence
        np.testing.assert_array_equal(chain["all_atom_positions"], reference.all_atom_positions)
        assert chain["msa"].shape[1] == 70 and chain["msa"].shape[0] > 1
        assert len(chain["template_hits"]) == 1 and chain["template_hits"][0].indices_hit == [4, -1, 5, 6]
        assert chain["release_date"] == "2008-02-05" and chain["resolution"] == 3.0


def test_preprocess_without_alignments_keeps_all_chains(mixed_inputs, tmp_path: Path) -> None:
    """Without an alignments dir every protein chain of the good files is stored (no MSA); serial == parallel."""
    mmcif, _ = mixed_inputs
    serial = preprocess(mmcif, None, tmp_path / "a.h5", workers=1, progress=False)
    assert serial["chains_written"] == 4 and list(serial["skipped"]) == ["corrupt_mmcif"]
    with Store.open(tmp_path / "a.h5") as s:
        assert s.chain_ids == ["1aki_A", "2q2k_A", "2q2k_B", "altloc_A"]
        assert "msa" not in s.get("1aki_A")
    stats = store_stats(str(tmp_path / "a.h5"))
    assert stats["chains"] == 4 and stats["chains_without_msa"] == 4 and stats["length"]["max"] == 129


def test_template_hits_beyond_the_chain_are_rejected(mixed_inputs, data_dir: Path, tmp_path: Path) -> None:
    """An .hhr whose query indices exceed the chain length (another query's hits) skips the chain."""
    mmcif, alignments = mixed_inputs
    shutil.copy(data_dir / "alignments" / "query" / "pdb70_hits.hhr", alignments / "2q2k_A" / "pdb70_hits.hhr")
    report = preprocess(mmcif, alignments, tmp_path / "h.h5", workers=1, progress=False)
    assert report["chains_written"] == 0
    assert report["skipped"]["hhr_query_length_mismatch"]["examples"][0]["chain"] == "2q2k_A"


def test_cli_preprocess_exits_zero_and_data_stats(mixed_inputs, tmp_path: Path, capsys) -> None:
    """`scalefold preprocess` returns 0 despite skips and writes the report; `data-stats --json` summarises."""
    import argparse

    mmcif, alignments = mixed_inputs
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    out = tmp_path / "cli.h5"
    args = parser.parse_args(
        [
            "preprocess",
            "--mmcif-dir",
            str(mmcif),
            "--alignments-dir",
            str(alignments),
            "--out",
            str(out),
            "--allow-missing-alignments",
            "--no-progress",
        ]
    )
    assert args.handler(args) == 0
    assert report_path(out).is_file()
    args = parser.parse_args(["data-stats", str(out), "--json"])
    assert args.handler(args) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["chains"] == 3 and stats["chains_with_templates"] == 1


# ----------------------------------------------------------------------------------------------
# MLPerf processed layout


def _write_layout(root: Path, chain) -> None:
    """A one-entry layout as the reference's preprocessing scripts write it."""
    processed = root / "pdb_mmcif" / "processed"
    (processed / "dicts").mkdir(parents=True)
    (processed / "chains.csv").write_text(
        "pdb_chain_id,pdb_id,author_chain_id,mmcif_chain_ids,release_date,resolution,pdb_cluster_id,"
        "sequence_length,sequence\n"
        f"1abc_A,1abc,A,A,2001-02-03,,12,{chain.num_res},{chain.sequence}\n"
    )
    positions = chain.all_atom_positions.astype(np.float32)
    mask = chain.all_atom_mask.astype(bool)
    entry = {
        "pdb_id": "1abc",
        "exptl_method": "X-RAY DIFFRACTION",
        "release_date": "2001-02-03",
        "resolution": float("nan"),
        "author_chain_ids": ["A"],
        "sequences": {"A": chain.sequence},
        "atoms": {
            "A": {
                "all_atom_positions": (zlib.compress(positions.tobytes()), positions.shape),
                "all_atom_mask": (zlib.compress(mask.tobytes()), mask.shape),
            }
        },
    }
    (processed / "dicts" / "ab").write_bytes(pickle.dumps({"1abc": entry}))
    aln = root / "open_protein_set" / "processed" / "pdb_alignments"
    aln.mkdir(parents=True)
    query = chain.sequence
    files = {
        "bfd_uniclust_hits.a3m": f">q\n{query}\n>h1\n{query[:-1]}-\n",
        "uniref90_hits.a3m": f">q\n{query}\n>h2\nA{query[1:]}\n",
        "pdb70_hits.hhr": "",
    }
    blob, index, start = b"", [], 0
    for name, text in files.items():
        data = text.encode()
        index.append([name, start, len(data)])
        blob += data
        start += len(data)
    (aln / "0.db").write_bytes(blob)
    (aln / "super.index").write_text(json.dumps({"1abc_A": {"db": "0.db", "files": index}}))


def test_mlperf_layout_reader_and_conversion(data_dir: Path, tmp_path: Path) -> None:
    """chains.csv/alignments read without pickle; structures need allow_pickle; conversion round-trips."""
    chain = parse_mmcif(data_dir / "mmcif" / "1l2y.cif").chains["A"]
    root = tmp_path / "mlperf"
    _write_layout(root, chain)

    layout = MlperfLayout(root)
    assert layout.chain_ids == ["1abc_A"]
    row = next(layout.chains())
    assert np.isnan(row["resolution"]) and row["pdb_cluster_id"] == 12
    assert set(layout.alignments("1abc_A")) == {"bfd_uniclust_hits.a3m", "uniref90_hits.a3m", "pdb70_hits.hhr"}
    with pytest.raises(PickleNotAllowedError, match="arbitrary code"):
        layout.get("1abc_A")
    with pytest.raises(PickleNotAllowedError, match="arbitrary code"):
        convert_to_store(root, tmp_path / "no.h5")

    got = MlperfLayout(root, allow_pickle=True).get("1abc_A")
    assert got["sequence"] == chain.sequence and got["cluster_id"] == 12
    np.testing.assert_array_equal(got["all_atom_positions"], chain.all_atom_positions)
    np.testing.assert_array_equal(got["all_atom_mask"], chain.all_atom_mask)
    assert got["msa"].shape == (3, chain.num_res)  # uniref90 first, then bfd; the query row deduplicated
    assert got["msa"][1, 0] == 0  # 'A' of the uniref90 hit (HHblits id 0)

    report = convert_to_store(root, tmp_path / "conv.h5", allow_pickle=True, progress=False)
    assert report["chains_written"] == 1 and report_path(tmp_path / "conv.h5").is_file()
    with Store.open(tmp_path / "conv.h5") as s:
        stored = s.get("1abc_A")
    np.testing.assert_array_equal(stored["all_atom_positions"], got["all_atom_positions"])
    np.testing.assert_array_equal(stored["msa"], got["msa"])
    assert stored["release_date"] == "2001-02-03" and np.isnan(stored["resolution"])


def test_mlperf_pickle_with_code_is_refused_even_when_allowed(data_dir: Path, tmp_path: Path) -> None:
    """The restricted unpickler refuses globals (e.g. os.system) in a dicts shard."""
    chain = parse_mmcif(data_dir / "mmcif" / "1l2y.cif").chains["A"]
    root = tmp_path / "mlperf"
    _write_layout(root, chain)

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned",))

    (root / "pdb_mmcif" / "processed" / "dicts" / "ab").write_bytes(pickle.dumps({"1abc": Evil()}))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        MlperfLayout(root, allow_pickle=True).get("1abc_A")


def _hhr_hit(index: int, name: str, query: str, q_start: int, template: str, t_start: int, q_len: int, t_len: int):
    """One ungapped .hhr hit paragraph (1-based starts)."""
    q_end, t_end = q_start + len(query) - 1, t_start + len(template) - 1
    return (
        f"No {index}\n>{name} test hit\n"
        f"Probab=9.0  E-value=1  Score=2.0  Aligned_cols={len(query)}  Identities=10%  Similarity=0.1  "
        f"Sum_probs={len(query) / 2}  Template_Neff=1.0\n"
        f"{'Q query':<17}{q_start} {query} {q_end} ({q_len})\n"
        f"{'T ' + name:<17}{t_start} {template} {t_end} ({t_len})\n\n"
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_featurises_template_hits_into_the_store(mixed_inputs, tmp_path: Path, workers: int) -> None:
    """Hits are prefiltered and featurised against the template mmCIF at preprocessing time: the
    store keeps, per hit, its outcome and the aligned template residues' coordinates (a hit to a
    chain absent from the template directory fails the prefilter); --no-templates keeps hits only."""
    mmcif, alignments = mixed_inputs
    query = parse_mmcif(mmcif / "2q2k.cif").chains["A"]
    template = parse_mmcif(mmcif / "1aki.cif").chains["A"]
    hhr = _hhr_hit(1, "1ABC_A", query.sequence[1:4], 2, "AGD", 5, 70, 20)
    hhr += _hhr_hit(2, "1AKI_A", query.sequence[20:40], 21, template.sequence[5:25], 6, 70, template.num_res)
    (alignments / "2q2k_A" / "pdb70_hits.hhr").write_text(hhr)
    out = tmp_path / f"t{workers}.h5"
    preprocess(mmcif, alignments, out, workers=workers, progress=False)
    with Store.open(out) as s:
        outcomes = s.get("2q2k_A")["template_outcomes"]
    assert [(o.stage, o.reason) for o in outcomes] == [("prefilter", "not_in_template_set"), ("ok", "")]
    stored = outcomes[1].template
    assert stored.domain_name == "1aki_A" and stored.residues == template.sequence[5:25]
    np.testing.assert_array_equal(stored.query_index, np.arange(20, 40))
    centred = zero_center_positions(template.all_atom_positions, template.all_atom_mask)  # whole chain
    np.testing.assert_array_equal(stored.all_atom_positions, centred[5:25])
    np.testing.assert_array_equal(stored.all_atom_mask, template.all_atom_mask[5:25])

    preprocess(mmcif, alignments, tmp_path / "hits_only.h5", workers=1, progress=False, templates=False)
    with Store.open(tmp_path / "hits_only.h5") as s:
        assert [o.stage for o in s.get("2q2k_A")["template_outcomes"]] == ["unprocessed", "unprocessed"]


# ----------------------------------------------------------------------------------------------
# End to end: `scalefold preprocess` on real files mixed with deliberately bad ones


def _without_ca(src: Path, dst: Path, author_chain: str) -> None:
    """Copy of an mmCIF file with every CA atom of one chain removed (its other atoms stay)."""
    import gemmi

    doc = gemmi.cif.read(str(src))
    table = doc.sole_block().find("_atom_site.", ["label_atom_id", "auth_asym_id"])
    rows = [i for i, row in enumerate(table) if row[0] == "CA" and row[1] == author_chain]
    assert rows, f"no CA atoms of chain {author_chain} in {src}"
    for i in reversed(rows):
        table.remove_row(i)
    doc.write_file(str(dst))


def _truncated(src: Path, dst: Path) -> None:
    """The first part of an mmCIF file, cut in the middle of an _atom_site row (an interrupted download)."""
    data = src.read_bytes()
    rows = [i for i in range(len(data)) if data.startswith(b"\nATOM ", i)]
    cut = rows[len(rows) // 2] + 20
    assert data[cut - 1 : cut + 1].strip() and b"\n" not in data[cut - 1 : cut + 1]
    dst.write_bytes(data[:cut])


@pytest.fixture()
def e2e_inputs(data_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Real entries and alignments from the shared data, plus one bad input of each kind:

    ====================  ==================================================  =============================
    chain / file          input                                               expected
    ====================  ==================================================  =============================
    2q2k_A, 2q2k_B        real mmCIF + real alignments (a3m + 2 Stockholm)    written, MSA as parsed
    4i6p_A                real mmCIF, query-only a3m                          written (nothing lost)
    4i6p_B                same file, every CA atom of chain B removed         no_resolved_ca
    3zee_A                real mmCIF, empty a3m                               empty_msa
    1aki_A (129 res)      real mmCIF, 2q2k_A's real alignments (70 columns)   msa_query_length_mismatch
    4zey.cif              real mmCIF cut inside an _atom_site row             corrupt_mmcif (whole file)
    ====================  ==================================================  =============================
    """
    src_mmcif, src_aln = data_dir / "mmcif", data_dir / "alignments"
    mmcif, alignments = tmp_path / "mmcif", tmp_path / "alignments"
    mmcif.mkdir()
    for name in ("2q2k.cif", "3zee.cif", "1aki.cif"):
        shutil.copy(src_mmcif / name, mmcif / name)
    _without_ca(src_mmcif / "4i6p.cif", mmcif / "4i6p.cif", "B")
    _truncated(src_mmcif / "4zey.cif", mmcif / "4zey.cif")
    for chain in ("2q2k_A", "2q2k_B"):
        shutil.copytree(src_aln / chain, alignments / chain)
    query_4i6p_a = parse_mmcif(src_mmcif / "4i6p.cif").chains["A"].sequence
    for chain, files in {
        "4i6p_A": {"bfd_uniclust_hits.a3m": f">4i6p_A\n{query_4i6p_a}\n"},
        "4i6p_B": {"bfd_uniclust_hits.a3m": f">4i6p_B\n{query_4i6p_a}\n"},
        "3zee_A": {"bfd_uniclust_hits.a3m": ""},
    }.items():
        (alignments / chain).mkdir(parents=True)
        for name, text in files.items():
            (alignments / chain / name).write_text(text)
    shutil.copytree(src_aln / "2q2k_A", alignments / "1aki_A")
    return mmcif, alignments


def test_cli_preprocess_end_to_end_records_every_skipped_chain(e2e_inputs, data_dir: Path, tmp_path: Path) -> None:
    """`scalefold preprocess` (a real subprocess, 2 workers) on real + bad inputs exits 0; the
    STORE.report.json records every skipped chain/file with its specific reason (and the file in
    the message), the log names each of them, and every good chain is in the store unchanged."""
    import subprocess
    import sys

    from scalefold.data.preprocess import load_chain_alignments

    mmcif, alignments = e2e_inputs
    out = tmp_path / "e2e.h5"
    cmd = [sys.executable, "-m", "scalefold", "preprocess", "--mmcif-dir", str(mmcif), "--alignments-dir",
           str(alignments), "--out", str(out), "--workers", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path(out).read_text())

    expected_skips = {
        ("4i6p.cif", "4i6p_B", "no_resolved_ca"),
        ("3zee.cif", "3zee_A", "empty_msa"),
        ("1aki.cif", "1aki_A", "msa_query_length_mismatch"),
        ("4zey.cif", "", "corrupt_mmcif"),
    }
    items = report["skipped_items"]
    assert {(Path(s["file"]).name, s["chain"], s["reason"]) for s in items} == expected_skips
    assert len(items) == len(expected_skips)
    assert {reason: group["count"] for reason, group in report["skipped"].items()} == {
        reason: 1 for _, _, reason in expected_skips
    }
    by_chain = {s["chain"]: s["message"] for s in items}
    assert "has no resolved CA" in by_chain["4i6p_B"] and "4i6p.cif" in by_chain["4i6p_B"]
    assert "3zee_A" in by_chain["3zee_A"] and "bfd_uniclust_hits.a3m" in by_chain["3zee_A"]  # the empty file
    assert "129" in by_chain["1aki_A"] and "70" in by_chain["1aki_A"]  # query 129 residues, MSA 70 columns
    assert by_chain["1aki_A"].startswith("chain 1aki_A: ") and "_hits." in by_chain["1aki_A"]  # chain + MSA file
    assert "truncated" in by_chain[""] and "4zey.cif" in by_chain[""]
    # the log file (not the screen) names every skip: file, chain and reason; the screen has the summary
    log = Path(f"{out}.log").read_text()
    for file, chain, reason in expected_skips:
        assert any(file in line and chain in line and reason in line for line in log.splitlines()), (
            file, chain, reason,
        )  # fmt: skip
    assert "WARNING" not in proc.stderr and "skipped" not in proc.stderr
    assert f"every file and chain with its reason in {out}.report.json" in proc.stdout
    assert f"warnings logged to {out}.log" in proc.stdout
    assert report["files_total"] == 5 and report["files_failed"] == 1
    assert report["chains_written"] == 3 and report["chains_skipped"] == 3

    # nothing lost: every chain of every readable input file is either in the store or in the report
    readable = {
        entry.chain_id(author)
        for entry in (parse_mmcif(mmcif / f"{f}.cif") for f in ("2q2k", "4i6p", "3zee", "1aki"))
        for author in entry.chains
    }
    with Store.open(out) as store:
        assert store.chain_ids == ["2q2k_A", "2q2k_B", "4i6p_A"]
        assert set(store.chain_ids) | {s["chain"] for s in items if s["chain"]} == readable
        for chain_id in ("2q2k_A", "2q2k_B"):
            stored = store.get(chain_id)
            pdb_id, author = chain_id.split("_")
            reference = parse_mmcif(data_dir / "mmcif" / f"{pdb_id}.cif").chains[author]
            assert stored["sequence"] == reference.sequence
            np.testing.assert_array_equal(stored["all_atom_positions"], reference.all_atom_positions)
            np.testing.assert_array_equal(stored["all_atom_mask"], reference.all_atom_mask)
            msa, _ = load_chain_alignments(data_dir / "alignments" / chain_id, reference.sequence)
            expected_msa, expected_deletions = msa.to_arrays(np.int16)
            np.testing.assert_array_equal(stored["msa"], expected_msa)
            np.testing.assert_array_equal(stored["deletion_matrix"], expected_deletions)
            assert stored["msa"].shape[0] > 1
        kept = store.get("4i6p_A")  # the good chain of the file whose other chain was skipped
        reference = parse_mmcif(data_dir / "mmcif" / "4i6p.cif").chains["A"]
        assert kept["sequence"] == reference.sequence and kept["msa"].shape == (1, reference.num_res)
        np.testing.assert_array_equal(kept["all_atom_positions"], reference.all_atom_positions)
