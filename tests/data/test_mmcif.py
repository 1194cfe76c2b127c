"""mmCIF parsing (gemmi) on the real PDB entries in ``../shared/data/mmcif`` and on bad input."""

from __future__ import annotations

import math
import re
from pathlib import Path

import gemmi
import numpy as np
import pytest

from scalefold import residue_constants as rc
from scalefold.data.parsers import MmcifError
from scalefold.data.parsers.mmcif import check_chain_usable, parse_mmcif, parse_mmcif_string

CA = rc.atom_order["CA"]


@pytest.fixture(scope="module")
def mmcif_dir(data_dir: Path) -> Path:
    return data_dir / "mmcif"


def test_every_protein_chain_of_every_file_parses(mmcif_dir: Path) -> None:
    """Every file parses; each protein chain has consistent shapes/dtypes, a resolved CA, and valid metadata."""
    files = sorted(mmcif_dir.rglob("*.cif"))
    assert len(files) >= 18
    for path in files:
        entry = parse_mmcif(path)
        assert entry.chains, path
        if entry.release_date is not None:
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry.release_date)
        for author_id, chain in entry.chains.items():
            n = chain.num_res
            assert n > 0 and set(chain.sequence) <= set(rc.restypes_with_x), (path, author_id)
            assert chain.all_atom_positions.shape == (n, 37, 3) and chain.all_atom_positions.dtype == np.float32
            assert chain.all_atom_mask.shape == (n, 37) and set(np.unique(chain.all_atom_mask)) <= {0.0, 1.0}
            assert np.all(chain.all_atom_positions[chain.all_atom_mask == 0] == 0)
            assert len(chain.residue_names) == len(chain.author_residue_ids) == n
            check_chain_usable(entry, chain)  # every shipped chain has a resolved CA
            assert entry.chain_id(author_id) == f"{entry.pdb_id}_{author_id}"


def test_metadata_matches_reference_rules(mmcif_dir: Path) -> None:
    """Release date = earliest revision; X-ray/EM resolution read; NMR has none (NaN); method string kept."""
    aki = parse_mmcif(mmcif_dir / "1aki.cif")
    assert (aki.pdb_id, aki.release_date, aki.resolution, aki.exptl_method) == (
        "1aki",
        "1997-11-19",
        1.5,
        "X-RAY DIFFRACTION",
    )
    nmr = parse_mmcif(mmcif_dir / "2crb.cif")
    assert nmr.exptl_method == "SOLUTION NMR" and math.isnan(nmr.resolution)
    em = parse_mmcif(mmcif_dir / "3zee.cif")
    assert em.exptl_method == "ELECTRON MICROSCOPY" and em.resolution == pytest.approx(6.1)


def test_non_protein_chains_skipped_and_author_chain_ids_used(mmcif_dir: Path) -> None:
    """2q2k: the DNA polymer (label A) is skipped; protein subchains B/C are named by author ids A/B."""
    entry = parse_mmcif(mmcif_dir / "2q2k.cif")
    assert {k: c.mmcif_chain_id for k, c in entry.chains.items()} == {"A": "B", "B": "C"}
    assert entry.chains["A"].sequence.startswith("MGSSHHHHHH") and entry.chains["A"].num_res == 70


def test_missing_residues_are_zero_masked_in_seqres_order(mmcif_dir: Path) -> None:
    """1f2n chain A: 238 SEQRES residues, unobserved ones (e.g. the first 10) carry no atoms and no author id."""
    chain = parse_mmcif(mmcif_dir / "1f2n.cif").chains["A"]
    assert chain.num_res == 238
    missing = np.nonzero(chain.all_atom_mask.sum(-1) == 0)[0]
    assert list(missing[:10]) == list(range(10))
    assert all(chain.author_residue_ids[i] is None for i in missing)
    assert int(chain.all_atom_mask[:, CA].sum()) == 238 - len(missing)


