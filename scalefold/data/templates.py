"""Template featurisation from HHsearch hits (AF2 supplement 1.2.3, "Template search"; 1.2.9).

For every hit of an ``.hhr`` file this module decides whether the hit may be used, maps the hit's
aligned residues onto the query through the HHsearch alignment, reads the template chain's atom37
coordinates from its mmCIF file and writes them at the mapped query positions. The result is
AlphaFold's *raw* template feature dict (``[N_templ, N_res, ...]``):

========================================  ==========  ===============================================
key                                       dtype       meaning
========================================  ==========  ===============================================
``template_aatype``                       int32       one-hot 22 in the HHblits alphabet (21 = gap);
                                                      ``[0, N_res]`` when there is no template
``template_all_atom_positions``           float32     ``[N_templ, N_res, 37, 3]``, zeros off-alignment;
                                                      each template chain zero-centred (see 3.)
``template_all_atom_masks``               float32     ``[N_templ, N_res, 37]``
``template_domain_names``                 str         ``"{pdb_id}_{chain}"`` of each template
``template_sequence``                     str         template residue per query position, ``-`` = gap
``template_sum_probs``                    float32     ``[N_templ, 1]`` HHsearch ``Sum_probs``
========================================  ==========  ===============================================

Semantics follow DeepMind's ``alphafold/data/templates.py`` (``HhsearchHitFeaturizer``), which the
MLPerf reference (``openfold/data/templates.py``) copies:

1. every hit is *prefiltered* (no mmCIF needed), the survivors are sorted by ``sum_probs``
   (descending, stable; in training the MLPerf reference shuffles the top ``k``) and featurised
   in that order until ``max_hits`` templates were produced. The prefilter drops hits released
   after the cutoff, from the query's own PDB entry, with too small an aligned fraction
   (``aligned_cols / N_res <= min_align_ratio``), near-duplicates of the query (hit sequence is a
   substring of the query covering ``> max_subsequence_ratio`` of it), and hits shorter than
   ``min_template_length`` residues;
2. the template chain is located in the mmCIF by chain id and (sub)sequence, then sequence only,
   then a fuzzy match with ``X`` as wildcard; when none matches (PDB70 holds another version of
   the sequence) the hit sequence is *realigned* to the chain's SEQRES sequence and accepted only
   with ``>= min_realign_identity`` identity over the shorter sequence;
3. the template chain's coordinates are *zero-centred* as the MLPerf reference does
   (``zero_center=True`` in its ``_get_atom_positions``): the mean of all resolved atoms of the
   whole chain is subtracted from every resolved atom, in float32, before the aligned residues are
   picked (unresolved atoms stay 0). DeepMind's AlphaFold keeps the deposited frame
   (``zero_center=False`` here). The model is invariant to this translation, but the features are
   not: ``template_pseudo_beta`` and the torsion features at masked positions depend on it;
4. templates whose mapped residues have fewer than ``min_atoms`` resolved atoms, or whose
   consecutive resolved Cα atoms are more than ``max_ca_ca_distance`` apart, are skipped.

Realignment runs ``kalign`` when it is on ``PATH`` (as the reference does). Otherwise a pure-Python
fallback, :class:`OverlapAligner` (affine-gap global alignment with free end gaps), runs; the aligner
that was chosen is logged once when the featurizer is built and named in every realignment warning.
The two may place gaps differently where an alignment is ambiguous; on the near-identical
sequences that pass the identity threshold they agreed in every case tested.

Deliberate differences from the reference (both documented where they happen):

* a missing template mmCIF file skips that hit with a logged reason (the reference crashes); so
  does a template mmCIF released after the cutoff although the prefilter's release date was not
  (the reference fails an assertion);
* after realignment, query positions whose template residue has no counterpart in the mmCIF
  sequence stay gaps. The reference maps them to index ``-1``, i.e. silently to the chain's *last*
  residue.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import random
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar, Union

import numpy as np

from scalefold import residue_constants as rc
from scalefold.data.parsers import ParseError
from scalefold.data.parsers.hhr import TemplateHit
from scalefold.data.parsers.mmcif import MmcifEntry, parse_mmcif
from scalefold.data.parsers.msa import parse_fasta

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

# Output dtype of each raw template feature (the MLPerf reference's; AlphaFold has float32 aatype).
TEMPLATE_FEATURE_DTYPES: dict[str, type] = {
    "template_aatype": np.int32,
    "template_all_atom_positions": np.float32,
    "template_all_atom_masks": np.float32,
    "template_domain_names": np.str_,
    "template_sequence": np.str_,
    "template_sum_probs": np.float32,
}

# HHsearch hit names start with "<4-character PDB id>_<chain id>", chain id "." when unknown.
_HIT_NAME_PATTERN = re.compile(r"[a-zA-Z\d]{4}_[a-zA-Z0-9.]+")


class TemplateError(Exception):
    """One hit cannot be turned into template features; ``reason`` is a short stable key."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{detail} [{reason}]")


