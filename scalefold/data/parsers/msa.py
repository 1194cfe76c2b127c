"""Multiple sequence alignments: FASTA, a3m and Stockholm parsers, validation and cross-source dedup.

Semantics are AlphaFold's ``data/parsers.py`` (as used by the MLPerf reference):

* a3m: lower-case letters are insertions relative to the query; they are removed from the aligned
  sequence and counted in the deletion matrix (``deletion_matrix[i][j]`` = residues deleted from
  sequence ``i`` just before aligned column ``j``);
* Stockholm: the first sequence is the query; columns where the query has a gap are removed from
  every sequence and counted as deletions;
* :func:`merge_msas` deduplicates identical aligned sequences across sources in the order given
  (AlphaFold's ``make_msa_features``: uniref90, bfd/uniclust, mgnify): the first occurrence wins.
"""

from __future__ import annotations

import dataclasses
import os
import string
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Union

import numpy as np

from scalefold import residue_constants as rc
from scalefold.data.parsers import MsaError

PathLike = Union[str, os.PathLike]

GAP = "-"
# Characters allowed in an aligned (deletion-free) MSA row: the HHblits alphabet incl. the gap.
ALIGNED_ALPHABET = frozenset(rc.HHBLITS_AA_TO_ID)
_DELETE_LOWERCASE = str.maketrans("", "", string.ascii_lowercase)


@dataclasses.dataclass
class Msa:
    """An MSA whose first row is the query.

    Attributes:
        sequences: aligned rows (upper case + ``-``), all of the query's length.
        deletion_matrix: per row, per aligned column, number of residues deleted before it.
        descriptions: per row, the FASTA/Stockholm name (and description).
    """

    sequences: list[str]
    deletion_matrix: list[list[int]]
    descriptions: list[str]

    def __post_init__(self) -> None:
        if not (len(self.sequences) == len(self.deletion_matrix) == len(self.descriptions)):
            raise ValueError(
                f"Msa fields differ in length: {len(self.sequences)} sequences, "
                f"{len(self.deletion_matrix)} deletion rows, {len(self.descriptions)} descriptions"
            )

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def query(self) -> str:
        return self.sequences[0]

    def truncate(self, max_seqs: int) -> Msa:
        """The first ``max_seqs`` rows (AlphaFold caps uniref90 at 10,000 and mgnify at 501)."""
        return Msa(self.sequences[:max_seqs], self.deletion_matrix[:max_seqs], self.descriptions[:max_seqs])

    def to_arrays(self, deletion_dtype=np.uint8) -> tuple[np.ndarray, np.ndarray]:
        """``(msa, deletions)``: HHblits ids int8 ``[N_seq, N_res]`` and clipped deletion counts.

        Deletion counts saturate at the dtype's maximum (255 for uint8); AlphaFold only ever uses
        them through ``arctan(d / 3)`` and ``d > 0``, both flat far below that.
        """
        return sequences_to_hhblits_ids(self.sequences), deletion_matrix_to_array(self.deletion_matrix, deletion_dtype)


# ----------------------------------------------------------------------------------------------
# parsers


def parse_fasta(text: str) -> tuple[list[str], list[str]]:
    """FASTA → ``(sequences, descriptions)``; ``#`` lines and blank lines are ignored."""
    sequences: list[str] = []
    descriptions: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(">"):
            descriptions.append(line[1:])
            sequences.append("")
        elif not line or line.startswith("#"):
            continue
        elif not sequences:
            raise MsaError("invalid_msa", "sequence data before the first '>' header")
        else:
            sequences[-1] += line
    return sequences, descriptions


def parse_a3m(text: str) -> Msa:
    """a3m → :class:`Msa` (insertions removed and counted)."""
    raw_sequences, descriptions = parse_fasta(text)
    sequences, deletion_matrix = [], []
    for raw in raw_sequences:
        deletions, count = [], 0
        for char in raw:
            if char.islower():
                count += 1
            else:
                deletions.append(count)
                count = 0
        deletion_matrix.append(deletions)
        sequences.append(raw.translate(_DELETE_LOWERCASE))
    return Msa(sequences, deletion_matrix, descriptions)


def _stockholm_rows(text: str, max_sequences: int | None = None) -> dict[str, str]:
    """Name → concatenated aligned sequence, in first-appearance order."""
    rows: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "//")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise MsaError("invalid_msa", f"malformed Stockholm line {line[:60]!r}")
        name, aligned = parts
        if name not in rows:
            if max_sequences is not None and len(rows) >= max_sequences:
                continue
            rows[name] = ""
        rows[name] += aligned
    return rows


def parse_stockholm(text: str) -> Msa:
    """Stockholm → :class:`Msa`: query-gap columns removed from all rows and counted as deletions."""
    rows = _stockholm_rows(text)
    if not rows:
        return Msa([], [], [])
    query = next(iter(rows.values()))
    keep = [i for i, res in enumerate(query) if res != GAP]
    sequences, deletion_matrix = [], []
    for sequence in rows.values():
        if len(sequence) != len(query):
            raise MsaError(
                "msa_query_length_mismatch",
                f"Stockholm row of length {len(sequence)} in an alignment of width {len(query)}",
            )
        sequences.append("".join(sequence[c] for c in keep))
        deletions, count = [], 0
        for seq_res, query_res in zip(sequence, query):
            if seq_res == GAP and query_res == GAP:
                continue
            if query_res == GAP:
                count += 1
            else:
                deletions.append(count)
                count = 0
        deletion_matrix.append(deletions)
    return Msa(sequences, deletion_matrix, list(rows))


