"""Residue constants: table shapes, known values, and consistency with the reference pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from scalefold import residue_constants as rc


def test_alphabets():
    """20 standard residue types in AlphaFold order, X appended, 3<->1 maps inverse of each other."""
    assert rc.restype_num == 20 and len(rc.restypes) == 20
    assert rc.restypes[:5] == ["A", "R", "N", "D", "C"] and rc.restype_order["V"] == 19
    assert rc.restypes_with_x[-1] == "X" and rc.unk_restype_index == 20
    assert all(rc.restype_3to1[rc.restype_1to3[r]] == r for r in rc.restypes)
    assert rc.resnames[-1] == "UNK" and rc.resname_to_idx["GLY"] == 7


def test_atom_types():
    """37 atom types with N, CA, C first and OXT last; atom14 rows have 14 names."""
    assert rc.atom_type_num == 37 and len(rc.atom_order) == 37
    assert rc.atom_types[:3] == ["N", "CA", "C"] and rc.atom_order["CB"] == 3 and rc.atom_order["OXT"] == 36
    assert all(len(v) == 14 for v in rc.restype_name_to_atom14_names.values())


def test_atom14_masks_count_heavy_atoms():
    """Per-residue atom counts: GLY 4, ALA 5, TRP 14, UNK 0; atom37 and atom14 masks agree."""
    counts = rc.restype_atom14_mask.sum(axis=1)
    assert counts.shape == (21,)
    assert counts[rc.restype_order["G"]] == 4
    assert counts[rc.restype_order["A"]] == 5
    assert counts[rc.restype_order["W"]] == 14
    assert counts[20] == 0
    np.testing.assert_array_equal(counts, rc.restype_atom37_mask.sum(axis=1))
    np.testing.assert_array_equal(rc.STANDARD_ATOM_MASK, rc.restype_atom37_mask.astype(np.int32))


def test_atom14_atom37_maps_round_trip():
    """atom14 -> atom37 -> atom14 returns every existing atom14 slot."""
    for restype in range(20):
        for slot in range(14):
            if rc.restype_atom14_mask[restype, slot]:
                a37 = rc.restype_atom14_to_atom37[restype, slot]
                assert rc.restype_atom37_to_atom14[restype, a37] == slot


def test_rigid_group_tables():
    """Shapes and dtypes of the Alg. 24 tables; default frames are proper rigid transforms."""
    assert rc.restype_rigid_group_default_frame.shape == (21, 8, 4, 4)
    assert rc.restype_rigid_group_default_frame.dtype == np.float32  # as in the reference
    assert rc.restype_atom14_to_rigid_group.shape == (21, 14)
    assert rc.restype_atom14_rigid_group_positions.shape == (21, 14, 3)
    rots = rc.restype_rigid_group_default_frame[:20, :, :3, :3].astype(np.float64)
    used = np.array(rc.chi_angles_mask)  # chi frames of absent chis stay all-zero
    for restype in range(20):
        for group in range(8):
            if group >= 4 and not used[restype, group - 4]:
                continue
            r = rots[restype, group]
            np.testing.assert_allclose(r @ r.T, np.eye(3), atol=1e-6)
            assert np.linalg.det(r) == pytest.approx(1.0, abs=1e-6)
    # Backbone atoms sit in group 0 at the literature positions; CA at the origin.
    ala = rc.restype_order["A"]
    np.testing.assert_allclose(rc.restype_atom14_rigid_group_positions[ala, 1], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(rc.restype_atom14_rigid_group_positions[ala, 0], [-0.525, 1.363, 0.0], rtol=1e-6)
    assert rc.restype_atom14_to_rigid_group[ala, 3] == 3  # O belongs to the psi group


def test_chi_tables():
    """chi masks agree with chi_angles_atoms; pi-periodic chis are ASP chi2, GLU chi3, PHE/TYR chi2."""
    for restype, letter in enumerate(rc.restypes):
        n_chi = len(rc.chi_angles_atoms[rc.restype_1to3[letter]])
        assert sum(rc.chi_angles_mask[restype]) == n_chi
    periodic = {(r, c) for r in range(21) for c in range(4) if rc.chi_pi_periodic[r][c]}
    expected = {
        (rc.restype_order["D"], 1),
        (rc.restype_order["E"], 2),
        (rc.restype_order["F"], 1),
        (rc.restype_order["Y"], 1),
    }
    assert periodic == expected
    assert rc.chi_angles_atom_indices.shape == (20, 4, 4)


def test_ambiguous_atoms():
    """Swappable atoms: ASP OD1/OD2, GLU OE1/OE2, PHE and TYR ring atoms; swap is an involution."""
    asp = rc.restype_order["D"]
    assert rc.restype_atom14_ambiguous_atoms[asp].sum() == 2
    assert rc.restype_atom14_ambiguous_atoms_swap_idx[asp, 6] == 7
    swap = rc.restype_atom14_ambiguous_atoms_swap_idx
    np.testing.assert_array_equal(np.take_along_axis(swap, swap, axis=1), np.tile(np.arange(14), (21, 1)))


def test_stereo_chemistry():
    """Violation-loss constants: peptide bond lengths, cos angles, dist bounds shapes and values."""
    assert rc.between_res_bond_length_c_n == [1.329, 1.341]
    assert rc.between_res_bond_length_stddev_c_n == [0.014, 0.016]
    assert rc.between_res_cos_angles_c_n_ca == [-0.5203, 0.0353]
    assert rc.between_res_cos_angles_ca_c_n == [-0.4473, 0.0311]
    bonds, virtual_bonds, angles = rc.load_stereo_chemical_props()
    assert set(bonds) == set(rc.residue_atoms) | {"UNK"}
    # Every residue's bond graph covers all its heavy atoms (a tree has n-1 bonds, rings more).
    for resname, atoms in rc.residue_atoms.items():
        assert {a for b in bonds[resname] for a in (b.atom1_name, b.atom2_name)} == set(atoms)
        assert len(bonds[resname]) >= len(atoms) - 1
        assert len(virtual_bonds[resname]) == len(angles[resname])
    bounds = rc.make_atom14_dists_bounds()
    assert {k: v.shape for k, v in bounds.items()} == {
        k: (21, 14, 14) for k in ("lower_bound", "upper_bound", "stddev")
    }
    arg = rc.restype_order["R"]
    # N-CA bond of ARG: 1.459 +- 15 * 0.020
    assert bounds["lower_bound"][arg, 0, 1] == pytest.approx(1.459 - 15 * 0.020, rel=1e-6)
    assert bounds["upper_bound"][arg, 0, 1] == pytest.approx(1.459 + 15 * 0.020, rel=1e-6)
    # Non-bonded N..O in ARG: clash bound only (1.55 + 1.52 - 1.5).
    assert bounds["lower_bound"][arg, 0, 3] != 0
    assert bounds["upper_bound"][arg, 7, 3] == pytest.approx(1e10)
    assert bounds["lower_bound"][arg, 7, 3] == pytest.approx(1.55 + 1.52 - 1.5, rel=1e-6)


def test_hhblits_and_onehot():
    """HHblits ids map to our order (A, C, D ...; gap -> 21); sequence_to_onehot encodes and maps unknowns to X."""
    assert rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE[:3] == (0, 4, 3)
    assert rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE[20:] == (20, 21)
    assert rc.HHBLITS_AA_TO_ID["U"] == rc.HHBLITS_AA_TO_ID["C"]
    oh = rc.sequence_to_onehot("ARZ", rc.restype_order_with_x, map_unknown_to_x=True)
    assert oh.shape == (3, 21) and oh.dtype == np.int32
    assert list(oh.argmax(-1)) == [0, 1, 20]
    with pytest.raises(KeyError):
        rc.sequence_to_onehot("Z", rc.restype_order_with_x)
    assert rc.aatype_to_str_sequence([0, 1, 20]) == "ARX"


def test_matches_reference_pipeline_features(golden_small):
    """The atom14/atom37 tables reproduce the reference pipeline's per-residue features."""
    batch = golden_small["batch"]
    aatype = batch["aatype"][0, :, -1].numpy()
    seq_mask = batch["seq_mask"][0, :, -1].numpy().astype(bool)
    aatype = aatype[seq_mask]
    np.testing.assert_array_equal(
        rc.restype_atom37_to_atom14[aatype], batch["residx_atom37_to_atom14"][0, seq_mask, :, -1].numpy()
    )
    np.testing.assert_array_equal(
        rc.restype_atom14_to_atom37[aatype], batch["residx_atom14_to_atom37"][0, seq_mask, :, -1].numpy()
    )
    np.testing.assert_array_equal(
        rc.restype_atom14_mask[aatype], batch["atom14_atom_exists"][0, seq_mask, :, -1].numpy()
    )
    np.testing.assert_array_equal(
        rc.restype_atom37_mask[aatype], batch["atom37_atom_exists"][0, seq_mask, :, -1].numpy()
    )
