"""AlphaFold residue constants: amino-acid alphabets, atom layouts, rigid groups, stereochemistry.

Values follow the MLPerf HPC OpenFold reference (``openfold/data/residue_constants.py``, itself
DeepMind's AlphaFold ``common/residue_constants.py``) exactly; these are physical constants and
lookup tables, so they are reproduced as is. The module is organised as

1. alphabets: ``restypes``, ``restype_order``, 1<->3 letter maps, HHblits MSA alphabet;
2. atom layouts: 37 atom types (``atom_types``), the compact 14-atom layout
   (``restype_name_to_atom14_names``) and the maps between them;
3. torsions and rigid groups (Supplementary 1.8, Table 2): ``chi_angles_atoms``,
   ``chi_angles_mask``, ``chi_pi_periodic``, ``rigid_group_atom_positions`` and the derived
   ``restype_rigid_group_default_frame`` / ``restype_atom14_*`` tables (Alg. 24);
4. stereochemistry used by the violation loss (Supplementary 1.9.11): van der Waals radii,
   between-residue bond lengths/angles and ``make_atom14_dists_bounds``.

Numerical note: like the reference, the derived geometry tables (``restype_*_positions``,
``restype_rigid_group_default_frame``) are stored as float32 numpy arrays. The model converts
them to the compute dtype, so a float64 run sees exactly the float32-rounded values the
reference goldens were produced with.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------
# 1. Alphabets
# ---------------------------------------------------------------------------------------------

# Standard residue order when coding the amino-acid type as a number: the 3-letter codes sorted
# alphabetically (ALA, ARG, ASN, ASP, ...).
restypes: list[str] = [
    "A", "R", "N", "D", "C", "Q", "E", "G", "H", "I",
    "L", "K", "M", "F", "P", "S", "T", "W", "Y", "V",
]  # fmt: skip
restype_order: dict[str, int] = {restype: i for i, restype in enumerate(restypes)}
restype_num: int = len(restypes)  # 20
unk_restype_index: int = restype_num  # catch-all index for unknown residue types

restypes_with_x: list[str] = restypes + ["X"]
restype_order_with_x: dict[str, int] = {restype: i for i, restype in enumerate(restypes_with_x)}
restypes_with_x_and_gap: list[str] = restypes_with_x + ["-"]

restype_1to3: dict[str, str] = {
    "A": "ALA", "R": "ARG", "N": "ASN", "D": "ASP", "C": "CYS",
    "Q": "GLN", "E": "GLU", "G": "GLY", "H": "HIS", "I": "ILE",
    "L": "LEU", "K": "LYS", "M": "MET", "F": "PHE", "P": "PRO",
    "S": "SER", "T": "THR", "W": "TRP", "Y": "TYR", "V": "VAL",
}  # fmt: skip
# A strict 1-to-1 inverse (unlike Bio.PDB's protein_letters_3to1, which maps many rare names).
restype_3to1: dict[str, str] = {v: k for k, v in restype_1to3.items()}

unk_restype: str = "UNK"
resnames: list[str] = [restype_1to3[r] for r in restypes] + [unk_restype]
resname_to_idx: dict[str, int] = {resname: i for i, resname in enumerate(resnames)}

# HHblits alphabet: B -> D, J and O -> X, U -> C, Z -> E; the 20 standard amino acids in
# alphabetical one-letter order, then X (any) = 20 and the gap "-" = 21.
HHBLITS_AA_TO_ID: dict[str, int] = {
    "A": 0, "B": 2, "C": 1, "D": 2, "E": 3, "F": 4, "G": 5, "H": 6, "I": 7,
    "J": 20, "K": 8, "L": 9, "M": 10, "N": 11, "O": 20, "P": 12, "Q": 13,
    "R": 14, "S": 15, "T": 16, "U": 1, "V": 17, "W": 18, "X": 20, "Y": 19,
    "Z": 3, "-": 21,
}  # fmt: skip

# Partial inverse of HHBLITS_AA_TO_ID (1 also stands for U, 2 for B, 3 for Z, 20 for J and O).
ID_TO_HHBLITS_AA: dict[int, str] = {
    0: "A", 1: "C", 2: "D", 3: "E", 4: "F", 5: "G", 6: "H", 7: "I", 8: "K", 9: "L",
    10: "M", 11: "N", 12: "P", 13: "Q", 14: "R", 15: "S", 16: "T", 17: "V", 18: "W",
    19: "Y", 20: "X", 21: "-",
}  # fmt: skip

# HHblits id -> our id (``restypes_with_x_and_gap`` order).
MAP_HHBLITS_AATYPE_TO_OUR_AATYPE: tuple[int, ...] = tuple(
    restypes_with_x_and_gap.index(ID_TO_HHBLITS_AA[i]) for i in range(len(restypes_with_x_and_gap))
)


def sequence_to_onehot(sequence: str, mapping: Mapping[str, int], map_unknown_to_x: bool = False) -> np.ndarray:
    """One-hot encode ``sequence`` with ``mapping`` -> int32 array ``[len(sequence), num_classes]``.

    ``mapping`` must use every value 0..num_classes-1. With ``map_unknown_to_x`` letters missing
    from ``mapping`` become ``"X"`` (non upper-case letters raise); otherwise they raise KeyError.
    """
    num_entries = max(mapping.values()) + 1
    if sorted(set(mapping.values())) != list(range(num_entries)):
        raise ValueError(
            f"The mapping must have values from 0 to num_unique_aas-1 without any gaps. Got: {sorted(mapping.values())}"
        )
    one_hot = np.zeros((len(sequence), num_entries), dtype=np.int32)
    for i, aa in enumerate(sequence):
        if map_unknown_to_x:
            if not (aa.isalpha() and aa.isupper()):
                raise ValueError(f"Invalid character in the sequence: {aa}")
            aa_id = mapping.get(aa, mapping["X"])
        else:
            aa_id = mapping[aa]
        one_hot[i, aa_id] = 1
    return one_hot


def aatype_to_str_sequence(aatype: Sequence[int]) -> str:
    """Inverse of the ``restypes_with_x`` encoding: integer residue types -> one-letter string."""
    return "".join(restypes_with_x[int(a)] for a in aatype)


# ---------------------------------------------------------------------------------------------
# 2. Atom layouts
# ---------------------------------------------------------------------------------------------

# Distance from one CA to the next CA [trans configuration: omega = 180].
ca_ca: float = 3.80209737096

# The 37 heavy-atom types (atom37 layout).
atom_types: list[str] = [
    "N", "CA", "C", "CB", "O", "CG", "CG1", "CG2", "OG", "OG1", "SG", "CD", "CD1",
    "CD2", "ND1", "ND2", "OD1", "OD2", "SD", "CE", "CE1", "CE2", "CE3", "NE", "NE1",
    "NE2", "OE1", "OE2", "CH2", "NH1", "NH2", "OH", "CZ", "CZ2", "CZ3", "NZ", "OXT",
]  # fmt: skip
atom_order: dict[str, int] = {atom_type: i for i, atom_type in enumerate(atom_types)}
atom_type_num: int = len(atom_types)  # 37

# Heavy atoms of each residue type (PDB naming).
residue_atoms: dict[str, list[str]] = {
    "ALA": ["C", "CA", "CB", "N", "O"],
    "ARG": ["C", "CA", "CB", "CG", "CD", "CZ", "N", "NE", "O", "NH1", "NH2"],
    "ASP": ["C", "CA", "CB", "CG", "N", "O", "OD1", "OD2"],
    "ASN": ["C", "CA", "CB", "CG", "N", "ND2", "O", "OD1"],
    "CYS": ["C", "CA", "CB", "N", "O", "SG"],
    "GLU": ["C", "CA", "CB", "CG", "CD", "N", "O", "OE1", "OE2"],
    "GLN": ["C", "CA", "CB", "CG", "CD", "N", "NE2", "O", "OE1"],
    "GLY": ["C", "CA", "N", "O"],
    "HIS": ["C", "CA", "CB", "CG", "CD2", "CE1", "N", "ND1", "NE2", "O"],
    "ILE": ["C", "CA", "CB", "CG1", "CG2", "CD1", "N", "O"],
    "LEU": ["C", "CA", "CB", "CG", "CD1", "CD2", "N", "O"],
    "LYS": ["C", "CA", "CB", "CG", "CD", "CE", "N", "NZ", "O"],
    "MET": ["C", "CA", "CB", "CG", "CE", "N", "O", "SD"],
    "PHE": ["C", "CA", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "N", "O"],
    "PRO": ["C", "CA", "CB", "CG", "CD", "N", "O"],
    "SER": ["C", "CA", "CB", "N", "O", "OG"],
    "THR": ["C", "CA", "CB", "CG2", "N", "O", "OG1"],
    "TRP": ["C", "CA", "CB", "CG", "CD1", "CD2", "CE2", "CE3", "CZ2", "CZ3", "CH2", "N", "NE1", "O"],
    "TYR": ["C", "CA", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "N", "O", "OH"],
    "VAL": ["C", "CA", "CB", "CG1", "CG2", "N", "O"],
}

# Compact 14-column atom layout ("" = no atom in that slot).
# fmt: off
restype_name_to_atom14_names: dict[str, list[str]] = {
    "ALA": ["N", "CA", "C", "O", "CB", "", "", "", "", "", "", "", "", ""],
    "ARG": ["N", "CA", "C", "O", "CB", "CG", "CD", "NE", "CZ", "NH1", "NH2", "", "", ""],
    "ASN": ["N", "CA", "C", "O", "CB", "CG", "OD1", "ND2", "", "", "", "", "", ""],
    "ASP": ["N", "CA", "C", "O", "CB", "CG", "OD1", "OD2", "", "", "", "", "", ""],
    "CYS": ["N", "CA", "C", "O", "CB", "SG", "", "", "", "", "", "", "", ""],
    "GLN": ["N", "CA", "C", "O", "CB", "CG", "CD", "OE1", "NE2", "", "", "", "", ""],
    "GLU": ["N", "CA", "C", "O", "CB", "CG", "CD", "OE1", "OE2", "", "", "", "", ""],
    "GLY": ["N", "CA", "C", "O", "", "", "", "", "", "", "", "", "", ""],
    "HIS": ["N", "CA", "C", "O", "CB", "CG", "ND1", "CD2", "CE1", "NE2", "", "", "", ""],
    "ILE": ["N", "CA", "C", "O", "CB", "CG1", "CG2", "CD1", "", "", "", "", "", ""],
    "LEU": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "", "", "", "", "", ""],
    "LYS": ["N", "CA", "C", "O", "CB", "CG", "CD", "CE", "NZ", "", "", "", "", ""],
    "MET": ["N", "CA", "C", "O", "CB", "CG", "SD", "CE", "", "", "", "", "", ""],
    "PHE": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "", "", ""],
    "PRO": ["N", "CA", "C", "O", "CB", "CG", "CD", "", "", "", "", "", "", ""],
    "SER": ["N", "CA", "C", "O", "CB", "OG", "", "", "", "", "", "", "", ""],
    "THR": ["N", "CA", "C", "O", "CB", "OG1", "CG2", "", "", "", "", "", "", ""],
    "TRP": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "NE1", "CE2", "CE3", "CZ2", "CZ3", "CH2"],
    "TYR": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "OH", "", ""],
    "VAL": ["N", "CA", "C", "O", "CB", "CG1", "CG2", "", "", "", "", "", "", ""],
    "UNK": ["", "", "", "", "", "", "", "", "", "", "", "", "", ""],
}
# fmt: on
atom14_num: int = 14


def _make_atom14_atom37_maps() -> tuple[np.ndarray, np.ndarray]:
    """``[21, 14]`` atom14 -> atom37 index and ``[21, 37]`` atom37 -> atom14 index (0 where absent)."""
    to_atom37, to_atom14 = [], []
    for resname in resnames:
        names14 = restype_name_to_atom14_names[resname]
        to_atom37.append([atom_order[name] if name else 0 for name in names14])
        to_atom14.append([names14.index(name) if name in names14 else 0 for name in atom_types])
    return np.array(to_atom37, dtype=np.int64), np.array(to_atom14, dtype=np.int64)


# Per residue type (index = ``restype_order``, row 20 = UNK with no atoms).
restype_atom14_to_atom37, restype_atom37_to_atom14 = _make_atom14_atom37_maps()


def _make_standard_atom_mask() -> np.ndarray:
    """``[21, 37]`` int32 mask of the atoms each residue type has (UNK row all 0)."""
    mask = np.zeros((restype_num + 1, atom_type_num), dtype=np.int32)
    for restype, letter in enumerate(restypes):
        for atom_name in residue_atoms[restype_1to3[letter]]:
            mask[restype, atom_order[atom_name]] = 1
    return mask


STANDARD_ATOM_MASK: np.ndarray = _make_standard_atom_mask()

# Ambiguous atom names: symmetric side chains whose atom naming can be swapped without changing
# the structure (the lDDT paper lists 7, the ambiguity in LEU, VAL and ARG resolves from geometry).
residue_atom_renaming_swaps: dict[str, dict[str, str]] = {
    "ASP": {"OD1": "OD2"},
    "GLU": {"OE1": "OE2"},
    "PHE": {"CD1": "CD2", "CE1": "CE2"},
    "TYR": {"CD1": "CD2", "CE1": "CE2"},
}


def _make_atom14_ambiguity_feats() -> tuple[np.ndarray, np.ndarray]:
    """``[21, 14]`` float32 ambiguous-atom mask and int64 index of each atom's swap partner."""
    ambiguous = np.zeros((21, 14), dtype=np.float32)
    swap_idx = np.tile(np.arange(14, dtype=np.int64), reps=(21, 1))
    for resname, pairs in residue_atom_renaming_swaps.items():
        res_idx = restype_order[restype_3to1[resname]]
        names14 = restype_name_to_atom14_names[resname]
        for atom1, atom2 in pairs.items():
            i1, i2 = names14.index(atom1), names14.index(atom2)
            ambiguous[res_idx, i1] = ambiguous[res_idx, i2] = 1
            swap_idx[res_idx, i1], swap_idx[res_idx, i2] = i2, i1
    return ambiguous, swap_idx


