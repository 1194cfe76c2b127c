"""PDB / mmCIF writers: fixed PDB columns, round trips through gemmi and our mmCIF parser."""

from __future__ import annotations

import gemmi
import numpy as np
import pytest

from scalefold import residue_constants as rc
from scalefold.data.parsers.mmcif import parse_mmcif, parse_mmcif_string
from scalefold.inference.structure_io import PredictedStructure, structure_format, to_mmcif, to_pdb, write_structure

# No ARG: our mmCIF parser renames NH1/NH2 by geometry, which random coordinates would trigger.
RANDOM_ALPHABET = [a for a in rc.restypes if a != "R"] + ["X"]


def random_structure(seed: int = 0, num_res: int = 17) -> PredictedStructure:
    rng = np.random.default_rng(seed)
    sequence = "".join(rng.choice(RANDOM_ALPHABET, size=num_res))
    sequence = "M" + sequence[1:4] + "X" + sequence[5:]  # at least one unknown residue
    aatype = [rc.restype_order_with_x[a] for a in sequence]
    mask = rc.STANDARD_ATOM_MASK[aatype].astype(np.float32)  # X: no atoms
    positions = rng.uniform(-99.0, 999.0, size=(num_res, 37, 3)) * mask[..., None]
    plddt = rng.uniform(0.0, 100.0, size=num_res)
    return PredictedStructure(sequence, positions, mask, plddt, chain_id="B", name="rand")


def _atom_rows(structure: PredictedStructure):
    return list(structure.atoms())


def test_pdb_records_sit_in_their_fixed_columns():
    """Every line is 80 columns; ATOM fields read back by column ranges of the wwPDB v3.3 guide equal
    the structure (names, residue numbers from 1, coordinates to 3 decimals, B-factor = pLDDT)."""
    s = random_structure()
    lines = to_pdb(s).splitlines()
    assert all(len(line) == 80 for line in lines)
    atoms = [line for line in lines if line.startswith("ATOM  ")]
    expected = _atom_rows(s)
    assert len(atoms) == len(expected) == int(s.atom_mask.sum())
    for serial, (line, (i, resname, name, element, xyz, plddt)) in enumerate(zip(atoms, expected), start=1):
        assert int(line[6:11]) == serial
        assert line[12:16].strip() == name and line[13] == name[0]  # one-letter elements start in column 14
        assert line[17:20] == resname and line[21] == "B" and int(line[22:26]) == i + 1
        np.testing.assert_allclose([float(line[30:38]), float(line[38:46]), float(line[46:54])], xyz, atol=5e-4)
        assert float(line[54:60]) == 1.0
        assert abs(float(line[60:66]) - plddt) <= 5e-3
        assert line[76:78].strip() == element
    seqres = [line for line in lines if line.startswith("SEQRES")]
    assert all(line[11] == "B" and int(line[13:17]) == len(s.sequence) for line in seqres)
    assert [name for line in seqres for name in line[19:].split()] == s.residue_names
    assert lines[-1].strip() == "END" and lines[-2].startswith("TER")


def test_pdb_round_trip_through_gemmi(tmp_path):
    """gemmi reads the PDB back: coordinates to file precision, B-factors = pLDDT, SEQRES sequence
    (with UNK for X) = the full sequence."""
    s = random_structure(seed=1)
    path = write_structure(s, tmp_path / "pred.pdb")
    st = gemmi.read_structure(str(path))
    st.setup_entities()
    chain = st[0]["B"]
    read = [(r.seqid.num - 1, r.name, a.name, [a.pos.x, a.pos.y, a.pos.z], a.b_iso) for r in chain for a in r]
    expected = _atom_rows(s)
    assert [(i, rn, an) for i, rn, an, _, _ in read] == [(i, rn, an) for i, rn, an, _, _, _ in expected]
    np.testing.assert_allclose([x for *_, x, _ in read], [e[4] for e in expected], atol=5e-4)
    np.testing.assert_allclose([b for *_, b in read], [e[5] for e in expected], atol=5e-3)
    assert list(st.entities[0].full_sequence) == s.residue_names


def test_mmcif_round_trip_through_our_parser_and_gemmi(tmp_path):
    """scalefold's mmCIF parser reads the written file back as a protein chain with the same
    sequence (X included), atom mask and coordinates (to 3 decimals); gemmi sees B-factor = pLDDT."""
    s = random_structure(seed=2)
    s.name = "tr|P69905|HBA HUMAN"  # FASTA-style names become a valid data block name
    path = write_structure(s, tmp_path / "pred.cif")
    chain = parse_mmcif(path).chains["B"]
    assert chain.sequence == s.sequence
    np.testing.assert_array_equal(chain.all_atom_mask, s.atom_mask)
    np.testing.assert_allclose(chain.all_atom_positions, s.atom_positions, atol=6e-4)
    st = gemmi.read_structure(str(path))
    for residue in st[0]["B"]:
        assert all(abs(a.b_iso - s.plddt[residue.seqid.num - 1]) <= 5e-3 for a in residue)
    assert st[0]["B"].count_atom_sites() == int(s.atom_mask.sum())


def test_real_structure_survives_both_formats(data_dir, tmp_path):
    """A real PDB entry (1L2Y, Trp-cage, NMR) parsed, written as PDB and mmCIF and parsed again keeps
    its sequence, atoms and coordinates."""
    source = parse_mmcif(data_dir / "mmcif" / "1l2y.cif").chains["A"]
    plddt = np.linspace(10.0, 95.0, source.num_res)
    s = PredictedStructure(source.sequence, source.all_atom_positions, source.all_atom_mask, plddt, name="1l2y")
    back = parse_mmcif_string(to_mmcif(s)).chains["A"]
    assert back.sequence == source.sequence
    np.testing.assert_array_equal(back.all_atom_mask, source.all_atom_mask)
    np.testing.assert_allclose(back.all_atom_positions, source.all_atom_positions, atol=6e-4)
    st = gemmi.read_structure(str(write_structure(s, tmp_path / "1l2y.pdb")))
    ca = np.array([[r["CA"][0].pos.x, r["CA"][0].pos.y, r["CA"][0].pos.z] for r in st[0]["A"]])
    np.testing.assert_allclose(ca, source.all_atom_positions[:, rc.atom_order["CA"]], atol=6e-4)


def test_bad_structures_and_paths_are_refused(tmp_path):
    s = random_structure()
    with pytest.raises(ValueError, match="atom_mask has shape"):
        PredictedStructure(s.sequence, s.atom_positions, s.atom_mask[:-1], s.plddt)
    with pytest.raises(ValueError, match="outside the 20 amino acids"):
        PredictedStructure("B" + s.sequence[1:], s.atom_positions, s.atom_mask, s.plddt)
    with pytest.raises(ValueError, match="non-finite"):
        PredictedStructure(s.sequence, s.atom_positions, s.atom_mask, np.full_like(s.plddt, np.nan))
    with pytest.raises(ValueError, match=r"\.pdb or \.cif"):
        structure_format(tmp_path / "pred.xyz")
    far = PredictedStructure(s.sequence, s.atom_positions * 20.0, s.atom_mask, s.plddt)
    with pytest.raises(ValueError, match="does not fit the PDB format"):
        write_structure(far, tmp_path / "far.pdb")
    assert list(tmp_path.iterdir()) == []  # no partial or temporary file left behind
    write_structure(far, tmp_path / "far.cif")  # mmCIF has no column limits