@dataclasses.dataclass(frozen=True)
class SkippedHit:
    """A hit that produced no template, and why (``stage`` is ``"prefilter"`` or ``"featurize"``)."""

    name: str
    stage: str
    reason: str
    detail: str


@dataclasses.dataclass(frozen=True)
class AlignedTemplate:
    """One featurised template in compact form: only the query positions the hit covers.

    :meth:`dense` expands it to AlphaFold's per-template raw features; this compact form is what
    the dataset store keeps (``scalefold preprocess``), so training needs no mmCIF files.
    """

    domain_name: str  # "{pdb_id}_{chain}" of the template chain actually used
    sum_probs: float  # HHsearch Sum_probs of the hit
    query_index: np.ndarray  # [K] int32, query residue positions covered by the template
    residues: str  # [K] template residue letter at each covered position
    all_atom_positions: np.ndarray  # [K, 37, 3] float32
    all_atom_mask: np.ndarray  # [K, 37] float32

    def dense(self, num_res: int) -> dict[str, object]:
        """Raw features of this template for a query of ``num_res`` residues (gaps elsewhere)."""
        positions = np.zeros((num_res, rc.atom_type_num, 3), dtype=np.float32)  # [N_res, 37, 3]
        mask = np.zeros((num_res, rc.atom_type_num), dtype=np.float32)  # [N_res, 37]
        letters = np.full(num_res, "-", dtype="<U1")
        index = np.asarray(self.query_index, dtype=np.int64)
        positions[index] = self.all_atom_positions
        mask[index] = self.all_atom_mask
        letters[index] = list(self.residues)
        sequence = "".join(letters.tolist())
        return {
            "template_aatype": rc.sequence_to_onehot(sequence, rc.HHBLITS_AA_TO_ID).astype(np.int32),  # [N_res, 22]
            "template_all_atom_positions": positions,
            "template_all_atom_masks": mask,
            "template_domain_names": self.domain_name,
            "template_sequence": sequence,
            "template_sum_probs": np.array([self.sum_probs], dtype=np.float32),  # [1]
        }


#: Outcome stages of one hit (:class:`HitOutcome`): usable, dropped by the prefilter (never part
#: of the ranking), dropped when featurised (ranked, then skipped), or never assessed.
STAGE_OK, STAGE_PREFILTER, STAGE_FEATURIZE, STAGE_UNPROCESSED = "ok", "prefilter", "featurize", "unprocessed"
HIT_STAGES = (STAGE_UNPROCESSED, STAGE_OK, STAGE_PREFILTER, STAGE_FEATURIZE)


@dataclasses.dataclass(frozen=True)
class HitOutcome:
    """What the featurizer makes of one hit for one query (independent of the shuffling seed)."""

    stage: str  # one of HIT_STAGES
    sum_probs: float = 0.0  # the hit's Sum_probs: its rank among the prefiltered hits
    reason: str = ""  # TemplateError.reason when the hit was dropped
    template: AlignedTemplate | None = None  # set when stage == "ok"


@dataclasses.dataclass
class TemplateSearchResult:
    """Raw template features plus the hits that were skipped and realignment warnings."""

    features: dict[str, np.ndarray]
    skipped: list[SkippedHit]
    warnings: list[str]


# ----------------------------------------------------------------------------------------------
# pairwise aligners used for realignment


class SequenceAligner(Protocol):
    name: str

    def align(self, first: str, second: str) -> tuple[str, str]:
        """Globally align two sequences; returns both with ``-`` gaps, equal length."""


class KalignAligner:
    """Pairwise alignment with the ``kalign`` binary (what the reference uses).

    Kalign needs every sequence to be at least ``min_length`` residues long.
    """

    name = "kalign"

    def __init__(self, binary_path: str, timeout_s: float = 60.0, min_length: int = 6) -> None:
        self.binary_path = binary_path
        self.timeout_s = timeout_s
        self.min_length = min_length

    def align(self, first: str, second: str) -> tuple[str, str]:
        for sequence in (first, second):
            if len(sequence) < self.min_length:
                raise ValueError(f"kalign needs sequences of at least {self.min_length} residues, got {sequence!r}")
        with tempfile.TemporaryDirectory(prefix="scalefold_kalign_") as tmp:
            input_path = Path(tmp) / "input.fasta"
            output_path = Path(tmp) / "output.fasta"
            input_path.write_text(f">sequence 1\n{first}\n>sequence 2\n{second}\n")
            command = [self.binary_path, "-i", str(input_path), "-o", str(output_path), "-format", "fasta"]
            completed = subprocess.run(command, capture_output=True, text=True, timeout=self.timeout_s)
            if completed.returncode != 0:
                raise RuntimeError(f"kalign failed ({completed.returncode}): {completed.stderr.strip()}")
            aligned, _ = parse_fasta(output_path.read_text())
        if len(aligned) != 2 or len(aligned[0]) != len(aligned[1]):
            raise RuntimeError(f"unexpected kalign output: {aligned!r}")
        return aligned[0], aligned[1]