restype_atom14_ambiguous_atoms, restype_atom14_ambiguous_atoms_swap_idx = _make_atom14_ambiguity_feats()

# ---------------------------------------------------------------------------------------------
# 3. Torsion angles and rigid groups (Supplementary 1.8, Table 2)
# ---------------------------------------------------------------------------------------------

# chi1..chi4 defining atoms per residue type (chi5 of ARG is always 0 +- 5 deg: ignored).
chi_angles_atoms: dict[str, list[list[str]]] = {
    "ALA": [],
    "ARG": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "NE"], ["CG", "CD", "NE", "CZ"]],
    "ASN": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],
    "ASP": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],
    "CYS": [["N", "CA", "CB", "SG"]],
    "GLN": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],
    "GLU": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],
    "GLY": [],
    "HIS": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "ND1"]],
    "ILE": [["N", "CA", "CB", "CG1"], ["CA", "CB", "CG1", "CD1"]],
    "LEU": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "LYS": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "CE"], ["CG", "CD", "CE", "NZ"]],
    "MET": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "SD"], ["CB", "CG", "SD", "CE"]],
    "PHE": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "PRO": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"]],
    "SER": [["N", "CA", "CB", "OG"]],
    "THR": [["N", "CA", "CB", "OG1"]],
    "TRP": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "TYR": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "VAL": [["N", "CA", "CB", "CG1"]],
}