def test_selenomethionine_maps_to_met_with_se_in_sd(mmcif_dir: Path) -> None:
    """4zey MSE residues become 'M' and their SE coordinates land in the SD column."""
    chain = parse_mmcif(mmcif_dir / "4zey.cif").chains["A"]
    structure = gemmi.read_structure(str(mmcif_dir / "4zey.cif"))
    se_by_resid = {
        f"{r.seqid.num}{r.seqid.icode.strip()}": r.find_atom("SE", "*").pos
        for r in structure[0]["A"]
        if r.name == "MSE"
    }
    indices = [i for i, name in enumerate(chain.residue_names) if name == "MSE"]
    assert indices
    for i in indices:
        assert chain.sequence[i] == "M"
        assert chain.all_atom_mask[i, rc.atom_order["SD"]] == 1
        pos = se_by_resid[chain.author_residue_ids[i]]
        np.testing.assert_allclose(chain.all_atom_positions[i, rc.atom_order["SD"]], [pos.x, pos.y, pos.z], atol=1e-3)


def test_only_first_model_is_read(mmcif_dir: Path) -> None:
    """NMR ensembles (2crb, 20 models): coordinates are those of model 1."""
    chain = parse_mmcif(mmcif_dir / "2crb.cif").chains["A"]
    structure = gemmi.read_structure(str(mmcif_dir / "2crb.cif"))
    assert len(structure) > 1
    first_ca = structure[0]["A"][0].find_atom("CA", "*").pos
    np.testing.assert_allclose(chain.all_atom_positions[0, CA], [first_ca.x, first_ca.y, first_ca.z], atol=1e-3)


def test_edge_case_altloc_highest_occupancy_wins(mmcif_dir: Path) -> None:
    """altloc.cif: residue 22 is SER (altlocs A/B, occupancy 0.2 each) or PRO (C, 0.6): PRO is chosen."""
    entry = parse_mmcif(mmcif_dir / "edge_cases" / "altloc.cif")
    chain = entry.chains["A"]
    assert chain.sequence == "P" and chain.residue_names == ("PRO",)
    assert chain.all_atom_mask[0, rc.atom_order["CD"]] == 1  # a PRO atom
    assert chain.all_atom_mask[0, rc.atom_order["OG"]] == 0  # a SER atom
    np.testing.assert_allclose(chain.all_atom_positions[0, rc.atom_order["CB"]], [5.528, 14.895, -2.825], atol=1e-4)


def test_edge_case_odd_residue_numbering(mmcif_dir: Path) -> None:
    """res_ids.cif (no SEQRES, label_seq 5-7 vs author 0-2, glycans on other chains): chain A = 'SDQ'."""
    entry = parse_mmcif(mmcif_dir / "edge_cases" / "res_ids.cif")
    assert not entry.has_seqres
    assert list(entry.chains) == ["A"]
    chain = entry.chains["A"]
    assert chain.sequence == "SDQ"
    assert chain.author_residue_ids == ("0", "1", "2")
    assert chain.all_atom_mask[:, CA].tolist() == [1.0, 1.0, 1.0]


def test_truncated_file_gives_specific_error(mmcif_dir: Path, tmp_path: Path) -> None:
    """A file cut in the middle of the atom table raises MmcifError(corrupt_mmcif) naming the file."""
    bad = tmp_path / "1aki_truncated.cif"
    bad.write_bytes((mmcif_dir / "1aki.cif").read_bytes()[:100_000])
    with pytest.raises(MmcifError) as info:
        parse_mmcif(bad)
    assert info.value.reason == "corrupt_mmcif" and str(bad) in str(info.value)


@pytest.mark.parametrize(
    "content, reason",
    [
        ("this is not a cif file\n", "corrupt_mmcif"),
        ("data_x\n_entry.id X\n", "corrupt_mmcif"),  # no coordinates
        ("", "corrupt_mmcif"),
    ],
)
def test_corrupt_content_gives_specific_error(tmp_path: Path, content: str, reason: str) -> None:
    """Garbage, empty, or coordinate-less files raise MmcifError with a stable reason and the path."""
    bad = tmp_path / "bad.cif"
    bad.write_text(content)
    with pytest.raises(MmcifError) as info:
        parse_mmcif(bad)
    assert info.value.reason == reason and info.value.path == str(bad)