class OverlapAligner:
    """Pure-Python fallback: affine-gap global alignment whose end gaps are free (Gotoh).

    Scores: ``match_score`` for identical letters, ``mismatch_score`` otherwise; a gap of length
    ``k`` inside the alignment costs ``gap_open + (k - 1) * gap_extend``; leading and trailing gaps
    cost nothing, so a hit fragment can sit anywhere inside the full mmCIF chain. Ties prefer
    match/mismatch, then a gap in ``second``, then a gap in ``first``. O(len(first) * len(second))
    time and memory, fine for realigning single chains.
    """

    name = "python-overlap-aligner"

    def __init__(
        self,
        match_score: float = 5.0,
        mismatch_score: float = -4.0,
        gap_open: float = 10.0,
        gap_extend: float = 0.5,
    ) -> None:
        self.match_score = match_score
        self.mismatch_score = mismatch_score
        self.gap_open = gap_open
        self.gap_extend = gap_extend

    def align(self, first: str, second: str) -> tuple[str, str]:
        n, m = len(first), len(second)
        neg = float("-inf")
        # Three states per cell: "M" ends in first[i-1]~second[j-1], "U" ends in first[i-1]~gap,
        # "L" ends in gap~second[j-1]. score[s][i][j] is the best score, back[s][i][j] the state
        # of the predecessor cell.
        score = {s: [[neg] * (m + 1) for _ in range(n + 1)] for s in _STATES}
        back = {s: [[""] * (m + 1) for _ in range(n + 1)] for s in _STATES}
        score["M"][0][0] = 0.0
        for i in range(1, n + 1):  # leading gap in `second`: free
            score["U"][i][0], back["U"][i][0] = 0.0, ("M" if i == 1 else "U")
        for j in range(1, m + 1):  # leading gap in `first`: free
            score["L"][0][j], back["L"][0][j] = 0.0, ("M" if j == 1 else "L")

        for i in range(1, n + 1):
            for j in range(1, m + 1):
                pair = self.match_score if first[i - 1] == second[j - 1] else self.mismatch_score
                state, best = _best_of(score, i - 1, j - 1, _STATES)
                score["M"][i][j], back["M"][i][j] = best + pair, state
                # gap in `second` (consume first[i-1]); free once `second` is used up (j == m)
                open_cost, extend_cost = (0.0, 0.0) if j == m else (self.gap_open, self.gap_extend)
                state, best = _best_gap_step(score, i - 1, j, "U", open_cost, extend_cost)
                score["U"][i][j], back["U"][i][j] = best, state
                # gap in `first` (consume second[j-1]); free once `first` is used up (i == n)
                open_cost, extend_cost = (0.0, 0.0) if i == n else (self.gap_open, self.gap_extend)
                state, best = _best_gap_step(score, i, j - 1, "L", open_cost, extend_cost)
                score["L"][i][j], back["L"][i][j] = best, state

        state, _ = _best_of(score, n, m, _STATES)
        out_first: list[str] = []
        out_second: list[str] = []
        i, j = n, m
        while i > 0 or j > 0:
            previous = back[state][i][j]
            if state == "M":
                out_first.append(first[i - 1])
                out_second.append(second[j - 1])
                i, j = i - 1, j - 1
            elif state == "U":
                out_first.append(first[i - 1])
                out_second.append("-")
                i -= 1
            else:
                out_first.append("-")
                out_second.append(second[j - 1])
                j -= 1
            state = previous
        return "".join(reversed(out_first)), "".join(reversed(out_second))


_STATES = ("M", "U", "L")


def _best_of(score, i: int, j: int, states: Sequence[str]) -> tuple[str, float]:
    """Highest-scoring state at cell (i, j); ties go to the earlier state in ``states``."""
    best_state, best = states[0], score[states[0]][i][j]
    for state in states[1:]:
        if score[state][i][j] > best:
            best_state, best = state, score[state][i][j]
    return best_state, best


def _best_gap_step(score, i: int, j: int, gap_state: str, open_cost: float, extend_cost: float):
    """Enter ``gap_state`` from cell (i, j): open from another state or extend the same gap."""
    other = "L" if gap_state == "U" else "U"
    best_state, best = "M", score["M"][i][j] - open_cost
    if score[other][i][j] - open_cost > best:
        best_state, best = other, score[other][i][j] - open_cost
    if score[gap_state][i][j] - extend_cost > best:
        best_state, best = gap_state, score[gap_state][i][j] - extend_cost
    return best_state, best


def make_aligner(kalign_binary_path: str | None = None) -> SequenceAligner:
    """``kalign`` when given or found on ``PATH``, else the pure-Python :class:`OverlapAligner`."""
    path = kalign_binary_path or shutil.which("kalign")
    if path:
        logger.info("template realignment: using kalign at %s", path)
        return KalignAligner(path)
    logger.info(
        "template realignment: kalign not found on PATH; using the pure-Python %s fallback",
        OverlapAligner.name,
    )
    return OverlapAligner()