# Which of chi1..chi4 exist, per residue type in ``restype_order`` (20 rows).
chi_angles_mask: list[list[float]] = [
    [0.0, 0.0, 0.0, 0.0],  # ALA
    [1.0, 1.0, 1.0, 1.0],  # ARG
    [1.0, 1.0, 0.0, 0.0],  # ASN
    [1.0, 1.0, 0.0, 0.0],  # ASP
    [1.0, 0.0, 0.0, 0.0],  # CYS
    [1.0, 1.0, 1.0, 0.0],  # GLN
    [1.0, 1.0, 1.0, 0.0],  # GLU
    [0.0, 0.0, 0.0, 0.0],  # GLY
    [1.0, 1.0, 0.0, 0.0],  # HIS
    [1.0, 1.0, 0.0, 0.0],  # ILE
    [1.0, 1.0, 0.0, 0.0],  # LEU
    [1.0, 1.0, 1.0, 1.0],  # LYS
    [1.0, 1.0, 1.0, 0.0],  # MET
    [1.0, 1.0, 0.0, 0.0],  # PHE
    [1.0, 1.0, 0.0, 0.0],  # PRO
    [1.0, 0.0, 0.0, 0.0],  # SER
    [1.0, 0.0, 0.0, 0.0],  # THR
    [1.0, 1.0, 0.0, 0.0],  # TRP
    [1.0, 1.0, 0.0, 0.0],  # TYR
    [1.0, 0.0, 0.0, 0.0],  # VAL
]

# chi angles that are pi-periodic (rotating by pi leaves the structure unchanged); 21 rows.
chi_pi_periodic: list[list[float]] = [
    [0.0, 0.0, 0.0, 0.0],  # ALA
    [0.0, 0.0, 0.0, 0.0],  # ARG
    [0.0, 0.0, 0.0, 0.0],  # ASN
    [0.0, 1.0, 0.0, 0.0],  # ASP
    [0.0, 0.0, 0.0, 0.0],  # CYS
    [0.0, 0.0, 0.0, 0.0],  # GLN
    [0.0, 0.0, 1.0, 0.0],  # GLU
    [0.0, 0.0, 0.0, 0.0],  # GLY
    [0.0, 0.0, 0.0, 0.0],  # HIS
    [0.0, 0.0, 0.0, 0.0],  # ILE
    [0.0, 0.0, 0.0, 0.0],  # LEU
    [0.0, 0.0, 0.0, 0.0],  # LYS
    [0.0, 0.0, 0.0, 0.0],  # MET
    [0.0, 1.0, 0.0, 0.0],  # PHE
    [0.0, 0.0, 0.0, 0.0],  # PRO
    [0.0, 0.0, 0.0, 0.0],  # SER
    [0.0, 0.0, 0.0, 0.0],  # THR
    [0.0, 0.0, 0.0, 0.0],  # TRP
    [0.0, 1.0, 0.0, 0.0],  # TYR
    [0.0, 0.0, 0.0, 0.0],  # VAL
    [0.0, 0.0, 0.0, 0.0],  # UNK
]