def convert_stockholm_to_a3m(text: str, max_sequences: int | None = None) -> str:
    """Stockholm → a3m text: residues in query-gap columns become lower-case insertions, gaps there vanish.

    Descriptions come from ``#=GS <name> DE <text>`` lines, as AlphaFold's converter does.
    """
    rows = _stockholm_rows(text, max_sequences)
    if not rows:
        return ""
    descriptions: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#=GS"):
            columns = line.split(maxsplit=3)
            if len(columns) >= 3 and columns[2] == "DE" and columns[1] in rows:
                descriptions[columns[1]] = columns[3] if len(columns) == 4 else ""
    query_is_residue = [res != GAP for res in next(iter(rows.values()))]
    chunks = []
    for name, sequence in rows.items():
        a3m = "".join(
            res if in_query else res.lower()
            for in_query, res in zip(query_is_residue, sequence)
            if in_query or res != GAP
        )
        chunks.append(f">{name} {descriptions.get(name, '')}\n{a3m}")
    return "\n".join(chunks) + "\n"


def parse_msa_file(path: PathLike, max_sequences: int | None = None) -> Msa:
    """Read and parse an MSA file by extension (``.a3m``, ``.sto``/``.stockholm``, ``.fasta``/``.fa``).

    Errors raised by the parsers get the file name attached.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise MsaError("missing_alignment", "alignment file not found", str(path)) from exc
    except UnicodeDecodeError as exc:
        raise MsaError("invalid_msa", f"not a text file ({exc.reason})", str(path)) from exc
    try:
        if suffix in (".sto", ".stockholm"):
            msa = parse_stockholm(text)
        elif suffix in (".a3m", ".fasta", ".fa", ".faa"):
            msa = parse_a3m(text)
        else:
            raise MsaError("invalid_msa", f"unknown MSA format {suffix!r}")
    except MsaError as exc:
        if exc.path is None:
            raise MsaError(exc.reason, exc.detail, str(path)) from exc
        raise
    return msa.truncate(max_sequences) if max_sequences is not None else msa


# ----------------------------------------------------------------------------------------------
# validation, dedup and arrays


def validate_msa(msa: Msa, query_sequence: str | None = None, path: str | None = None) -> None:
    """Raise :class:`MsaError` for an empty MSA, a row of the wrong width, or invalid characters.

    When ``query_sequence`` is given the alignment must be ``len(query_sequence)`` columns wide.
    (The first row is not required to equal the query: OpenProteinSet a3m files may use an
    alternative query name, and unknown residues may be written differently.)
    """
    if len(msa) == 0 or not msa.sequences[0]:
        raise MsaError("empty_msa", "MSA has no sequences", path)
    width = len(msa.sequences[0]) if query_sequence is None else len(query_sequence)
    for i, (sequence, deletions) in enumerate(zip(msa.sequences, msa.deletion_matrix)):
        if len(sequence) != width:
            raise MsaError(
                "msa_query_length_mismatch",
                f"row {i} ({msa.descriptions[i][:40]!r}) has {len(sequence)} aligned columns, query has {width}",
                path,
            )
        if len(deletions) != width:
            raise MsaError("msa_query_length_mismatch", f"row {i} deletion vector has length {len(deletions)}", path)
        bad = set(sequence) - ALIGNED_ALPHABET
        if bad:
            raise MsaError(
                "msa_invalid_character",
                f"row {i} ({msa.descriptions[i][:40]!r}) has invalid characters {''.join(sorted(bad))!r}",
                path,
            )


def merge_msas(msas: Iterable[Msa]) -> Msa:
    """Concatenate MSAs in order, dropping rows whose aligned sequence was already seen.

    Empty MSAs are skipped; this is the dedup of AlphaFold's ``make_msa_features``.
    """
    seen: set[str] = set()
    sequences, deletion_matrix, descriptions = [], [], []
    for msa in msas:
        for sequence, deletions, description in zip(msa.sequences, msa.deletion_matrix, msa.descriptions):
            if sequence in seen:
                continue
            seen.add(sequence)
            sequences.append(sequence)
            deletion_matrix.append(list(deletions))
            descriptions.append(description)
    return Msa(sequences, deletion_matrix, descriptions)


def sequences_to_hhblits_ids(sequences: Sequence[str]) -> np.ndarray:
    """Aligned rows → int8 ``[N_seq, N_res]`` in the HHblits alphabet (AlphaFold's raw ``msa``)."""
    if not sequences:
        return np.zeros((0, 0), dtype=np.int8)
    width = len(sequences[0])
    if any(len(s) != width for s in sequences):
        raise MsaError("msa_query_length_mismatch", "aligned rows differ in length")
    lookup = np.full(128, -1, dtype=np.int8)
    for char, index in rc.HHBLITS_AA_TO_ID.items():
        lookup[ord(char)] = index
    raw = np.frombuffer("".join(sequences).encode("ascii", errors="replace"), dtype=np.uint8)
    ids = lookup[np.minimum(raw, 127)].reshape(len(sequences), -1)
    if np.any(ids < 0):
        raise MsaError("msa_invalid_character", "characters outside the HHblits alphabet")
    return ids


def deletion_matrix_to_array(deletion_matrix: Sequence[Sequence[int]], dtype=np.uint8) -> np.ndarray:
    """Deletion counts ``[N_seq, N_res]``, saturated at ``dtype``'s maximum."""
    array = np.asarray(deletion_matrix, dtype=np.int64)
    if array.size == 0:
        return array.astype(dtype).reshape(len(deletion_matrix), -1)
    return np.minimum(array, np.iinfo(dtype).max).astype(dtype)


__all__ = [
    "Msa",
    "parse_fasta",
    "parse_a3m",
    "parse_stockholm",
    "convert_stockholm_to_a3m",
    "parse_msa_file",
    "validate_msa",
    "merge_msas",
    "sequences_to_hhblits_ids",
    "deletion_matrix_to_array",
]