# ----------------------------------------------------------------------------------------------
# the featurizer


@dataclasses.dataclass(frozen=True)
class TemplateFilter:
    """Thresholds of the hit prefilter and of the per-template checks (AlphaFold's defaults)."""

    max_subsequence_ratio: float = 0.95  # drop exact sub-sequences of the query covering more
    min_align_ratio: float = 0.1  # drop hits with aligned_cols / N_res <= this
    min_template_length: int = 10  # drop hits with fewer residues
    max_ca_ca_distance: float = 150.0  # Å between consecutive resolved Cα; "essentially infinite"
    min_atoms: int = 5  # alanine's heavy atoms: fewer resolved atoms means no usable template
    min_realign_identity: float = 0.9  # identity (over the shorter sequence) after realignment


class TemplateHitFeaturizer:
    """Turns HHsearch hits into raw template features (``HhsearchHitFeaturizer`` in AlphaFold).

    Args:
        mmcif_dir: directory holding ``{pdb_id}.cif`` (or ``.cif.gz``); ignored when
            ``load_structure`` is given.
        max_template_date: hits released after this date are dropped.
        max_hits: stop after this many templates were featurised (AlphaFold: 20).
        release_dates: optional ``pdb_id -> release date`` for the cheap prefilter; the release
            date inside each mmCIF is checked again after parsing.
        obsolete_pdbs: optional ``obsolete pdb_id -> replacement pdb_id`` (``None`` = withdrawn).
        allowed_chain_ids: optional set of ``"{pdb_id}_{chain}"`` that may serve as templates
            (the MLPerf reference's ``template_pdb_chain_ids``: chains present in its PDB copy).
        kalign_binary_path: ``kalign`` to use for realignment (default: look it up on ``PATH``).
        aligner: explicit realignment backend (overrides ``kalign_binary_path``).
        load_structure: ``pdb_id -> MmcifEntry`` (default: parse from ``mmcif_dir``); must raise
            ``FileNotFoundError`` or :class:`ParseError` when the structure is unavailable.
        filters: thresholds, see :class:`TemplateFilter`.
        structure_cache_size: parsed mmCIF entries kept in memory (``mmcif_dir`` loading only).
        zero_center: translate each template chain so the mean of its resolved atoms is at the
            origin (the MLPerf reference; ``False``: the deposited frame, as DeepMind's AlphaFold).
        fix_arginine_naming: passed to :func:`~scalefold.data.parsers.mmcif.parse_mmcif`
            (``mmcif_dir`` loading only; off, as the reference).
    """

    def __init__(
        self,
        mmcif_dir: PathLike | None,
        max_template_date: Union[str, datetime.date],
        max_hits: int = 20,
        release_dates: Mapping[str, Union[str, datetime.date]] | None = None,
        obsolete_pdbs: Mapping[str, str | None] | None = None,
        allowed_chain_ids: Collection[str] | None = None,
        kalign_binary_path: str | None = None,
        aligner: SequenceAligner | None = None,
        load_structure: Callable[[str], MmcifEntry] | None = None,
        filters: TemplateFilter = TemplateFilter(),
        structure_cache_size: int = 32,
        zero_center: bool = True,
        fix_arginine_naming: bool = False,
    ) -> None:
        if mmcif_dir is None and load_structure is None:
            raise ValueError("give mmcif_dir or load_structure")
        self.mmcif_dir = None if mmcif_dir is None else Path(mmcif_dir)
        self.max_template_date = _to_date(max_template_date)
        self.max_hits = max_hits
        self.release_dates = {k.lower(): _to_date(v) for k, v in (release_dates or {}).items()}
        self.obsolete_pdbs = {k.lower(): v for k, v in (obsolete_pdbs or {}).items()}
        self.allowed_chain_ids = None if allowed_chain_ids is None else frozenset(allowed_chain_ids)
        self.aligner = aligner if aligner is not None else make_aligner(kalign_binary_path)
        self.zero_center = zero_center
        self.fix_arginine_naming = fix_arginine_naming
        if load_structure is None:  # parsed entries are reused by the hits of the next queries
            load_structure = functools.lru_cache(maxsize=structure_cache_size)(self._load_from_dir)
        self.load_structure = load_structure
        self.filters = filters

    # -- public -------------------------------------------------------------------------------

    def get_templates(
        self,
        query_sequence: str,
        hits: Sequence[TemplateHit],
        query_pdb_id: str | None = None,
        max_template_date: Union[str, datetime.date] | None = None,
        shuffle_top_k: int | None = None,
        shuffling_seed: int | None = None,
    ) -> TemplateSearchResult:
        """Featurise ``hits`` for ``query_sequence``, best ``sum_probs`` first.

        Args:
            query_pdb_id: (training) hits from the query's own PDB entry are dropped.
            max_template_date: overrides the featurizer's cutoff for this query (the reference
                uses the query's release date minus a margin).
            shuffle_top_k, shuffling_seed: (training, MLPerf reference) after prefiltering and
                sorting, the top ``shuffle_top_k`` hits are shuffled with ``random.Random(seed)``.
        """
        cutoff = self.max_template_date if max_template_date is None else _to_date(max_template_date)
        skipped: list[SkippedHit] = []
        candidates = []
        for hit in hits:
            try:
                pdb_id, chain_id = self._resolve_pdb_id(hit)
                self._prefilter(hit, pdb_id, chain_id, query_sequence, query_pdb_id, cutoff)
            except TemplateError as exc:
                skipped.append(SkippedHit(hit.name, "prefilter", exc.reason, exc.detail))
                logger.debug("template hit %s skipped by prefilter: %s", _short_name(hit), exc)
                continue
            candidates.append((hit, pdb_id, chain_id))
        candidates = order_prefiltered_hits(candidates, lambda c: _sum_probs(c[0]), shuffle_top_k, shuffling_seed)

        templates: list[AlignedTemplate] = []
        warnings: list[str] = []
        for hit, pdb_id, chain_id in candidates:
            if len(templates) >= self.max_hits:
                break
            try:
                template, warning = self._featurize_hit(hit, pdb_id, chain_id, query_sequence, cutoff)
            except TemplateError as exc:
                skipped.append(SkippedHit(hit.name, "featurize", exc.reason, exc.detail))
                logger.info("template hit %s skipped: %s", _short_name(hit), exc)
                continue
            if warning:
                warnings.append(warning)
                logger.info(warning)
            templates.append(template)
        return TemplateSearchResult(stack_templates(templates, len(query_sequence)), skipped, warnings)

    def assess_hits(
        self,
        query_sequence: str,
        hits: Sequence[TemplateHit],
        query_pdb_id: str | None = None,
        max_template_date: Union[str, datetime.date] | None = None,
    ) -> list[HitOutcome]:
        """Prefilter *and* featurise every hit (no ordering, no ``max_hits`` stop): one outcome per hit.

        This is the seed-independent part of :meth:`get_templates`; :func:`select_templates` does
        the rest (ranking, top-``k`` shuffle, first ``max_hits`` usable) and gives the same features.
        ``scalefold preprocess`` stores these outcomes so training needs no mmCIF directory.
        """
        cutoff = self.max_template_date if max_template_date is None else _to_date(max_template_date)
        outcomes: list[HitOutcome] = []
        for hit in hits:
            try:
                pdb_id, chain_id = self._resolve_pdb_id(hit)
                self._prefilter(hit, pdb_id, chain_id, query_sequence, query_pdb_id, cutoff)
            except TemplateError as exc:
                outcomes.append(HitOutcome(STAGE_PREFILTER, _sum_probs(hit), exc.reason))
                continue
            try:
                template, warning = self._featurize_hit(hit, pdb_id, chain_id, query_sequence, cutoff)
            except TemplateError as exc:
                outcomes.append(HitOutcome(STAGE_FEATURIZE, _sum_probs(hit), exc.reason))
                logger.debug("template hit %s skipped: %s", _short_name(hit), exc)
                continue
            if warning:
                logger.info(warning)
            outcomes.append(HitOutcome(STAGE_OK, _sum_probs(hit), template=template))
        return outcomes

    # -- steps --------------------------------------------------------------------------------

    def _resolve_pdb_id(self, hit: TemplateHit) -> tuple[str, str]:
        """``(pdb_id, chain_id)`` of a hit, with obsolete ids replaced by their successor."""
        match = _HIT_NAME_PATTERN.match(hit.name)
        if not match:
            raise TemplateError("bad_hit_name", f"hit name does not start with PDBID_chain: {hit.name!r}")
        pdb_id, chain_id = match.group(0).split("_")
        pdb_id = pdb_id.lower()
        if pdb_id in self.obsolete_pdbs:
            replacement = self.obsolete_pdbs[pdb_id]
            if replacement is None:
                raise TemplateError("obsolete", f"{pdb_id} is obsolete without replacement")
            if pdb_id not in self.release_dates:
                pdb_id = replacement.lower()
        return pdb_id, chain_id

    def _prefilter(
        self,
        hit: TemplateHit,
        pdb_id: str,
        chain_id: str,
        query_sequence: str,
        query_pdb_id: str | None,
        cutoff: datetime.date,
    ) -> None:
        """AlphaFold's ``_assess_hhsearch_hit`` (+ the reference's allowed-chain and query-id checks)."""
        f = self.filters
        if self.allowed_chain_ids is not None and f"{pdb_id}_{chain_id}" not in self.allowed_chain_ids:
            raise TemplateError("not_in_template_set", f"{pdb_id}_{chain_id} is not an allowed template chain")
        if query_pdb_id is not None and pdb_id == query_pdb_id.lower():
            raise TemplateError("template_is_query", f"{pdb_id} is the query's own entry")
        release_date = self.release_dates.get(pdb_id)
        if release_date is not None and release_date > cutoff:
            raise TemplateError("released_after_cutoff", f"{pdb_id} released {release_date} > {cutoff}")
        align_ratio = hit.aligned_cols / len(query_sequence)
        if align_ratio <= f.min_align_ratio:
            raise TemplateError("align_ratio_too_small", f"align ratio {align_ratio:.3f} <= {f.min_align_ratio}")
        template_sequence = hit.hit_sequence.replace("-", "")
        length_ratio = len(template_sequence) / len(query_sequence)
        if template_sequence in query_sequence and length_ratio > f.max_subsequence_ratio:
            raise TemplateError("duplicate_of_query", f"hit is a sub-sequence of the query covering {length_ratio:.3f}")
        if len(template_sequence) < f.min_template_length:
            raise TemplateError("too_short", f"{len(template_sequence)} residues < {f.min_template_length}")

    def _featurize_hit(
        self, hit: TemplateHit, pdb_id: str, chain_id: str, query_sequence: str, cutoff: datetime.date
    ) -> tuple[AlignedTemplate, str | None]:
        """AlphaFold's ``_process_single_hit`` + ``_extract_template_features`` for one hit."""
        mapping = build_query_to_hit_mapping(
            hit.query, hit.hit_sequence, hit.indices_hit, hit.indices_query, query_sequence
        )
        template_sequence = hit.hit_sequence.replace("-", "")
        try:
            entry = self.load_structure(pdb_id)
        except FileNotFoundError as exc:
            raise TemplateError("mmcif_missing", f"no mmCIF for {pdb_id}: {exc}") from exc
        except ParseError as exc:
            reason = "mmcif_missing" if exc.reason == "missing_file" else f"mmcif_{exc.reason}"
            raise TemplateError(reason, f"cannot use mmCIF of {pdb_id}: {exc}") from exc
        if entry.release_date is not None:
            release_date = _to_date(entry.release_date)
            if release_date > cutoff:
                raise TemplateError("released_after_cutoff", f"{pdb_id} released {release_date} > {cutoff}")
        chain_sequences = {cid: chain.sequence for cid, chain in entry.chains.items()}
        if not chain_sequences:
            raise TemplateError("no_chains", f"no protein chains in {pdb_id}")

        warning = None
        try:
            seqres, chain_id, offset = find_template_in_chains(template_sequence, chain_id, chain_sequences)
        except TemplateError:
            seqres, mapping, chain_id = self._realign(template_sequence, chain_id, chain_sequences, mapping, pdb_id)
            warning = (
                f"template {pdb_id}_{chain_id}: hit sequence {template_sequence!r} not found in the mmCIF; "
                f"realigned to the chain sequence with {self.aligner.name}"
            )
            template_sequence, offset = seqres, 0

        chain = entry.chains[chain_id]
        positions = chain.all_atom_positions  # [N_chain, 37, 3]
        mask = chain.all_atom_mask  # [N_chain, 37]
        if self.zero_center:
            positions = zero_center_positions(positions, mask)
        check_ca_ca_distances(positions, mask, self.filters.max_ca_ca_distance, f"{pdb_id}_{chain_id}")

        query_index = np.array(sorted(mapping), dtype=np.int32)  # [K]
        template_index = np.array([mapping[q] for q in query_index.tolist()], dtype=np.int64)  # [K]
        out_mask = mask[template_index + offset].astype(np.float32)  # [K, 37]
        if out_mask.sum() < self.filters.min_atoms:
            raise TemplateError(
                "no_resolved_atoms",
                f"{pdb_id}_{chain_id}: fewer than {self.filters.min_atoms} resolved atoms at the aligned residues",
            )
        template = AlignedTemplate(
            domain_name=f"{pdb_id}_{chain_id}",
            sum_probs=_sum_probs(hit),
            query_index=query_index,
            residues="".join(template_sequence[t] for t in template_index.tolist()),
            all_atom_positions=positions[template_index + offset].astype(np.float32),  # [K, 37, 3]
            all_atom_mask=out_mask,
        )
        return template, warning

    def _realign(
        self,
        old_sequence: str,
        chain_id: str,
        chain_sequences: Mapping[str, str],
        old_mapping: Mapping[int, int],
        pdb_id: str,
    ) -> tuple[str, dict[int, int], str]:
        """Realign the hit sequence to the chain's SEQRES sequence and remap the query mapping."""
        new_sequence = chain_sequences.get(chain_id, "")
        if not new_sequence:
            # The reference realigns to the entry's only chain here, but then reads the atoms of the
            # hit's chain id, finds none (NoAtomDataInTemplateError) and drops the hit: so do we.
            raise TemplateError("chain_not_found", f"chain {chain_id!r} not among the protein chains of {pdb_id}")
        try:
            old_aligned, new_aligned = self.aligner.align(old_sequence, new_sequence)
        except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
            raise TemplateError(
                "realign_failed", f"{self.aligner.name} could not align {pdb_id}_{chain_id}: {exc}"
            ) from exc
        old_to_new, identity = alignment_index_map(old_aligned, new_aligned)
        if identity / min(len(old_sequence), len(new_sequence)) < self.filters.min_realign_identity:
            raise TemplateError(
                "realign_low_identity",
                f"{pdb_id}_{chain_id}: hit sequence {old_sequence!r} and mmCIF sequence differ by more "
                f"than {1 - self.filters.min_realign_identity:.0%} ({self.aligner.name})",
            )
        # Positions without a counterpart in the mmCIF sequence stay gaps (see module docstring).
        new_mapping = {q: old_to_new[t] for q, t in old_mapping.items() if t in old_to_new}
        return new_sequence, new_mapping, chain_id

    # -- helpers ------------------------------------------------------------------------------

    def _load_from_dir(self, pdb_id: str) -> MmcifEntry:
        for name in (f"{pdb_id}.cif", f"{pdb_id}.cif.gz", f"{pdb_id.upper()}.cif", f"{pdb_id.upper()}.cif.gz"):
            path = self.mmcif_dir / name
            if path.is_file():
                return parse_mmcif(path, pdb_id=pdb_id, fix_arginine_naming=self.fix_arginine_naming)
        raise FileNotFoundError(f"{pdb_id}.cif not in {self.mmcif_dir}")