def test_missing_file_and_nucleic_acid_only(tmp_path: Path) -> None:
    """A missing file → reason missing_file; an entry with only a DNA chain → no_protein_chains."""
    with pytest.raises(MmcifError) as info:
        parse_mmcif(tmp_path / "nope.cif")
    assert info.value.reason == "missing_file"
    dna = """data_dna
loop_
_atom_site.group_PDB
_atom_site.id
_atom_site.type_symbol
_atom_site.label_atom_id
_atom_site.label_alt_id
_atom_site.label_comp_id
_atom_site.label_asym_id
_atom_site.label_entity_id
_atom_site.label_seq_id
_atom_site.Cartn_x
_atom_site.Cartn_y
_atom_site.Cartn_z
_atom_site.occupancy
_atom_site.auth_seq_id
_atom_site.auth_asym_id
_atom_site.pdbx_PDB_model_num
ATOM 1 P P . DA A 1 1 0.0 0.0 0.0 1.0 1 A 1
ATOM 2 C "C1'" . DA A 1 1 1.0 0.0 0.0 1.0 1 A 1
"""
    with pytest.raises(MmcifError) as info:
        parse_mmcif_string(dna, path="dna.cif")
    assert info.value.reason == "no_protein_chains"


def test_chain_without_resolved_ca_is_rejected(mmcif_dir: Path) -> None:
    """check_chain_usable raises no_resolved_ca, naming the chain, when no CA is observed."""
    entry = parse_mmcif(mmcif_dir / "1aki.cif")
    chain = entry.chains["A"]
    mask = chain.all_atom_mask.copy()
    mask[:, CA] = 0
    hollow = type(chain)(**{**chain.__dict__, "all_atom_mask": mask})
    with pytest.raises(MmcifError, match="1aki_A") as info:
        check_chain_usable(entry, hollow)
    assert info.value.reason == "no_resolved_ca"


def _arginine(coords: dict) -> gemmi.Residue:
    residue = gemmi.Residue()
    residue.name = "ARG"
    for name, xyz in coords.items():
        atom = gemmi.Atom()
        atom.name = name
        atom.occ = 1.0
        atom.pos = gemmi.Position(*xyz)
        residue.add_atom(atom)
    return residue


def test_arginine_nh_names_kept_as_deposited_by_default():
    """ARG NH1/NH2 keep the file's names, as the MLPerf reference reads them (NH2 nearer CD here)."""
    from scalefold.data.parsers.mmcif import _atom37_of_residue

    residue = _arginine({"CD": (0.0, 0.0, 0.0), "NH1": (3.0, 0.0, 0.0), "NH2": (1.5, 0.0, 0.0)})
    positions, mask = _atom37_of_residue(residue)
    assert mask[rc.atom_order["NH1"]] == 1 and mask[rc.atom_order["NH2"]] == 1
    assert positions[rc.atom_order["NH1"]][0] == 3.0
    assert positions[rc.atom_order["NH2"]][0] == 1.5


def test_arginine_renaming_is_an_explicit_opt_in(mmcif_dir: Path):
    """``fix_arginine_naming=True`` swaps NH1/NH2 so NH1 is nearer CD; on 3u8v chain B (arginine 86
    deposited the other way round) only arginine NH columns move, and only by the swap."""
    from scalefold.data.parsers.mmcif import _atom37_of_residue

    residue = _arginine({"CD": (0.0, 0.0, 0.0), "NH1": (3.0, 0.0, 0.0), "NH2": (1.5, 0.0, 0.0)})
    positions, _ = _atom37_of_residue(residue, fix_arginine_naming=True)
    assert positions[rc.atom_order["NH1"]][0] == 1.5 and positions[rc.atom_order["NH2"]][0] == 3.0

    plain = parse_mmcif(mmcif_dir / "3u8v.cif").chains["B"]
    fixed = parse_mmcif(mmcif_dir / "3u8v.cif", fix_arginine_naming=True).chains["B"]
    nh1, nh2, cd = (rc.atom_order[n] for n in ("NH1", "NH2", "CD"))
    changed = np.any(plain.all_atom_positions != fixed.all_atom_positions, axis=-1)  # [N, 37]
    moved = sorted({int(i) for i in np.nonzero(changed)[0]})
    assert moved and all(plain.sequence[i] == "R" for i in moved)
    np.testing.assert_array_equal(plain.all_atom_mask, fixed.all_atom_mask)
    for i in moved:
        np.testing.assert_array_equal(fixed.all_atom_positions[i, [nh1, nh2]], plain.all_atom_positions[i, [nh2, nh1]])
        d = np.linalg.norm(fixed.all_atom_positions[i, [nh1, nh2]] - fixed.all_atom_positions[i, cd], axis=-1)
        assert d[0] <= d[1]