# Atom positions relative to the 8 rigid groups (Supplementary Table 2), as
# [atom_name, group_idx, position]. Groups: 0 backbone, 1 pre-omega (empty), 2 phi (only
# hydrogens: empty), 3 psi, 4..7 chi1..chi4. Positions are relative to the axis-end atom of the
# group's rotation axis; x points along the axis and the dihedral-defining atom (last entry of
# ``chi_angles_atoms``) lies in the xy-plane with positive y.
rigid_group_atom_positions: dict[str, list[list]] = {
    "ALA": [
        ["N", 0, (-0.525, 1.363, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.526, -0.000, -0.000)],
        ["CB", 0, (-0.529, -0.774, -1.205)],
        ["O", 3, (0.627, 1.062, 0.000)],
    ],
    "ARG": [
        ["N", 0, (-0.524, 1.362, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.525, -0.000, -0.000)],
        ["CB", 0, (-0.524, -0.778, -1.209)],
        ["O", 3, (0.626, 1.062, 0.000)],
        ["CG", 4, (0.616, 1.390, -0.000)],
        ["CD", 5, (0.564, 1.414, 0.000)],
        ["NE", 6, (0.539, 1.357, -0.000)],
        ["NH1", 7, (0.206, 2.301, 0.000)],
        ["NH2", 7, (2.078, 0.978, -0.000)],
        ["CZ", 7, (0.758, 1.093, -0.000)],
    ],
    "ASN": [
        ["N", 0, (-0.536, 1.357, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.526, -0.000, -0.000)],
        ["CB", 0, (-0.531, -0.787, -1.200)],
        ["O", 3, (0.625, 1.062, 0.000)],
        ["CG", 4, (0.584, 1.399, 0.000)],
        ["ND2", 5, (0.593, -1.188, 0.001)],
        ["OD1", 5, (0.633, 1.059, 0.000)],
    ],
    "ASP": [
        ["N", 0, (-0.525, 1.362, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.527, 0.000, -0.000)],
        ["CB", 0, (-0.526, -0.778, -1.208)],
        ["O", 3, (0.626, 1.062, -0.000)],
        ["CG", 4, (0.593, 1.398, -0.000)],
        ["OD1", 5, (0.610, 1.091, 0.000)],
        ["OD2", 5, (0.592, -1.101, -0.003)],
    ],
    "CYS": [
        ["N", 0, (-0.522, 1.362, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.524, 0.000, 0.000)],
        ["CB", 0, (-0.519, -0.773, -1.212)],
        ["O", 3, (0.625, 1.062, -0.000)],
        ["SG", 4, (0.728, 1.653, 0.000)],
    ],
    "GLN": [
        ["N", 0, (-0.526, 1.361, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.526, 0.000, 0.000)],
        ["CB", 0, (-0.525, -0.779, -1.207)],
        ["O", 3, (0.626, 1.062, -0.000)],
        ["CG", 4, (0.615, 1.393, 0.000)],
        ["CD", 5, (0.587, 1.399, -0.000)],
        ["NE2", 6, (0.593, -1.189, -0.001)],
        ["OE1", 6, (0.634, 1.060, 0.000)],
    ],
    "GLU": [
        ["N", 0, (-0.528, 1.361, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.526, -0.000, -0.000)],
        ["CB", 0, (-0.526, -0.781, -1.207)],
        ["O", 3, (0.626, 1.062, 0.000)],
        ["CG", 4, (0.615, 1.392, 0.000)],
        ["CD", 5, (0.600, 1.397, 0.000)],
        ["OE1", 6, (0.607, 1.095, -0.000)],
        ["OE2", 6, (0.589, -1.104, -0.001)],
    ],
    "GLY": [
        ["N", 0, (-0.572, 1.337, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.517, -0.000, -0.000)],
        ["O", 3, (0.626, 1.062, -0.000)],
    ],
    "HIS": [
        ["N", 0, (-0.527, 1.360, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.525, 0.000, 0.000)],
        ["CB", 0, (-0.525, -0.778, -1.208)],
        ["O", 3, (0.625, 1.063, 0.000)],
        ["CG", 4, (0.600, 1.370, -0.000)],
        ["CD2", 5, (0.889, -1.021, 0.003)],
        ["ND1", 5, (0.744, 1.160, -0.000)],
        ["CE1", 5, (2.030, 0.851, 0.002)],
        ["NE2", 5, (2.145, -0.466, 0.004)],
    ],
    "ILE": [
        ["N", 0, (-0.493, 1.373, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.527, -0.000, -0.000)],
        ["CB", 0, (-0.536, -0.793, -1.213)],
        ["O", 3, (0.627, 1.062, -0.000)],
        ["CG1", 4, (0.534, 1.437, -0.000)],
        ["CG2", 4, (0.540, -0.785, -1.199)],
        ["CD1", 5, (0.619, 1.391, 0.000)],
    ],
    "LEU": [
        ["N", 0, (-0.520, 1.363, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.525, -0.000, -0.000)],
        ["CB", 0, (-0.522, -0.773, -1.214)],
        ["O", 3, (0.625, 1.063, -0.000)],
        ["CG", 4, (0.678, 1.371, 0.000)],
        ["CD1", 5, (0.530, 1.430, -0.000)],
        ["CD2", 5, (0.535, -0.774, 1.200)],
    ],
    "LYS": [
        ["N", 0, (-0.526, 1.362, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.526, 0.000, 0.000)],
        ["CB", 0, (-0.524, -0.778, -1.208)],
        ["O", 3, (0.626, 1.062, -0.000)],
        ["CG", 4, (0.619, 1.390, 0.000)],
        ["CD", 5, (0.559, 1.417, 0.000)],
        ["CE", 6, (0.560, 1.416, 0.000)],
        ["NZ", 7, (0.554, 1.387, 0.000)],
    ],
    "MET": [
        ["N", 0, (-0.521, 1.364, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.525, 0.000, 0.000)],
        ["CB", 0, (-0.523, -0.776, -1.210)],
        ["O", 3, (0.625, 1.062, -0.000)],
        ["CG", 4, (0.613, 1.391, -0.000)],
        ["SD", 5, (0.703, 1.695, 0.000)],
        ["CE", 6, (0.320, 1.786, -0.000)],
    ],
    "PHE": [
        ["N", 0, (-0.518, 1.363, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.524, 0.000, -0.000)],
        ["CB", 0, (-0.525, -0.776, -1.212)],
        ["O", 3, (0.626, 1.062, -0.000)],
        ["CG", 4, (0.607, 1.377, 0.000)],
        ["CD1", 5, (0.709, 1.195, -0.000)],
        ["CD2", 5, (0.706, -1.196, 0.000)],
        ["CE1", 5, (2.102, 1.198, -0.000)],
        ["CE2", 5, (2.098, -1.201, -0.000)],
        ["CZ", 5, (2.794, -0.003, -0.001)],
    ],
    "PRO": [
        ["N", 0, (-0.566, 1.351, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.527, -0.000, 0.000)],
        ["CB", 0, (-0.546, -0.611, -1.293)],
        ["O", 3, (0.621, 1.066, 0.000)],
        ["CG", 4, (0.382, 1.445, 0.0)],
        # Literature value (0.427, 1.440, 0.0); AlphaFold made the angle 2 degrees larger.
        ["CD", 5, (0.477, 1.424, 0.0)],
    ],
    "SER": [
        ["N", 0, (-0.529, 1.360, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.525, -0.000, -0.000)],
        ["CB", 0, (-0.518, -0.777, -1.211)],
        ["O", 3, (0.626, 1.062, -0.000)],
        ["OG", 4, (0.503, 1.325, 0.000)],
    ],
    "THR": [
        ["N", 0, (-0.517, 1.364, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.526, 0.000, -0.000)],
        ["CB", 0, (-0.516, -0.793, -1.215)],
        ["O", 3, (0.626, 1.062, 0.000)],
        ["CG2", 4, (0.550, -0.718, -1.228)],
        ["OG1", 4, (0.472, 1.353, 0.000)],
    ],
    "TRP": [
        ["N", 0, (-0.521, 1.363, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.525, -0.000, 0.000)],
        ["CB", 0, (-0.523, -0.776, -1.212)],
        ["O", 3, (0.627, 1.062, 0.000)],
        ["CG", 4, (0.609, 1.370, -0.000)],
        ["CD1", 5, (0.824, 1.091, 0.000)],
        ["CD2", 5, (0.854, -1.148, -0.005)],
        ["CE2", 5, (2.186, -0.678, -0.007)],
        ["CE3", 5, (0.622, -2.530, -0.007)],
        ["NE1", 5, (2.140, 0.690, -0.004)],
        ["CH2", 5, (3.028, -2.890, -0.013)],
        ["CZ2", 5, (3.283, -1.543, -0.011)],
        ["CZ3", 5, (1.715, -3.389, -0.011)],
    ],
    "TYR": [
        ["N", 0, (-0.522, 1.362, 0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.524, -0.000, -0.000)],
        ["CB", 0, (-0.522, -0.776, -1.213)],
        ["O", 3, (0.627, 1.062, -0.000)],
        ["CG", 4, (0.607, 1.382, -0.000)],
        ["CD1", 5, (0.716, 1.195, -0.000)],
        ["CD2", 5, (0.713, -1.194, -0.001)],
        ["CE1", 5, (2.107, 1.200, -0.002)],
        ["CE2", 5, (2.104, -1.201, -0.003)],
        ["OH", 5, (4.168, -0.002, -0.005)],
        ["CZ", 5, (2.791, -0.001, -0.003)],
    ],
    "VAL": [
        ["N", 0, (-0.494, 1.373, -0.000)],
        ["CA", 0, (0.000, 0.000, 0.000)],
        ["C", 0, (1.527, -0.000, -0.000)],
        ["CB", 0, (-0.533, -0.795, -1.213)],
        ["O", 3, (0.627, 1.062, -0.000)],
        ["CG1", 4, (0.540, 1.429, -0.000)],
        ["CG2", 4, (0.533, -0.776, 1.203)],
    ],
}


def chi_angle_atom(atom_index: int) -> np.ndarray:
    """``[21, 37, 4]`` one-hot of the ``atom_index``-th atom (0..3) defining each chi angle."""
    one_hots = []
    for letter in restypes:
        chis = chi_angles_atoms[restype_1to3[letter]]
        indices = [atom_types.index(chi[atom_index]) for chi in chis] + [-1] * (4 - len(chis))
        # [4, 37]; as in the reference, padded slots (-1) pick the last atom type (OXT).
        one_hots.append(np.eye(atom_type_num)[indices])
    one_hots.append(np.zeros((4, atom_type_num)))  # unknown residue X
    return np.transpose(np.stack(one_hots, axis=0), [0, 2, 1])