def stack_templates(templates: Sequence[AlignedTemplate], num_res: int) -> dict[str, np.ndarray]:
    """Raw template features ``[N_templ, N_res, ...]`` of ``templates`` in the given order."""
    if not templates:
        return empty_template_features(num_res)
    dense = [t.dense(num_res) for t in templates]
    return {
        key: np.stack([d[key] for d in dense], axis=0).astype(dtype) for key, dtype in TEMPLATE_FEATURE_DTYPES.items()
    }


Item = TypeVar("Item")


def order_prefiltered_hits(
    hits: Sequence[Item], sum_probs: Callable[[Item], float], shuffle_top_k: int | None, seed: int | None
) -> list[Item]:
    """Featurisation order of prefiltered hits: best ``sum_probs`` first (stable), then (training,
    MLPerf reference) the top ``shuffle_top_k`` shuffled with ``random.Random(seed)``.

    ``shuffle_top_k=None`` (validation) keeps the ranking. The caller featurises hits in this order
    and stops after ``max_hits`` templates.
    """
    ranked = sorted(hits, key=sum_probs, reverse=True)
    if shuffle_top_k is None:
        return ranked
    top = ranked[:shuffle_top_k]
    random.Random(seed).shuffle(top)
    return top + ranked[shuffle_top_k:]