def _mini_cif(chem_type: str = "L-peptide linking", auth_atom: str = "CA", auth_comp: str = "GLY") -> str:
    """One ALA residue of entity 1 (chain A) plus a DNA entity 2 (chain B); the CA's author atom name
    and residue name can be set apart from its label ones."""
    return f"""data_MINI
_entry.id MINI
loop_
_entity_poly_seq.entity_id
_entity_poly_seq.num
_entity_poly_seq.mon_id
1 1 ALA
2 1 DA
loop_
_chem_comp.id
_chem_comp.type
ALA '{chem_type}'
DA 'DNA linking'
loop_
_struct_asym.id
_struct_asym.entity_id
A 1
B 2
loop_
_atom_site.group_PDB
_atom_site.id
_atom_site.type_symbol
_atom_site.label_atom_id
_atom_site.auth_atom_id
_atom_site.label_alt_id
_atom_site.label_comp_id
_atom_site.auth_comp_id
_atom_site.label_asym_id
_atom_site.label_entity_id
_atom_site.label_seq_id
_atom_site.Cartn_x
_atom_site.Cartn_y
_atom_site.Cartn_z
_atom_site.occupancy
_atom_site.auth_seq_id
_atom_site.auth_asym_id
_atom_site.pdbx_PDB_model_num
ATOM 1 N N N . ALA {auth_comp} A 1 1 0.0 0.0 0.0 1.0 1 A 1
ATOM 2 C CA {auth_atom} . ALA {auth_comp} A 1 1 1.5 0.0 0.0 1.0 1 A 1
ATOM 3 P P P . DA DA B 2 1 9.0 0.0 0.0 1.0 1 B 1
"""


def test_atoms_and_residues_take_their_label_names(tmp_path: Path):
    """As Biopython (the reference's parser): ``label_atom_id`` / ``label_comp_id`` name atoms and
    residues even where the author names differ (gemmi alone would use the author ones)."""
    chain = parse_mmcif_string(_mini_cif(auth_atom="XX", auth_comp="GLY")).chains["A"]
    assert chain.residue_names == ("ALA",) and chain.sequence == "A"
    assert chain.all_atom_mask[0, CA] == 1 and chain.all_atom_positions[0, CA, 0] == 1.5


def test_protein_entities_are_found_case_sensitively_as_the_reference(tmp_path: Path):
    """An entity is protein when a monomer's ``_chem_comp.type`` contains "peptide" (case-sensitive,
    as the reference); the cheap header reader returns exactly the protein chains the parser does."""
    from scalefold.data.parsers.mmcif import read_entry_header

    path = tmp_path / "mini.cif"
    path.write_text(_mini_cif())
    assert list(parse_mmcif(path).chains) == ["A"]
    assert read_entry_header(path) == ("mini", None, frozenset({"A"}))  # DNA chain B left out
    with pytest.raises(MmcifError) as info:
        parse_mmcif_string(_mini_cif(chem_type="L-PEPTIDE LINKING"))
    assert info.value.reason == "no_protein_chains"
    path.write_text(_mini_cif(chem_type="L-PEPTIDE LINKING"))
    assert read_entry_header(path)[2] == frozenset()


def test_header_chains_equal_parsed_protein_chains(mmcif_dir: Path):
    """On every shared file the header's chain set is the parser's protein chain set (2q2k: its DNA
    chain is not a template candidate, as in the reference's ``template_pdb_chain_ids``)."""
    from scalefold.data.parsers.mmcif import read_entry_header

    for path in sorted(mmcif_dir.rglob("*.cif")):
        assert read_entry_header(path)[2] == frozenset(parse_mmcif(path).chains), path