chi_atom_1_one_hot: np.ndarray = chi_angle_atom(1)
chi_atom_2_one_hot: np.ndarray = chi_angle_atom(2)

# ``chi_angles_atoms`` as atom37 indices, ``[20, 4, 4]`` (missing chis padded with zeros).
chi_angles_atom_indices: np.ndarray = np.array(
    [
        [[atom_order[name] for name in chi] for chi in chi_angles_atoms[restype_1to3[letter]]]
        + [[0, 0, 0, 0]] * (4 - len(chi_angles_atoms[restype_1to3[letter]]))
        for letter in restypes
    ]
)

# (resname, atom_name) -> [(chi_group_index, index_of_atom_within_that_chi), ...]
chi_groups_for_atom: dict[tuple[str, str], list[tuple[int, int]]] = collections.defaultdict(list)
for _resname, _chis in chi_angles_atoms.items():
    for _chi_idx, _chi_atoms in enumerate(_chis):
        for _atom_idx, _atom in enumerate(_chi_atoms):
            chi_groups_for_atom[(_resname, _atom)].append((_chi_idx, _atom_idx))
chi_groups_for_atom = dict(chi_groups_for_atom)


def _make_rigid_transformation_4x4(ex: np.ndarray, ey: np.ndarray, translation: np.ndarray) -> np.ndarray:
    """4x4 transform whose x-axis is ``ex``, y-axis ``ey`` made orthogonal to it (Gram-Schmidt)."""
    ex_normalized = ex / np.linalg.norm(ex)
    ey_normalized = ey - np.dot(ey, ex_normalized) * ex_normalized
    ey_normalized /= np.linalg.norm(ey_normalized)
    ez_normalized = np.cross(ex_normalized, ey_normalized)
    m = np.stack([ex_normalized, ey_normalized, ez_normalized, translation]).transpose()
    return np.concatenate([m, [[0.0, 0.0, 0.0, 1.0]]], axis=0)


def _make_rigid_group_constants() -> dict[str, np.ndarray]:
    """Per-residue-type atom -> rigid group tables and the default frames (Alg. 24 constants).

    The frames map each group to its parent: psi, phi and chi1 to the backbone, chi(k+1) to
    chi(k). All axes of the chi2..chi4 rotations start at the origin of the previous frame.
    """
    n = restype_num + 1
    tables = {
        "restype_atom37_to_rigid_group": np.zeros((n, 37), dtype=np.int64),
        "restype_atom37_mask": np.zeros((n, 37), dtype=np.float32),
        "restype_atom37_rigid_group_positions": np.zeros((n, 37, 3), dtype=np.float32),
        "restype_atom14_to_rigid_group": np.zeros((n, 14), dtype=np.int64),
        "restype_atom14_mask": np.zeros((n, 14), dtype=np.float32),
        "restype_atom14_rigid_group_positions": np.zeros((n, 14, 3), dtype=np.float32),
        "restype_rigid_group_default_frame": np.zeros((n, 8, 4, 4), dtype=np.float32),
    }
    for restype, letter in enumerate(restypes):
        resname = restype_1to3[letter]
        for atom_name, group_idx, position in rigid_group_atom_positions[resname]:
            a37 = atom_order[atom_name]
            tables["restype_atom37_to_rigid_group"][restype, a37] = group_idx
            tables["restype_atom37_mask"][restype, a37] = 1
            tables["restype_atom37_rigid_group_positions"][restype, a37, :] = position
            a14 = restype_name_to_atom14_names[resname].index(atom_name)
            tables["restype_atom14_to_rigid_group"][restype, a14] = group_idx
            tables["restype_atom14_mask"][restype, a14] = 1
            tables["restype_atom14_rigid_group_positions"][restype, a14, :] = position

    frames = tables["restype_rigid_group_default_frame"]
    for restype, letter in enumerate(restypes):
        resname = restype_1to3[letter]
        pos = {name: np.array(p) for name, _, p in rigid_group_atom_positions[resname]}
        frames[restype, 0] = np.eye(4)  # backbone -> backbone
        frames[restype, 1] = np.eye(4)  # pre-omega -> backbone (dummy identity)
        frames[restype, 2] = _make_rigid_transformation_4x4(  # phi -> backbone
            ex=pos["N"] - pos["CA"], ey=np.array([1.0, 0.0, 0.0]), translation=pos["N"]
        )
        frames[restype, 3] = _make_rigid_transformation_4x4(  # psi -> backbone
            ex=pos["C"] - pos["CA"], ey=pos["CA"] - pos["N"], translation=pos["C"]
        )
        if chi_angles_mask[restype][0]:  # chi1 -> backbone
            base = [pos[name] for name in chi_angles_atoms[resname][0]]
            frames[restype, 4] = _make_rigid_transformation_4x4(
                ex=base[2] - base[1], ey=base[0] - base[1], translation=base[2]
            )
        for chi_idx in range(1, 4):  # chi(k+1) -> chi(k)
            if chi_angles_mask[restype][chi_idx]:
                axis_end = pos[chi_angles_atoms[resname][chi_idx][2]]
                frames[restype, 4 + chi_idx] = _make_rigid_transformation_4x4(
                    ex=axis_end, ey=np.array([-1.0, 0.0, 0.0]), translation=axis_end
                )
    return tables


_rigid_group_tables = _make_rigid_group_constants()
restype_atom37_to_rigid_group: np.ndarray = _rigid_group_tables["restype_atom37_to_rigid_group"]  # [21, 37]
restype_atom37_mask: np.ndarray = _rigid_group_tables["restype_atom37_mask"]  # [21, 37]
restype_atom37_rigid_group_positions: np.ndarray = _rigid_group_tables[
    "restype_atom37_rigid_group_positions"
]  # [21, 37, 3]
restype_atom14_to_rigid_group: np.ndarray = _rigid_group_tables["restype_atom14_to_rigid_group"]  # [21, 14]
restype_atom14_mask: np.ndarray = _rigid_group_tables["restype_atom14_mask"]  # [21, 14]
restype_atom14_rigid_group_positions: np.ndarray = _rigid_group_tables[
    "restype_atom14_rigid_group_positions"
]  # [21, 14, 3]
restype_rigid_group_default_frame: np.ndarray = _rigid_group_tables[
    "restype_rigid_group_default_frame"
]  # [21, 8, 4, 4]

# ---------------------------------------------------------------------------------------------
# 4. Stereochemistry (violation loss, Supplementary 1.9.11)
# ---------------------------------------------------------------------------------------------

# Van der Waals radii [Angstrom] of the heavy elements (from Wikipedia).
van_der_waals_radius: dict[str, float] = {"C": 1.7, "N": 1.55, "O": 1.52, "S": 1.8}

# Between-residue peptide bond C(i)-N(i+1): [general, proline].
between_res_bond_length_c_n: list[float] = [1.329, 1.341]
between_res_bond_length_stddev_c_n: list[float] = [0.014, 0.016]
# Between-residue angles as [mean cos, stddev of cos].
between_res_cos_angles_c_n_ca: list[float] = [-0.5203, 0.0353]  # 121.352 +- 2.315 degrees
between_res_cos_angles_ca_c_n: list[float] = [-0.4473, 0.0311]  # 116.568 +- 1.995 degrees