def select_templates(
    outcomes: Sequence[HitOutcome],
    num_res: int,
    max_hits: int,
    shuffle_top_k: int | None = None,
    shuffling_seed: int | None = None,
) -> dict[str, np.ndarray]:
    """Raw template features from precomputed :meth:`TemplateHitFeaturizer.assess_hits` outcomes.

    Equals ``get_templates(..., shuffle_top_k, shuffling_seed)`` of a featurizer with ``max_hits``
    on the same hits: prefilter survivors are ranked and shuffled exactly as there, then the first
    ``max_hits`` usable ones are kept. Raises ``ValueError`` for hits that were never assessed.
    """
    unprocessed = sum(o.stage == STAGE_UNPROCESSED for o in outcomes)
    if unprocessed:
        raise ValueError(
            f"{unprocessed} template hit(s) have no precomputed template structure; rebuild the store with "
            "`scalefold preprocess` (templates are featurised at preprocessing time)"
        )
    candidates = [o for o in outcomes if o.stage != STAGE_PREFILTER]
    ordered = order_prefiltered_hits(candidates, lambda o: o.sum_probs, shuffle_top_k, shuffling_seed)
    chosen = [o.template for o in ordered if o.stage == STAGE_OK][:max_hits]
    return stack_templates(chosen, num_res)


