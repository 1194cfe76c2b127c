"""mmCIF → per-chain sequences and atom37 coordinates, through ``gemmi``.

Semantics follow the MLPerf reference (``openfold/data/mmcif.py``, itself AlphaFold's
``mmcif_parsing.py``):

* a chain is a *protein* chain when its entity's ``_entity_poly_seq`` has at least one monomer whose
  ``_chem_comp.type`` contains "peptide"; other polymers (DNA/RNA) and ligands are skipped;
* the sequence is the SEQRES (``_entity_poly_seq``) sequence; residue ``i`` of the arrays is the
  monomer with ``num == min(num) + i``, so unobserved residues have an all-zero mask;
* only the first model is read; modified residues map to their parent amino acid (MSE → M, its SE
  atom goes into the SD column); atoms whose names are not among the 37 atom types are dropped;
* atoms keep their deposited names: arginine NH1/NH2 are *not* renamed (the reference keeps them as
  deposited; ``fix_arginine_naming=True`` opts into AlphaFold-style renaming, NH1 = the nitrogen
  nearer CD, for non-MLPerf use);
* release date = earliest ``_pdbx_audit_revision_history.revision_date``; resolution from
  ``_refine.ls_d_res_high``, else ``_em_3d_reconstruction.resolution``, else
  ``_reflns.d_resolution_high`` (maximum when several), NaN when none (e.g. NMR);
* chains are named by their author chain id (``_atom_site.auth_asym_id``); atoms and residues by
  their *label* names (``label_atom_id``, ``label_comp_id``), as Biopython's parser (the reference's)
  reads them -- gemmi would otherwise take the ``auth_*`` names;
* an entity is protein when a monomer's ``_chem_comp.type`` contains "peptide", case-sensitively as
  in the reference (so ``L-PEPTIDE LINKING`` in upper case does not count).

Deliberate differences from the reference, where it is ill-defined:

* alternative locations: per atom the altloc with the highest occupancy wins (ties: first in the
  file, as Biopython does); for microheterogeneity (two residue types at one position) the residue
  type with the highest occupancy wins and the sequence letter follows it;
* files without ``_entity_poly_seq`` (e.g. coordinate-only files) fall back to the observed
  residues of each amino-acid subchain, in ``label_seq_id`` order;
* the modified-residue → parent table is gemmi's (the reference uses Biopython's SCOP table; they
  agree on the common modifications, rare ones may differ).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Union

import gemmi
import numpy as np

from scalefold import residue_constants as rc
from scalefold.data.parsers import MmcifError

PathLike = Union[str, os.PathLike]

# Resolution items in order of preference (first present category wins, as in the reference).
RESOLUTION_ITEMS = (
    "_refine.ls_d_res_high",
    "_em_3d_reconstruction.resolution",
    "_reflns.d_resolution_high",
)
# Residue whose selenium atom stands in for the sulphur of its parent (SE → SD column).
SELENO_RESIDUES = {"MSE": ("SE", "SD")}


@dataclasses.dataclass(frozen=True)
class MmcifChain:
    """One protein chain of an mmCIF entry, in SEQRES order.

    Attributes:
        author_chain_id: ``auth_asym_id`` (the chain name users and PDB ids refer to).
        mmcif_chain_id: ``label_asym_id`` of the polymer.
        entity_id: ``_entity.id`` of the polymer.
        sequence: one-letter SEQRES sequence, modified residues mapped to parents, unknown → ``X``.
        residue_names: three-letter names of the SEQRES monomers (as in the file, before mapping).
        all_atom_positions: float32 ``[N_res, 37, 3]`` (zeros where unobserved).
        all_atom_mask: float32 ``[N_res, 37]`` (1 = atom observed).
        author_residue_ids: per residue ``"<auth_seq_id><ins_code>"`` or ``None`` when unobserved.
    """

    author_chain_id: str
    mmcif_chain_id: str
    entity_id: str
    sequence: str
    residue_names: tuple[str, ...]
    all_atom_positions: np.ndarray  # [N_res, 37, 3]
    all_atom_mask: np.ndarray  # [N_res, 37]
    author_residue_ids: tuple[str | None, ...]

    @property
    def num_res(self) -> int:
        return len(self.sequence)


@dataclasses.dataclass(frozen=True)
class MmcifEntry:
    """Everything the data pipeline needs from one mmCIF file.

    ``chains`` maps author chain id → :class:`MmcifChain` in file order; ``resolution`` is NaN when the
    entry has none (NMR); ``release_date`` is ``"YYYY-MM-DD"`` or ``None`` when the file has no
    revision history.
    """

    pdb_id: str
    path: str | None
    exptl_method: str
    release_date: str | None
    resolution: float
    chains: dict[str, MmcifChain]
    has_seqres: bool = True

    def chain_id(self, author_chain_id: str) -> str:
        """The dataset-wide chain id ``"{pdb_id}_{author chain id}"``."""
        return f"{self.pdb_id}_{author_chain_id}"


# ----------------------------------------------------------------------------------------------
# public entry points


def parse_mmcif(path: PathLike, pdb_id: str | None = None, *, fix_arginine_naming: bool = False) -> MmcifEntry:
    """Parse an mmCIF file (``.cif`` or ``.cif.gz``).

    ``fix_arginine_naming`` swaps arginine NH1/NH2 so NH1 is nearer CD (off: as deposited, as the
    MLPerf reference reads them).

    Raises:
        MmcifError: the file is missing, corrupt/truncated, or has no protein chain.
    """
    path = str(path)
    try:
        doc = gemmi.cif.read(path)
    except FileNotFoundError as exc:
        raise MmcifError("missing_file", f"mmCIF file not found ({exc})", path) from exc
    except (ValueError, RuntimeError, UnicodeDecodeError) as exc:
        raise MmcifError("corrupt_mmcif", f"corrupt or truncated mmCIF: {exc}", path) from exc
    return _parse_document(doc, path=path, pdb_id=pdb_id, fix_arginine_naming=fix_arginine_naming)


def parse_mmcif_string(
    text: str, pdb_id: str | None = None, path: str | None = None, *, fix_arginine_naming: bool = False
) -> MmcifEntry:
    """Parse mmCIF content held in memory (``path`` only labels errors); options as :func:`parse_mmcif`."""
    try:
        doc = gemmi.cif.read_string(text)
    except (ValueError, RuntimeError) as exc:
        raise MmcifError("corrupt_mmcif", f"corrupt or truncated mmCIF: {exc}", path) from exc
    return _parse_document(doc, path=path, pdb_id=pdb_id, fix_arginine_naming=fix_arginine_naming)


def read_entry_header(path: PathLike) -> tuple[str, str | None, frozenset[str]]:
    """``(pdb_id, release_date, protein author chain ids)`` of an mmCIF file, mostly without building
    its structure.

    Cheap metadata for template prefiltering: release dates, and the protein chains that may serve as
    templates (the reference's ``template_pdb_chain_ids`` holds only the protein chains it parsed).
    Raises :class:`MmcifError` like :func:`parse_mmcif`.
    """
    path = str(path)
    try:
        doc = gemmi.cif.read(path)
    except FileNotFoundError as exc:
        raise MmcifError("missing_file", f"mmCIF file not found ({exc})", path) from exc
    except (ValueError, RuntimeError, UnicodeDecodeError) as exc:
        raise MmcifError("corrupt_mmcif", f"corrupt or truncated mmCIF: {exc}", path) from exc
    if len(doc) == 0:
        raise MmcifError("corrupt_mmcif", "no data block in file", path)
    block = doc[0]
    chains = _protein_author_chains(block)
    if chains is None:  # no SEQRES (rare): the observed amino-acid chains, as the parser finds them
        try:
            chains = frozenset(_parse_document(doc, path=path, pdb_id=None).chains)
        except MmcifError:
            chains = frozenset()
    return _pdb_id(block, path, None), _release_date(block, path), chains


def _protein_entities(block: gemmi.cif.Block) -> dict[str, list[tuple[int, str]]] | None:
    """``entity id -> [(num, mon_id)]`` of the protein polymers (``None``: no ``_entity_poly_seq``)."""
    entity_rows = _table(block, "_entity_poly_seq.", ["entity_id", "num", "mon_id"])
    if not entity_rows:
        return None
    chem_types = dict(_table(block, "_chem_comp.", ["id", "type"]))
    polymers: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for entity_id, num, mon_id in entity_rows:
        polymers[entity_id].append((int(num), mon_id))
    proteins = {}
    for entity_id, monomers in polymers.items():
        if chem_types:  # the reference's test, case-sensitive
            is_protein = any("peptide" in chem_types.get(m, "") for _, m in monomers)
        else:
            is_protein = any(_is_amino_acid(m) for _, m in monomers)
        if is_protein:
            proteins[entity_id] = monomers
    return proteins


def _protein_author_chains(block: gemmi.cif.Block) -> frozenset[str] | None:
    """Author ids of the chains :func:`parse_mmcif` returns as protein chains, without building the
    structure (``None`` for files without ``_entity_poly_seq``)."""
    proteins = _protein_entities(block)
    if proteins is None:
        return None
    subchains = {a for a, e in _table(block, "_struct_asym.", ["id", "entity_id"]) if e in proteins}
    pairs = _table(block, "_atom_site.", ["label_asym_id", "auth_asym_id"])
    return frozenset(auth for label, auth in pairs if label in subchains)


def _use_label_names(block: gemmi.cif.Block) -> None:
    """Make gemmi name atoms and residues by ``label_atom_id`` / ``label_comp_id`` (Biopython's
    choice) by dropping the ``auth_*`` name columns when the label ones exist (in memory only)."""
    for label, auth in (("label_atom_id", "auth_atom_id"), ("label_comp_id", "auth_comp_id")):
        if len(block.find_values(f"_atom_site.{label}")) and len(block.find_values(f"_atom_site.{auth}")):
            block.find_values(f"_atom_site.{auth}").erase()


def check_chain_usable(entry: MmcifEntry, chain: MmcifChain) -> None:
    """Raise :class:`MmcifError` (reason ``no_resolved_ca``) when no residue has a resolved Cα."""
    ca = rc.atom_order["CA"]
    if not np.any(chain.all_atom_mask[:, ca] > 0):
        raise MmcifError(
            "no_resolved_ca",
            f"chain {entry.chain_id(chain.author_chain_id)} has no resolved CA atom",
            entry.path,
        )


# ----------------------------------------------------------------------------------------------
# document-level metadata


def _values(block: gemmi.cif.Block, tag: str) -> list[str]:
    """All values of an item (pair or loop), unquoted; '?' and '.' kept as written."""
    return [gemmi.cif.as_string(v) for v in block.find_values(tag)]


def _table(block: gemmi.cif.Block, prefix: str, tags: list[str]) -> list[list[str]]:
    """Rows of the requested columns of one category (empty when the category is absent)."""
    table = block.find(prefix, tags)
    return [[gemmi.cif.as_string(row[i]) for i in range(len(tags))] for row in table]


def _pdb_id(block: gemmi.cif.Block, path: str | None, override: str | None) -> str:
    if override:
        return override.lower()
    entry_ids = _values(block, "_entry.id")
    if entry_ids and entry_ids[0] not in ("?", "."):
        return entry_ids[0].lower()
    if path:
        return Path(path).name.split(".")[0].lower()
    return block.name.lower()


def _exptl_method(block: gemmi.cif.Block) -> str:
    return ";".join(_values(block, "_exptl.method"))


def _release_date(block: gemmi.cif.Block, path: str | None) -> str | None:
    dates = [d for d in _values(block, "_pdbx_audit_revision_history.revision_date") if d not in ("?", ".")]
    for date in dates:
        try:
            datetime.datetime.strptime(date, "%Y-%m-%d")
        except ValueError as exc:
            raise MmcifError("corrupt_mmcif", f"bad revision date {date!r}", path) from exc
    return min(dates) if dates else None


def _resolution(block: gemmi.cif.Block) -> float:
    for tag in RESOLUTION_ITEMS:
        raw = block.find_values(tag)
        if len(raw) == 0:
            continue
        values = []
        for value in raw:
            try:
                number = float(gemmi.cif.as_string(value))
            except ValueError:
                continue
            if not math.isnan(number):
                values.append(number)
        return max(values) if values else float("nan")
    return float("nan")


# ----------------------------------------------------------------------------------------------
# residues and atoms


def _one_letter(residue_name: str) -> str:
    """Parent amino acid one-letter code (modified residues mapped), ``X`` when unknown."""
    code = rc.restype_3to1.get(residue_name)
    if code is not None:
        return code
    info = gemmi.find_tabulated_residue(residue_name)
    if info is not None and info.is_amino_acid():
        code = info.one_letter_code.upper()
        if code in rc.restype_order:
            return code
    return "X"


def _atom37_of_residue(residue: gemmi.Residue, fix_arginine_naming: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Atom37 positions ``[37, 3]`` and mask ``[37]`` of one residue; highest-occupancy altloc wins."""
    positions = np.zeros((rc.atom_type_num, 3), dtype=np.float32)
    mask = np.zeros((rc.atom_type_num,), dtype=np.float32)
    best_occupancy = np.full((rc.atom_type_num,), -np.inf)
    renamed = SELENO_RESIDUES.get(residue.name)
    for atom in residue:
        name = atom.name
        if renamed is not None and name.upper() == renamed[0]:
            name = renamed[1]
        index = rc.atom_order.get(name)
        if index is None or atom.occ <= best_occupancy[index]:
            continue  # not an atom37 atom, or a lower/equal-occupancy alternative location
        best_occupancy[index] = atom.occ
        positions[index] = (atom.pos.x, atom.pos.y, atom.pos.z)
        mask[index] = 1.0
    if fix_arginine_naming and residue.name == "ARG":
        _fix_arginine_nh_naming(positions, mask)
    return positions, mask


def _fix_arginine_nh_naming(positions: np.ndarray, mask: np.ndarray) -> None:
    """Name the arginine NH atoms so NH1 is the one closer to CD (swap in place); opt-in only.

    Deposited structures are inconsistent about which guanidinium nitrogen is NH1. The MLPerf
    reference keeps the deposited names, and the model must see its data, so this is off unless
    ``fix_arginine_naming=True``.
    """
    cd, nh1, nh2 = (rc.atom_order[n] for n in ("CD", "NH1", "NH2"))
    if not (mask[cd] and mask[nh1] and mask[nh2]):
        return
    if np.linalg.norm(positions[nh1] - positions[cd]) > np.linalg.norm(positions[nh2] - positions[cd]):
        positions[[nh1, nh2]] = positions[[nh2, nh1]]


def _residue_occupancy(residue: gemmi.Residue) -> float:
    return max((atom.occ for atom in residue), default=0.0)


def _author_residue_id(residue: gemmi.Residue) -> str:
    icode = residue.seqid.icode.strip()
    return f"{residue.seqid.num}{icode}"


def _observed_by_subchain(model: gemmi.Model) -> tuple[dict, dict]:
    """First-model residues grouped by subchain and ``label_seq``, plus subchain → author chain.

    Microheterogeneity (several residues at one ``label_seq``) is resolved by occupancy.
    """
    residues: dict[str, dict[int, gemmi.Residue]] = defaultdict(dict)
    order: dict[str, list[gemmi.Residue]] = defaultdict(list)
    author_of: dict[str, str] = {}
    for chain in model:
        for residue in chain:
            subchain = residue.subchain
            author_of.setdefault(subchain, chain.name)
            order[subchain].append(residue)
            if residue.label_seq is None:
                continue
            current = residues[subchain].get(residue.label_seq)
            if current is None or _residue_occupancy(residue) > _residue_occupancy(current):
                residues[subchain][residue.label_seq] = residue
    return {"by_seq": residues, "in_order": order}, author_of


def _chain_from_seqres(
    author_chain_id: str,
    mmcif_chain_id: str,
    entity_id: str,
    monomers: list[tuple[int, str]],
    observed: dict[int, gemmi.Residue],
    fix_arginine_naming: bool = False,
) -> MmcifChain:
    # One entry per position: microheterogeneous SEQRES positions collapse to the observed type.
    by_num: dict[int, str] = {}
    for num, mon_id in monomers:
        by_num.setdefault(num, mon_id)
    nums = sorted(by_num)  # residue i = i-th SEQRES position (= num - min(num) for contiguous numbering)
    num_res = len(nums)
    positions = np.zeros((num_res, rc.atom_type_num, 3), dtype=np.float32)
    mask = np.zeros((num_res, rc.atom_type_num), dtype=np.float32)
    names, auth_ids = [], []
    for i, num in enumerate(nums):
        residue = observed.get(num)
        if residue is None:
            names.append(by_num[num])
            auth_ids.append(None)
            continue
        names.append(residue.name)
        auth_ids.append(_author_residue_id(residue))
        positions[i], mask[i] = _atom37_of_residue(residue, fix_arginine_naming)
    sequence = "".join(_one_letter(name) for name in names)
    return MmcifChain(
        author_chain_id=author_chain_id,
        mmcif_chain_id=mmcif_chain_id,
        entity_id=entity_id,
        sequence=sequence,
        residue_names=tuple(names),
        all_atom_positions=positions,
        all_atom_mask=mask,
        author_residue_ids=tuple(auth_ids),
    )


def _chain_from_observed(
    author_chain_id: str,
    mmcif_chain_id: str,
    entity_id: str,
    residues: list[gemmi.Residue],
    fix_arginine_naming: bool = False,
) -> MmcifChain:
    """Fallback without SEQRES: the observed residues, one per position."""
    chosen: dict[object, gemmi.Residue] = {}
    for residue in residues:
        key = residue.label_seq if residue.label_seq is not None else (residue.seqid.num, residue.seqid.icode)
        current = chosen.get(key)
        if current is None or _residue_occupancy(residue) > _residue_occupancy(current):
            chosen[key] = residue
    picked = list(chosen.values())
    num_res = len(picked)
    positions = np.zeros((num_res, rc.atom_type_num, 3), dtype=np.float32)
    mask = np.zeros((num_res, rc.atom_type_num), dtype=np.float32)
    for i, residue in enumerate(picked):
        positions[i], mask[i] = _atom37_of_residue(residue, fix_arginine_naming)
    names = tuple(r.name for r in picked)
    return MmcifChain(
        author_chain_id=author_chain_id,
        mmcif_chain_id=mmcif_chain_id,
        entity_id=entity_id,
        sequence="".join(_one_letter(n) for n in names),
        residue_names=names,
        all_atom_positions=positions,
        all_atom_mask=mask,
        author_residue_ids=tuple(_author_residue_id(r) for r in picked),
    )


def _is_amino_acid(name: str) -> bool:
    if name in rc.restype_3to1:
        return True
    info = gemmi.find_tabulated_residue(name)
    return info is not None and info.is_amino_acid()


# ----------------------------------------------------------------------------------------------
# the whole document


def _parse_document(
    doc: gemmi.cif.Document, path: str | None, pdb_id: str | None, fix_arginine_naming: bool = False
) -> MmcifEntry:
    if len(doc) == 0:
        raise MmcifError("corrupt_mmcif", "no data block in file", path)
    block = doc[0]
    if len(block.find_values("_atom_site.Cartn_x")) == 0:
        raise MmcifError("corrupt_mmcif", "no _atom_site coordinates (truncated file?)", path)
    _use_label_names(block)
    try:
        structure = gemmi.make_structure_from_block(block)
    except (ValueError, RuntimeError) as exc:
        raise MmcifError("corrupt_mmcif", f"cannot build structure: {exc}", path) from exc
    if len(structure) == 0:
        raise MmcifError("corrupt_mmcif", "no models in _atom_site", path)

    observed, author_of = _observed_by_subchain(structure[0])
    proteins = _protein_entities(block)  # DNA / RNA / other polymers left out
    chains: dict[str, MmcifChain] = {}

    if proteins is not None:
        subchains_of: dict[str, list[str]] = defaultdict(list)
        for asym_id, entity_id in _table(block, "_struct_asym.", ["id", "entity_id"]):
            subchains_of[entity_id].append(asym_id)
        for entity_id, monomers in proteins.items():
            for asym_id in subchains_of.get(entity_id, []):
                author = author_of.get(asym_id)
                if author is None or author in chains:
                    continue  # no atoms in the first model (cannot name it), or duplicate author id
                chains[author] = _chain_from_seqres(
                    author, asym_id, entity_id, monomers, observed["by_seq"].get(asym_id, {}), fix_arginine_naming
                )
    else:
        for asym_id, residues in observed["in_order"].items():
            polymer_residues = [r for r in residues if r.entity_type == gemmi.EntityType.Polymer or r.label_seq]
            if not polymer_residues or not all(_is_amino_acid(r.name) for r in polymer_residues):
                continue
            author = author_of[asym_id]
            if author in chains:
                continue
            chains[author] = _chain_from_observed(
                author, asym_id, polymer_residues[0].entity_id, polymer_residues, fix_arginine_naming
            )

    if not chains:
        raise MmcifError("no_protein_chains", "no protein chain found", path)

    return MmcifEntry(
        pdb_id=_pdb_id(block, path, pdb_id),
        path=path,
        exptl_method=_exptl_method(block),
        release_date=_release_date(block, path),
        resolution=_resolution(block),
        chains=chains,
        has_seqres=proteins is not None,
    )


__all__ = ["MmcifChain", "MmcifEntry", "parse_mmcif", "parse_mmcif_string", "check_chain_usable", "read_entry_header"]
