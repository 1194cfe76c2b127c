"""Predicted structures -> PDB and mmCIF files, per-residue pLDDT in the B-factor column.

A :class:`PredictedStructure` is one chain in the atom37 layout (``final_atom_positions`` /
``final_atom_mask`` of the model) with its sequence and per-residue pLDDT. Every atom whose mask is
set is written (as AlphaFold's ``protein.to_pdb`` does: unknown residues, which have no atom37
atoms, appear in the sequence records only), residues are numbered from 1, occupancy is 1 and the
B-factor of every atom is its residue's pLDDT.

* PDB is written by hand in the fixed-column format of the wwPDB format guide v3.3 (``SEQRES``,
  ``ATOM``, ``TER``, ``END``), 80 characters a line.
* mmCIF goes through gemmi (``gemmi.Structure`` -> ``make_mmcif_document``) with an explicit entity
  (``_entity_poly_seq`` holds the full sequence) and ``_chem_comp.type`` set, so that
  :mod:`scalefold.data.parsers.mmcif` reads the chain back as a protein.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Union

import numpy as np

from scalefold import residue_constants as rc

PathLike = Union[str, os.PathLike]

#: File suffixes -> format.
PDB_SUFFIXES = (".pdb", ".ent")
MMCIF_SUFFIXES = (".cif", ".mmcif")
#: Decimal places of coordinates and B-factors in both formats (PDB's fixed columns: 8.3f / 6.2f).
COORD_DECIMALS = 3
BFACTOR_DECIMALS = 2
PDB_LINE_WIDTH = 80
SEQRES_PER_LINE = 13
PDB_COORD_RANGE = (-999.999, 9999.999)  # what fits in the 8.3f columns
PDB_MAX_SERIAL = 99999
PDB_MAX_RESIDUES = 9999
_ENTITY_ID = "1"


@dataclasses.dataclass
class PredictedStructure:
    """One predicted chain.

    Attributes:
        sequence: one-letter sequence (``X`` for unknown residues), length ``N_res``.
        atom_positions: float ``[N_res, 37, 3]`` (Å).
        atom_mask: ``[N_res, 37]``, 1 where the atom is present.
        plddt: float ``[N_res]`` in [0, 100].
        chain_id: one-character chain name.
        name: entry name (mmCIF ``data_`` block / ``_entry.id``).
    """

    sequence: str
    atom_positions: np.ndarray
    atom_mask: np.ndarray
    plddt: np.ndarray
    chain_id: str = "A"
    name: str = "prediction"

    def __post_init__(self) -> None:
        self.atom_positions = np.asarray(self.atom_positions, dtype=np.float64)
        self.atom_mask = np.asarray(self.atom_mask, dtype=np.float64)
        self.plddt = np.asarray(self.plddt, dtype=np.float64)
        n = len(self.sequence)
        if n == 0:
            raise ValueError("a structure needs at least one residue")
        expected = {"atom_positions": (n, rc.atom_type_num, 3), "atom_mask": (n, rc.atom_type_num), "plddt": (n,)}
        for key, shape in expected.items():
            if getattr(self, key).shape != shape:
                raise ValueError(f"{key} has shape {getattr(self, key).shape}, expected {shape} for {n} residues")
        unknown = set(self.sequence) - set(rc.restypes_with_x)
        if unknown:
            raise ValueError(f"sequence has letters outside the 20 amino acids + X: {''.join(sorted(unknown))!r}")
        if len(self.chain_id) != 1 or not self.chain_id.isalnum():
            raise ValueError(f"chain_id must be one letter or digit, got {self.chain_id!r}")
        if not np.all(np.isfinite(self.atom_positions[self.atom_mask > 0])):
            raise ValueError("non-finite coordinates among the present atoms")
        if not np.all(np.isfinite(self.plddt)):
            raise ValueError("non-finite pLDDT values")

    @property
    def residue_names(self) -> list[str]:
        """Three-letter names (``UNK`` for ``X``)."""
        return [rc.restype_1to3.get(a, rc.unk_restype) for a in self.sequence]

    @property
    def mean_plddt(self) -> float:
        return float(np.mean(self.plddt))

    def atoms(self):
        """``(residue index, residue name, atom name, element, xyz, pLDDT)`` of every present atom, in order."""
        names = self.residue_names
        for i, resname in enumerate(names):
            for j, atom_name in enumerate(rc.atom_types):
                if self.atom_mask[i, j] > 0:
                    yield i, resname, atom_name, atom_name[0], self.atom_positions[i, j], float(self.plddt[i])


# ----------------------------------------------------------------------------------------------
# PDB (fixed columns)
# ----------------------------------------------------------------------------------------------


def _pdb_atom_name(name: str) -> str:
    """Columns 13-16: names shorter than four characters start in column 14 (one-letter elements)."""
    return f" {name:<3}" if len(name) < 4 else name


def _pdb_line(text: str) -> str:
    if len(text) > PDB_LINE_WIDTH:
        raise ValueError(f"PDB record longer than {PDB_LINE_WIDTH} columns: {text!r}")
    return f"{text:<{PDB_LINE_WIDTH}}"


def to_pdb(structure: PredictedStructure) -> str:
    """The structure as PDB text (``SEQRES``, ``ATOM``, ``TER``, ``END``)."""
    s = structure
    lines = []
    names = s.residue_names
    if len(names) > PDB_MAX_RESIDUES or int(np.sum(s.atom_mask > 0)) + 1 > PDB_MAX_SERIAL:
        raise ValueError(
            f"{len(names)} residues / {int(np.sum(s.atom_mask > 0))} atoms do not fit the PDB format; write mmCIF"
        )
    for k in range(0, len(names), SEQRES_PER_LINE):
        chunk = " ".join(names[k : k + SEQRES_PER_LINE])
        lines.append(_pdb_line(f"SEQRES {k // SEQRES_PER_LINE + 1:>3} {s.chain_id} {len(names):>4}  {chunk}"))
    serial = 0
    last = None
    for i, resname, atom_name, element, xyz, plddt in s.atoms():
        serial += 1
        rounded = np.round(xyz, COORD_DECIMALS)
        if np.any(rounded < PDB_COORD_RANGE[0]) or np.any(rounded > PDB_COORD_RANGE[1]):
            raise ValueError(f"coordinate {xyz.tolist()} of residue {i + 1} does not fit the PDB format; write mmCIF")
        x, y, z = (float(v) for v in xyz)
        lines.append(
            _pdb_line(
                f"ATOM  {serial:>5} {_pdb_atom_name(atom_name)} {resname:>3} {s.chain_id}{i + 1:>4}    "
                f"{x:8.3f}{y:8.3f}{z:8.3f}{1.0:6.2f}{plddt:6.2f}          {element:>2}  "
            )
        )
        last = (i, resname)
    if last is not None:
        serial += 1
        lines.append(_pdb_line(f"TER   {serial:>5}      {last[1]:>3} {s.chain_id}{last[0] + 1:>4}"))
    lines.append(_pdb_line("END"))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# mmCIF (gemmi)
# ----------------------------------------------------------------------------------------------


def to_gemmi_structure(structure: PredictedStructure):
    """A ``gemmi.Structure`` (one model, one chain, one polymer entity holding the full sequence)."""
    import gemmi

    s = structure
    st = gemmi.Structure()
    st.name = re.sub(r"[^A-Za-z0-9_.-]+", "_", s.name) or "prediction"  # a CIF block name: no blanks or quotes
    model = gemmi.Model("1")
    chain = gemmi.Chain(s.chain_id)
    names = s.residue_names
    residues: dict[int, gemmi.Residue] = {}
    for i, resname, atom_name, element, xyz, plddt in s.atoms():
        residue = residues.get(i)
        if residue is None:
            residue = gemmi.Residue()
            residue.name = resname
            residue.seqid = gemmi.SeqId(i + 1, " ")
            residue.label_seq = i + 1
            residue.subchain = s.chain_id
            residue.entity_id = _ENTITY_ID
            residue.entity_type = gemmi.EntityType.Polymer
            residues[i] = residue
        atom = gemmi.Atom()
        atom.name = atom_name
        atom.element = gemmi.Element(element)
        atom.pos = gemmi.Position(*(round(float(v), COORD_DECIMALS) for v in xyz))
        atom.occ = 1.0
        atom.b_iso = round(plddt, BFACTOR_DECIMALS)
        residue.add_atom(atom)
    for i in sorted(residues):
        chain.add_residue(residues[i])
    model.add_chain(chain)
    st.add_model(model)
    entity = gemmi.Entity(_ENTITY_ID)
    entity.entity_type = gemmi.EntityType.Polymer
    entity.polymer_type = gemmi.PolymerType.PeptideL
    entity.subchains = [s.chain_id]
    entity.full_sequence = names
    st.entities.append(entity)
    return st


def to_mmcif(structure: PredictedStructure) -> str:
    """The structure as mmCIF text (gemmi's writer)."""
    doc = to_gemmi_structure(structure).make_mmcif_document()
    block = doc[0]
    monomers = sorted(set(structure.residue_names))
    block.set_mmcif_category(
        "_chem_comp.",
        {"id": monomers, "type": ["peptide linking" if m == "GLY" else "L-peptide linking" for m in monomers]},
    )
    return doc.as_string()


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def structure_format(path: PathLike) -> str:
    """``"pdb"`` or ``"mmcif"`` from the file suffix; anything else is a ``ValueError``."""
    suffix = Path(path).suffix.lower()
    if suffix in PDB_SUFFIXES:
        return "pdb"
    if suffix in MMCIF_SUFFIXES:
        return "mmcif"
    raise ValueError(f"cannot tell the structure format of {os.fspath(path)!r}: use a .pdb or .cif suffix")


def write_structure(structure: PredictedStructure, path: PathLike) -> Path:
    """Write PDB or mmCIF by suffix (temp file + rename: no half-written file on failure)."""
    path = Path(path)
    text = to_pdb(structure) if structure_format(path) == "pdb" else to_mmcif(structure)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


__all__ = ["PredictedStructure", "to_pdb", "to_mmcif", "to_gemmi_structure", "structure_format", "write_structure"]