def empty_template_features(num_res: int) -> dict[str, np.ndarray]:
    """Zero templates, as the MLPerf reference's ``_create_empty_template_feats``: ``template_aatype``
    is int32 ``[0, N_res]`` (no one-hot axis), the coordinate arrays keep their trailing shapes."""
    return {
        "template_aatype": np.zeros((0, num_res), np.int32),
        "template_all_atom_positions": np.zeros((0, num_res, rc.atom_type_num, 3), np.float32),
        "template_all_atom_masks": np.zeros((0, num_res, rc.atom_type_num), np.float32),
        "template_domain_names": np.zeros((0,), np.str_),
        "template_sequence": np.zeros((0,), np.str_),
        "template_sum_probs": np.zeros((0, 1), np.float32),
    }


# ----------------------------------------------------------------------------------------------
# pure functions (the pieces of the pipeline, testable on their own)


def build_query_to_hit_mapping(
    hit_query: str,
    hit_sequence: str,
    indices_hit: Sequence[int],
    indices_query: Sequence[int],
    query_sequence: str,
) -> dict[int, int]:
    """Map query residue index -> index into the gap-free hit sequence (AlphaFold semantics).

    The ``.hhr`` alignment covers only a segment of the query; the segment's offset in the full
    query is found by string search, and both index lists are shifted to start at 0. Columns where
    either side is a gap, or that fall outside the sequences, are left out.
    """
    if not hit_query:
        return {}
    segment = hit_query.replace("-", "")
    hit_residues = hit_sequence.replace("-", "")
    offset = query_sequence.find(segment)
    first_hit = min(x for x in indices_hit if x > -1)
    first_query = min(x for x in indices_query if x > -1)
    mapping: dict[int, int] = {}
    for q, t in zip(indices_query, indices_hit):
        if q == -1 or t == -1:
            continue
        q, t = q - first_query + offset, t - first_hit
        if t >= len(hit_residues) or q >= len(query_sequence):
            continue
        mapping[q] = t
    return mapping