Bond = collections.namedtuple("Bond", ["atom1_name", "atom2_name", "length", "stddev"])
BondAngle = collections.namedtuple("BondAngle", ["atom1_name", "atom2_name", "atom3name", "angle_rad", "stddev"])

# Literature bond lengths [Angstrom] and angles [degrees] (Engh & Huber), the
# ``stereo_chemical_props.txt`` of OpenStructure used by AlphaFold; sections end with "-".
STEREO_CHEMICAL_PROPS = """\
Bond Residue Mean StdDev
CA-CB ALA 1.520 0.021
N-CA ALA 1.459 0.020
CA-C ALA 1.525 0.026
C-O ALA 1.229 0.019
CA-CB ARG 1.535 0.022
CB-CG ARG 1.521 0.027
CG-CD ARG 1.515 0.025
CD-NE ARG 1.460 0.017
NE-CZ ARG 1.326 0.013
CZ-NH1 ARG 1.326 0.013
CZ-NH2 ARG 1.326 0.013
N-CA ARG 1.459 0.020
CA-C ARG 1.525 0.026
C-O ARG 1.229 0.019
CA-CB ASN 1.527 0.026
CB-CG ASN 1.506 0.023
CG-OD1 ASN 1.235 0.022
CG-ND2 ASN 1.324 0.025
N-CA ASN 1.459 0.020
CA-C ASN 1.525 0.026
C-O ASN 1.229 0.019
CA-CB ASP 1.535 0.022
CB-CG ASP 1.513 0.021
CG-OD1 ASP 1.249 0.023
CG-OD2 ASP 1.249 0.023
N-CA ASP 1.459 0.020
CA-C ASP 1.525 0.026
C-O ASP 1.229 0.019
CA-CB CYS 1.526 0.013
CB-SG CYS 1.812 0.016
N-CA CYS 1.459 0.020
CA-C CYS 1.525 0.026
C-O CYS 1.229 0.019
CA-CB GLU 1.535 0.022
CB-CG GLU 1.517 0.019
CG-CD GLU 1.515 0.015
CD-OE1 GLU 1.252 0.011
CD-OE2 GLU 1.252 0.011
N-CA GLU 1.459 0.020
CA-C GLU 1.525 0.026
C-O GLU 1.229 0.019
CA-CB GLN 1.535 0.022
CB-CG GLN 1.521 0.027
CG-CD GLN 1.506 0.023
CD-OE1 GLN 1.235 0.022
CD-NE2 GLN 1.324 0.025
N-CA GLN 1.459 0.020
CA-C GLN 1.525 0.026
C-O GLN 1.229 0.019
N-CA GLY 1.456 0.015
CA-C GLY 1.514 0.016
C-O GLY 1.232 0.016
CA-CB HIS 1.535 0.022
CB-CG HIS 1.492 0.016
CG-ND1 HIS 1.369 0.015
CG-CD2 HIS 1.353 0.017
ND1-CE1 HIS 1.343 0.025
CD2-NE2 HIS 1.415 0.021
CE1-NE2 HIS 1.322 0.023
N-CA HIS 1.459 0.020
CA-C HIS 1.525 0.026
C-O HIS 1.229 0.019
CA-CB ILE 1.544 0.023
CB-CG1 ILE 1.536 0.028
CB-CG2 ILE 1.524 0.031
CG1-CD1 ILE 1.500 0.069
N-CA ILE 1.459 0.020
CA-C ILE 1.525 0.026
C-O ILE 1.229 0.019
CA-CB LEU 1.533 0.023
CB-CG LEU 1.521 0.029
CG-CD1 LEU 1.514 0.037
CG-CD2 LEU 1.514 0.037
N-CA LEU 1.459 0.020
CA-C LEU 1.525 0.026
C-O LEU 1.229 0.019
CA-CB LYS 1.535 0.022
CB-CG LYS 1.521 0.027
CG-CD LYS 1.520 0.034
CD-CE LYS 1.508 0.025
CE-NZ LYS 1.486 0.025
N-CA LYS 1.459 0.020
CA-C LYS 1.525 0.026
C-O LYS 1.229 0.019
CA-CB MET 1.535 0.022
CB-CG MET 1.509 0.032
CG-SD MET 1.807 0.026
SD-CE MET 1.774 0.056
N-CA MET 1.459 0.020
CA-C MET 1.525 0.026
C-O MET 1.229 0.019
CA-CB PHE 1.535 0.022
CB-CG PHE 1.509 0.017
CG-CD1 PHE 1.383 0.015
CG-CD2 PHE 1.383 0.015
CD1-CE1 PHE 1.388 0.020
CD2-CE2 PHE 1.388 0.020
CE1-CZ PHE 1.369 0.019
CE2-CZ PHE 1.369 0.019
N-CA PHE 1.459 0.020
CA-C PHE 1.525 0.026
C-O PHE 1.229 0.019
CA-CB PRO 1.531 0.020
CB-CG PRO 1.495 0.050
CG-CD PRO 1.502 0.033
CD-N PRO 1.474 0.014
N-CA PRO 1.468 0.017
CA-C PRO 1.524 0.020
C-O PRO 1.228 0.020
CA-CB SER 1.525 0.015
CB-OG SER 1.418 0.013
N-CA SER 1.459 0.020
CA-C SER 1.525 0.026
C-O SER 1.229 0.019
CA-CB THR 1.529 0.026
CB-OG1 THR 1.428 0.020
CB-CG2 THR 1.519 0.033
N-CA THR 1.459 0.020
CA-C THR 1.525 0.026
C-O THR 1.229 0.019
CA-CB TRP 1.535 0.022
CB-CG TRP 1.498 0.018
CG-CD1 TRP 1.363 0.014
CG-CD2 TRP 1.432 0.017
CD1-NE1 TRP 1.375 0.017
NE1-CE2 TRP 1.371 0.013
CD2-CE2 TRP 1.409 0.012
CD2-CE3 TRP 1.399 0.015
CE2-CZ2 TRP 1.393 0.017
CE3-CZ3 TRP 1.380 0.017
CZ2-CH2 TRP 1.369 0.019
CZ3-CH2 TRP 1.396 0.016
N-CA TRP 1.459 0.020
CA-C TRP 1.525 0.026
C-O TRP 1.229 0.019
CA-CB TYR 1.535 0.022
CB-CG TYR 1.512 0.015
CG-CD1 TYR 1.387 0.013
CG-CD2 TYR 1.387 0.013
CD1-CE1 TYR 1.389 0.015
CD2-CE2 TYR 1.389 0.015
CE1-CZ TYR 1.381 0.013
CE2-CZ TYR 1.381 0.013
CZ-OH TYR 1.374 0.017
N-CA TYR 1.459 0.020
CA-C TYR 1.525 0.026
C-O TYR 1.229 0.019
CA-CB VAL 1.543 0.021
CB-CG1 VAL 1.524 0.021
CB-CG2 VAL 1.524 0.021
N-CA VAL 1.459 0.020
CA-C VAL 1.525 0.026
C-O VAL 1.229 0.019
-

Angle Residue Mean StdDev
N-CA-CB ALA 110.1 1.4
CB-CA-C ALA 110.1 1.5
N-CA-C ALA 111.0 2.7
CA-C-O ALA 120.1 2.1
N-CA-CB ARG 110.6 1.8
CB-CA-C ARG 110.4 2.0
CA-CB-CG ARG 113.4 2.2
CB-CG-CD ARG 111.6 2.6
CG-CD-NE ARG 111.8 2.1
CD-NE-CZ ARG 123.6 1.4
NE-CZ-NH1 ARG 120.3 0.5
NE-CZ-NH2 ARG 120.3 0.5
NH1-CZ-NH2 ARG 119.4 1.1
N-CA-C ARG 111.0 2.7
CA-C-O ARG 120.1 2.1
N-CA-CB ASN 110.6 1.8
CB-CA-C ASN 110.4 2.0
CA-CB-CG ASN 113.4 2.2
CB-CG-ND2 ASN 116.7 2.4
CB-CG-OD1 ASN 121.6 2.0
ND2-CG-OD1 ASN 121.9 2.3
N-CA-C ASN 111.0 2.7
CA-C-O ASN 120.1 2.1
N-CA-CB ASP 110.6 1.8
CB-CA-C ASP 110.4 2.0
CA-CB-CG ASP 113.4 2.2
CB-CG-OD1 ASP 118.3 0.9
CB-CG-OD2 ASP 118.3 0.9
OD1-CG-OD2 ASP 123.3 1.9
N-CA-C ASP 111.0 2.7
CA-C-O ASP 120.1 2.1
N-CA-CB CYS 110.8 1.5
CB-CA-C CYS 111.5 1.2
CA-CB-SG CYS 114.2 1.1
N-CA-C CYS 111.0 2.7
CA-C-O CYS 120.1 2.1
N-CA-CB GLU 110.6 1.8
CB-CA-C GLU 110.4 2.0
CA-CB-CG GLU 113.4 2.2
CB-CG-CD GLU 114.2 2.7
CG-CD-OE1 GLU 118.3 2.0
CG-CD-OE2 GLU 118.3 2.0
OE1-CD-OE2 GLU 123.3 1.2
N-CA-C GLU 111.0 2.7
CA-C-O GLU 120.1 2.1
N-CA-CB GLN 110.6 1.8
CB-CA-C GLN 110.4 2.0
CA-CB-CG GLN 113.4 2.2
CB-CG-CD GLN 111.6 2.6
CG-CD-OE1 GLN 121.6 2.0
CG-CD-NE2 GLN 116.7 2.4
OE1-CD-NE2 GLN 121.9 2.3
N-CA-C GLN 111.0 2.7
CA-C-O GLN 120.1 2.1
N-CA-C GLY 113.1 2.5
CA-C-O GLY 120.6 1.8
N-CA-CB HIS 110.6 1.8
CB-CA-C HIS 110.4 2.0
CA-CB-CG HIS 113.6 1.7
CB-CG-ND1 HIS 123.2 2.5
CB-CG-CD2 HIS 130.8 3.1
CG-ND1-CE1 HIS 108.2 1.4
ND1-CE1-NE2 HIS 109.9 2.2
CE1-NE2-CD2 HIS 106.6 2.5
NE2-CD2-CG HIS 109.2 1.9
CD2-CG-ND1 HIS 106.0 1.4
N-CA-C HIS 111.0 2.7
CA-C-O HIS 120.1 2.1
N-CA-CB ILE 110.8 2.3
CB-CA-C ILE 111.6 2.0
CA-CB-CG1 ILE 111.0 1.9
CB-CG1-CD1 ILE 113.9 2.8
CA-CB-CG2 ILE 110.9 2.0
CG1-CB-CG2 ILE 111.4 2.2
N-CA-C ILE 111.0 2.7
CA-C-O ILE 120.1 2.1
N-CA-CB LEU 110.4 2.0
CB-CA-C LEU 110.2 1.9
CA-CB-CG LEU 115.3 2.3
CB-CG-CD1 LEU 111.0 1.7
CB-CG-CD2 LEU 111.0 1.7
CD1-CG-CD2 LEU 110.5 3.0
N-CA-C LEU 111.0 2.7
CA-C-O LEU 120.1 2.1
N-CA-CB LYS 110.6 1.8
CB-CA-C LYS 110.4 2.0
CA-CB-CG LYS 113.4 2.2
CB-CG-CD LYS 111.6 2.6
CG-CD-CE LYS 111.9 3.0
CD-CE-NZ LYS 111.7 2.3
N-CA-C LYS 111.0 2.7
CA-C-O LYS 120.1 2.1
N-CA-CB MET 110.6 1.8
CB-CA-C MET 110.4 2.0
CA-CB-CG MET 113.3 1.7
CB-CG-SD MET 112.4 3.0
CG-SD-CE MET 100.2 1.6
N-CA-C MET 111.0 2.7
CA-C-O MET 120.1 2.1
N-CA-CB PHE 110.6 1.8
CB-CA-C PHE 110.4 2.0
CA-CB-CG PHE 113.9 2.4
CB-CG-CD1 PHE 120.8 0.7
CB-CG-CD2 PHE 120.8 0.7
CD1-CG-CD2 PHE 118.3 1.3
CG-CD1-CE1 PHE 120.8 1.1
CG-CD2-CE2 PHE 120.8 1.1
CD1-CE1-CZ PHE 120.1 1.2
CD2-CE2-CZ PHE 120.1 1.2
CE1-CZ-CE2 PHE 120.0 1.8
N-CA-C PHE 111.0 2.7
CA-C-O PHE 120.1 2.1
N-CA-CB PRO 103.3 1.2
CB-CA-C PRO 111.7 2.1
CA-CB-CG PRO 104.8 1.9
CB-CG-CD PRO 106.5 3.9
CG-CD-N PRO 103.2 1.5
CA-N-CD PRO 111.7 1.4
N-CA-C PRO 112.1 2.6
CA-C-O PRO 120.2 2.4
N-CA-CB SER 110.5 1.5
CB-CA-C SER 110.1 1.9
CA-CB-OG SER 111.2 2.7
N-CA-C SER 111.0 2.7
CA-C-O SER 120.1 2.1
N-CA-CB THR 110.3 1.9
CB-CA-C THR 111.6 2.7
CA-CB-OG1 THR 109.0 2.1
CA-CB-CG2 THR 112.4 1.4
OG1-CB-CG2 THR 110.0 2.3
N-CA-C THR 111.0 2.7
CA-C-O THR 120.1 2.1
N-CA-CB TRP 110.6 1.8
CB-CA-C TRP 110.4 2.0
CA-CB-CG TRP 113.7 1.9
CB-CG-CD1 TRP 127.0 1.3
CB-CG-CD2 TRP 126.6 1.3
CD1-CG-CD2 TRP 106.3 0.8
CG-CD1-NE1 TRP 110.1 1.0
CD1-NE1-CE2 TRP 109.0 0.9
NE1-CE2-CD2 TRP 107.3 1.0
CE2-CD2-CG TRP 107.3 0.8
CG-CD2-CE3 TRP 133.9 0.9
NE1-CE2-CZ2 TRP 130.4 1.1
CE3-CD2-CE2 TRP 118.7 1.2
CD2-CE2-CZ2 TRP 122.3 1.2
CE2-CZ2-CH2 TRP 117.4 1.0
CZ2-CH2-CZ3 TRP 121.6 1.2
CH2-CZ3-CE3 TRP 121.2 1.1
CZ3-CE3-CD2 TRP 118.8 1.3
N-CA-C TRP 111.0 2.7
CA-C-O TRP 120.1 2.1
N-CA-CB TYR 110.6 1.8
CB-CA-C TYR 110.4 2.0
CA-CB-CG TYR 113.4 1.9
CB-CG-CD1 TYR 121.0 0.6
CB-CG-CD2 TYR 121.0 0.6
CD1-CG-CD2 TYR 117.9 1.1
CG-CD1-CE1 TYR 121.3 0.8
CG-CD2-CE2 TYR 121.3 0.8
CD1-CE1-CZ TYR 119.8 0.9
CD2-CE2-CZ TYR 119.8 0.9
CE1-CZ-CE2 TYR 119.8 1.6
CE1-CZ-OH TYR 120.1 2.7
CE2-CZ-OH TYR 120.1 2.7
N-CA-C TYR 111.0 2.7
CA-C-O TYR 120.1 2.1
N-CA-CB VAL 111.5 2.2
CB-CA-C VAL 111.4 1.9
CA-CB-CG1 VAL 110.9 1.5
CA-CB-CG2 VAL 110.9 1.5
CG1-CB-CG2 VAL 110.9 1.6
N-CA-C VAL 111.0 2.7
CA-C-O VAL 120.1 2.1
-

Non-bonded-distance Minimum-Dist Tolerance
C-C 3.4 1.5
C-N 3.25 1.5
C-S 3.5 1.5
C-O 3.22 1.5
N-N 3.1 1.5
N-S 3.35 1.5
N-O 3.07 1.5
O-S 3.32 1.5
O-O 3.04 1.5
S-S 2.03 1.0
-
"""


