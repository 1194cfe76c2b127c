"""HHsearch / HHblits ``.hhr`` result files → template hits (AlphaFold's ``parse_hhr``).

An ``.hhr`` file starts with a summary table followed by one paragraph per hit, each opening with
``No <index>``. Inside a paragraph: the hit name line (``>NAME description``), a summary line
(``Probab=… Aligned_cols=… Sum_probs=…``), then alignment blocks whose ``Q <name>`` and ``T <name>``
lines carry ``start sequence end (length)``. Secondary-structure and consensus lines are ignored.
"""

from __future__ import annotations

import dataclasses
import re

from scalefold.data.parsers import HhrError

# Width of the "Q <name> " / "T <name> " prefix of an alignment line (fixed by HH-suite).
NAME_FIELD_WIDTH = 17
_SUMMARY = re.compile(
    r"Probab=(.*)[\t ]*E-value=(.*)[\t ]*Score=(.*)[\t ]*Aligned_cols=(.*)[\t ]*Identities=(.*)%"
    r"[\t ]*Similarity=(.*)[\t ]*Sum_probs=(.*)[\t ]*Template_Neff=(.*)"
)
_QUERY_LINE = re.compile(r"[\t ]*([0-9]*) ([A-Z-]*)[\t ]*([0-9]*) \([0-9]*\)")
_HIT_LINE = re.compile(r"[\t ]*([0-9]*) ([A-Z-]*)[\t ]*[0-9]* \([0-9]*\)")
_IGNORED_ROWS = ("ss_dssp", "ss_pred", "Consensus")


@dataclasses.dataclass(frozen=True)
class TemplateHit:
    """One aligned template hit.

    Attributes:
        index: hit number in the file (1-based).
        name: the hit line without ``>`` (``"1HF9_B ATPASE INHIBITOR …"``).
        aligned_cols: number of aligned columns.
        sum_probs: sum of the per-column alignment probabilities.
        query: aligned query segment (``-`` = gap).
        hit_sequence: aligned template segment (``-`` = gap).
        indices_query: per aligned column, 0-based query residue index or -1 at a gap.
        indices_hit: per aligned column, 0-based template residue index or -1 at a gap.
    """

    index: int
    name: str
    aligned_cols: int
    sum_probs: float
    query: str
    hit_sequence: str
    indices_query: list[int]
    indices_hit: list[int]

    @property
    def pdb_id(self) -> str:
        """Lower-case PDB id of the hit (``"1hf9"``)."""
        return self.name.split()[0].split("_")[0].lower()

    @property
    def chain_id(self) -> str:
        """Author chain id of the hit (``"B"``)."""
        return self.name.split()[0].split("_", 1)[1]


def _residue_indices(segment: str, start: int) -> list[int]:
    indices, counter = [], start
    for char in segment:
        if char == "-":
            indices.append(-1)
        else:
            indices.append(counter)
            counter += 1
    return indices


def _match(pattern: re.Pattern, line: str, context: str) -> tuple:
    match = pattern.match(line)
    if match is None:
        raise HhrError("invalid_hhr", f"cannot parse {context} line {line!r}")
    return match.groups()


def _is_sequence_row(line: str, tag: str) -> bool:
    return line.startswith(tag + " ") and not any(line.startswith(f"{tag} {row}") for row in _IGNORED_ROWS)


def _parse_hit(lines: list[str]) -> TemplateHit:
    if len(lines) < 3:
        raise HhrError("invalid_hhr", f"truncated hit paragraph {lines[:1]!r}")
    try:
        index = int(lines[0].split()[-1])
    except ValueError as exc:
        raise HhrError("invalid_hhr", f"bad hit header {lines[0]!r}") from exc
    name = lines[1][1:]
    match = _SUMMARY.match(lines[2])
    if match is None:
        raise HhrError("invalid_hhr", f"hit {index}: no summary line (got {lines[2]!r})")
    values = [float(x) for x in match.groups()]
    aligned_cols, sum_probs = values[3], values[6]

    query, hit_sequence = "", ""
    indices_query: list[int] = []
    indices_hit: list[int] = []
    block_length: int | None = None
    for line in lines[3:]:
        if _is_sequence_row(line, "Q"):
            start, segment, end = _match(_QUERY_LINE, line[NAME_FIELD_WIDTH:], "query")
            start_index = int(start) - 1
            block_length = int(end) - start_index + segment.count("-")
            if block_length != len(segment):
                raise HhrError("invalid_hhr", f"hit {index}: query block length disagrees with its indices")
            query += segment
            indices_query += _residue_indices(segment, start_index)
        elif _is_sequence_row(line, "T"):
            start, segment = _match(_HIT_LINE, line[NAME_FIELD_WIDTH:], "template")
            if block_length != len(segment):
                raise HhrError("invalid_hhr", f"hit {index}: template block length differs from the query block")
            hit_sequence += segment
            indices_hit += _residue_indices(segment, int(start) - 1)

    return TemplateHit(
        index=index,
        name=name,
        aligned_cols=int(aligned_cols),
        sum_probs=sum_probs,
        query=query,
        hit_sequence=hit_sequence,
        indices_query=indices_query,
        indices_hit=indices_hit,
    )


def parse_hhr(text: str, path: str | None = None) -> list[TemplateHit]:
    """All hits of an ``.hhr`` file, in file order (an empty list when there are none)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("No ")]
    starts.append(len(lines))
    try:
        return [_parse_hit(lines[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    except HhrError as exc:
        raise HhrError(exc.reason, exc.detail, path) from exc


__all__ = ["TemplateHit", "parse_hhr"]