def find_template_in_chains(
    template_sequence: str, chain_id: str, chain_sequences: Mapping[str, str]
) -> tuple[str, str, int]:
    """Locate the hit in the mmCIF: ``(chain sequence, chain id, offset of the hit in it)``.

    Tries, in order: the named chain containing the sequence; any chain containing it; any chain
    matching it with ``X`` as a wildcard on either side. Raises :class:`TemplateError` otherwise.
    """
    chain_sequence = chain_sequences.get(chain_id)
    if chain_sequence and template_sequence in chain_sequence:
        return chain_sequence, chain_id, chain_sequence.find(template_sequence)
    for other_id, chain_sequence in chain_sequences.items():
        if chain_sequence and template_sequence in chain_sequence:
            return chain_sequence, other_id, chain_sequence.find(template_sequence)
    pattern = re.compile("".join("." if aa == "X" else f"(?:{re.escape(aa)}|X)" for aa in template_sequence))
    for other_id, chain_sequence in chain_sequences.items():
        match = pattern.search(chain_sequence)
        if match:
            return chain_sequence, other_id, match.start()
    raise TemplateError("sequence_not_in_template", f"{template_sequence!r} not found in any chain")


def alignment_index_map(first_aligned: str, second_aligned: str) -> tuple[dict[int, int], int]:
    """From two aligned rows: ``({index in first -> index in second}, number of identical pairs)``."""
    mapping: dict[int, int] = {}
    first_index = second_index = -1
    identical = 0
    for a, b in zip(first_aligned, second_aligned):
        if a != "-":
            first_index += 1
        if b != "-":
            second_index += 1
        if a != "-" and b != "-":
            mapping[first_index] = second_index
            identical += a == b
    return mapping, identical


def zero_center_positions(positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A copy of ``positions`` ``[N, 37, 3]`` with the mean of the resolved atoms (``mask`` ``[N, 37]``
    > 0) subtracted from every resolved atom; unresolved atoms keep their value.

    Exactly the reference's ``zero_center_atom_positions``: float32 in, float32 mean
    (``ndarray.mean(axis=0)`` over the resolved atoms in row order), float32 subtraction, so the
    result is bit-identical to it. No resolved atom: unchanged.
    """
    resolved = np.asarray(mask) > 0  # [N, 37]
    centred = np.array(positions, dtype=np.float32, copy=True)  # [N, 37, 3]
    if resolved.any():
        centred[resolved] -= centred[resolved].mean(axis=0)  # [3]
    return centred


def check_ca_ca_distances(positions: np.ndarray, mask: np.ndarray, max_distance: float, name: str = "template") -> None:
    """Raise when two consecutive residues with resolved Cα are more than ``max_distance`` apart."""
    ca = rc.atom_order["CA"]
    both = (mask[:-1, ca] > 0) & (mask[1:, ca] > 0)  # [N - 1]
    distances = np.linalg.norm(positions[1:, ca] - positions[:-1, ca], axis=-1)  # [N - 1]
    too_far = np.nonzero(both & (distances > max_distance))[0]
    if too_far.size:
        i = int(too_far[0])
        raise TemplateError(
            "ca_ca_distance",
            f"{name}: Cα of residues {i} and {i + 1} are {distances[i]:.1f} Å apart (> {max_distance})",
        )


#: The reference's template cutoff: templates released up to this many days before the query.
DAYS_BEFORE_RELEASE = 60


def template_cutoff(query_release_date: Union[str, datetime.date], days_before_release: int = DAYS_BEFORE_RELEASE):
    """Latest template release date allowed for a query (MLPerf reference: query date - 60 days)."""
    return _to_date(query_release_date) - datetime.timedelta(days=days_before_release)


def _sum_probs(hit: TemplateHit) -> float:
    return 0.0 if hit.sum_probs is None else float(hit.sum_probs)


def _short_name(hit: TemplateHit) -> str:
    return hit.name.split()[0] if hit.name else "?"


def _to_date(value: Union[str, datetime.date]) -> datetime.date:
    if isinstance(value, datetime.datetime):
        return value.date()
    if isinstance(value, datetime.date):
        return value
    return datetime.date.fromisoformat(str(value)[:10])