@functools.cache
def load_stereo_chemical_props() -> tuple[
    Mapping[str, list[Bond]], Mapping[str, list[Bond]], Mapping[str, list[BondAngle]]
]:
    """Parse :data:`STEREO_CHEMICAL_PROPS` into bonds, "virtual bonds" and bond angles per residue.

    A bond angle a-b-c is turned into a virtual bond a-c whose length follows from the law of
    cosines and whose stddev from first-order propagation of the three uncorrelated errors.

    Returns ``(residue_bonds, residue_virtual_bonds, residue_bond_angles)``, each a dict
    resname -> list (``"UNK"`` maps to an empty list).
    """
    lines = iter(STEREO_CHEMICAL_PROPS.splitlines())

    residue_bonds: dict[str, list[Bond]] = {}
    next(lines)  # header
    for line in lines:
        if line.strip() == "-":
            break
        bond, resname, length, stddev = line.split()
        atom1, atom2 = bond.split("-")
        residue_bonds.setdefault(resname, []).append(Bond(atom1, atom2, float(length), float(stddev)))
    residue_bonds["UNK"] = []

    residue_bond_angles: dict[str, list[BondAngle]] = {}
    next(lines)  # empty line
    next(lines)  # header
    for line in lines:
        if line.strip() == "-":
            break
        angle, resname, angle_degree, stddev_degree = line.split()
        atom1, atom2, atom3 = angle.split("-")
        residue_bond_angles.setdefault(resname, []).append(
            BondAngle(
                atom1,
                atom2,
                atom3,
                float(angle_degree) / 180.0 * np.pi,
                float(stddev_degree) / 180.0 * np.pi,
            )
        )
    residue_bond_angles["UNK"] = []

    def bond_key(atom1_name: str, atom2_name: str) -> str:
        return "-".join(sorted([atom1_name, atom2_name]))

    residue_virtual_bonds: dict[str, list[Bond]] = {}
    for resname, bond_angles in residue_bond_angles.items():
        bond_cache = {bond_key(b.atom1_name, b.atom2_name): b for b in residue_bonds[resname]}
        residue_virtual_bonds[resname] = []
        for ba in bond_angles:
            bond1 = bond_cache[bond_key(ba.atom1_name, ba.atom2_name)]
            bond2 = bond_cache[bond_key(ba.atom2_name, ba.atom3name)]
            # Law of cosines: c^2 = a^2 + b^2 - 2ab cos(gamma).
            gamma = ba.angle_rad
            length = np.sqrt(bond1.length**2 + bond2.length**2 - 2 * bond1.length * bond2.length * np.cos(gamma))
            # Propagation of uncertainty assuming uncorrelated errors.
            dl_outer = 0.5 / length
            dl_dgamma = (2 * bond1.length * bond2.length * np.sin(gamma)) * dl_outer
            dl_db1 = (2 * bond1.length - 2 * bond2.length * np.cos(gamma)) * dl_outer
            dl_db2 = (2 * bond2.length - 2 * bond1.length * np.cos(gamma)) * dl_outer
            stddev = np.sqrt((dl_dgamma * ba.stddev) ** 2 + (dl_db1 * bond1.stddev) ** 2 + (dl_db2 * bond2.stddev) ** 2)
            residue_virtual_bonds[resname].append(Bond(ba.atom1_name, ba.atom3name, length, stddev))

    return residue_bonds, residue_virtual_bonds, residue_bond_angles


def make_atom14_dists_bounds(
    overlap_tolerance: float = 1.5,
    bond_length_tolerance_factor: float = 15.0,
) -> dict[str, np.ndarray]:
    """Lower/upper bounds and stddev of intra-residue atom14 pair distances, ``[21, 14, 14]`` each.

    Non-bonded pairs: lower bound = sum of van der Waals radii - ``overlap_tolerance``, upper
    1e10. Bonds and virtual bonds (angles): mean -+ ``bond_length_tolerance_factor`` * stddev.
    Returns float32 arrays under ``lower_bound``, ``upper_bound``, ``stddev``.
    """
    lower_bound = np.zeros((21, 14, 14), np.float32)
    upper_bound = np.zeros((21, 14, 14), np.float32)
    bond_stddev = np.zeros((21, 14, 14), np.float32)
    residue_bonds, residue_virtual_bonds, _ = load_stereo_chemical_props()
    for restype, letter in enumerate(restypes):
        resname = restype_1to3[letter]
        atom_list = restype_name_to_atom14_names[resname]

        # Clash bounds for every pair of distinct atoms.
        for i1, name1 in enumerate(atom_list):
            if not name1:
                continue
            radius1 = van_der_waals_radius[name1[0]]
            for i2, name2 in enumerate(atom_list):
                if (not name2) or i1 == i2:
                    continue
                radius2 = van_der_waals_radius[name2[0]]
                lower = radius1 + radius2 - overlap_tolerance
                upper = 1e10
                lower_bound[restype, i1, i2] = lower_bound[restype, i2, i1] = lower
                upper_bound[restype, i1, i2] = upper_bound[restype, i2, i1] = upper

        # Bonds and virtual bonds overwrite the clash bounds.
        for b in residue_bonds[resname] + residue_virtual_bonds[resname]:
            i1 = atom_list.index(b.atom1_name)
            i2 = atom_list.index(b.atom2_name)
            lower = b.length - bond_length_tolerance_factor * b.stddev
            upper = b.length + bond_length_tolerance_factor * b.stddev
            lower_bound[restype, i1, i2] = lower_bound[restype, i2, i1] = lower
            upper_bound[restype, i1, i2] = upper_bound[restype, i2, i1] = upper
            bond_stddev[restype, i1, i2] = bond_stddev[restype, i2, i1] = b.stddev
    return {"lower_bound": lower_bound, "upper_bound": upper_bound, "stddev": bond_stddev}
