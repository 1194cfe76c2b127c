"""Raw features of one query: sequence, MSA and template features (AF2 supplement 1.2).

These are AlphaFold's *raw* features, the dict its ``DataPipeline.process`` returns and the MLPerf
reference stores/feeds into ``process_features``; every later transform (MSA sampling, clustering,
masking, cropping) starts from them. Keys and dtypes:

=============================  ============  ===================================================
key                            dtype         meaning
=============================  ============  ===================================================
``aatype``                     int32         ``[N_res, 21]`` one-hot, our residue order + X
``between_segment_residues``   int32         ``[N_res]`` zeros
``domain_name``                str           ``[1]`` query description
``residue_index``              int32         ``[N_res]`` 0 .. N_res-1
``seq_length``                 int32         ``[N_res]`` N_res repeated
``sequence``                   str           ``[1]`` query sequence
``msa``                        int32         ``[N_seq, N_res]`` HHblits ids (21 = gap); converted to
                                             our residue order later (``correct_msa_restypes``)
``deletion_matrix_int``        int32         ``[N_seq, N_res]`` residues deleted before each column
``num_alignments``             int32         ``[N_res]`` N_seq repeated
``template_*``                 see :mod:`scalefold.data.templates`
=============================  ============  ===================================================

String features are numpy unicode arrays (AlphaFold stores UTF-8 ``bytes`` objects).

MSA sources are concatenated in AlphaFold's order -- UniRef90, BFD (+Uniclust), MGnify -- with
UniRef90 capped at 10,000 and MGnify at 501 rows, and rows whose aligned sequence was already seen
dropped (the first occurrence wins).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Union

import numpy as np

from scalefold import residue_constants as rc
from scalefold.data.parsers import MsaError
from scalefold.data.parsers.hhr import TemplateHit, parse_hhr
from scalefold.data.parsers.msa import Msa, merge_msas, parse_fasta, parse_msa_file, validate_msa
from scalefold.data.templates import TemplateHitFeaturizer, empty_template_features

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


@dataclasses.dataclass(frozen=True)
class MsaSource:
    """One MSA database: candidate file names in an alignment directory and AlphaFold's row cap."""

    name: str
    filenames: tuple[str, ...]
    max_sequences: int | None = None


# AlphaFold's DataPipeline order (uniref90, bfd, mgnify) and caps (uniref_max_hits, mgnify_max_hits).
DEFAULT_MSA_SOURCES: tuple[MsaSource, ...] = (
    MsaSource("uniref90", ("uniref90_hits.sto", "uniref90_hits.a3m"), max_sequences=10_000),
    MsaSource("bfd", ("bfd_uniclust_hits.a3m", "bfd_uniref_hits.a3m", "small_bfd_hits.sto", "small_bfd_hits.a3m")),
    MsaSource("mgnify", ("mgnify_hits.sto", "mgnify_hits.a3m"), max_sequences=501),
)
TEMPLATE_HITS_FILENAMES: tuple[str, ...] = ("pdb70_hits.hhr", "hhsearch_output.hhr")


def make_sequence_features(sequence: str, description: str, num_res: int) -> dict[str, np.ndarray]:
    """Sequence features (AlphaFold's ``make_sequence_features``); unknown letters become X."""
    if len(sequence) != num_res:
        raise ValueError(f"sequence has {len(sequence)} residues, num_res is {num_res}")
    return {
        "aatype": rc.sequence_to_onehot(sequence, rc.restype_order_with_x, map_unknown_to_x=True),
        "between_segment_residues": np.zeros((num_res,), dtype=np.int32),
        "domain_name": np.array([description], dtype=np.str_),
        "residue_index": np.arange(num_res, dtype=np.int32),
        "seq_length": np.full((num_res,), num_res, dtype=np.int32),
        "sequence": np.array([sequence], dtype=np.str_),
    }


def make_msa_features(msas: Sequence[Msa]) -> dict[str, np.ndarray]:
    """MSA features (AlphaFold's ``make_msa_features``) from MSAs whose first row is the query.

    Rows are deduplicated across ``msas`` in the order given; ``msa`` holds HHblits ids.
    """
    if not msas:
        raise MsaError("empty_msa", "at least one MSA must be provided")
    for index, msa in enumerate(msas):
        if len(msa) == 0:
            raise MsaError("empty_msa", f"MSA {index} has no sequences")
    merged = merge_msas(msas)
    num_res = len(msas[0].sequences[0])
    lookup = rc.HHBLITS_AA_TO_ID
    try:
        msa = np.array([[lookup[res] for res in row] for row in merged.sequences], dtype=np.int32)
    except KeyError as exc:
        raise MsaError("msa_invalid_character", f"character {exc.args[0]!r} outside the HHblits alphabet") from exc
    deletion_matrix = np.array(merged.deletion_matrix, dtype=np.int32)
    if msa.shape[1] != num_res or deletion_matrix.shape != msa.shape:
        raise MsaError("msa_query_length_mismatch", f"MSA rows do not all have {num_res} columns")
    return {
        "deletion_matrix_int": deletion_matrix,  # [N_seq, N_res]
        "msa": msa,  # [N_seq, N_res]
        "num_alignments": np.full((num_res,), len(merged), dtype=np.int32),  # [N_res]
    }


def build_raw_features(
    sequence: str,
    description: str,
    msas: Sequence[Msa],
    template_hits: Sequence[TemplateHit] = (),
    template_featurizer: TemplateHitFeaturizer | None = None,
    query_pdb_id: str | None = None,
    max_template_date: str | None = None,
    shuffle_top_k: int | None = None,
    shuffling_seed: int | None = None,
) -> dict[str, np.ndarray]:
    """Sequence + MSA + template features of one query.

    MSAs are validated against the query length. Without ``template_featurizer`` (or without hits)
    the template features are empty (zero templates). With no MSA at all the query alone is used,
    as the MLPerf reference does. ``max_template_date``, ``shuffle_top_k`` and ``shuffling_seed``
    go to :meth:`~scalefold.data.templates.TemplateHitFeaturizer.get_templates` (training: the
    query's release date minus 60 days, 20, the sample's seed).
    """
    num_res = len(sequence)
    usable = []
    for msa in msas:
        if len(msa) == 0:
            continue
        validate_msa(msa, query_sequence=sequence)
        usable.append(msa)
    if not usable:
        usable = [Msa([sequence], [[0] * num_res], [description])]
    features = make_sequence_features(sequence, description, num_res)
    features.update(make_msa_features(usable))
    if template_featurizer is not None and template_hits:
        result = template_featurizer.get_templates(
            sequence,
            template_hits,
            query_pdb_id=query_pdb_id,
            max_template_date=max_template_date,
            shuffle_top_k=shuffle_top_k,
            shuffling_seed=shuffling_seed,
        )
        features.update(result.features)
    else:
        features.update(empty_template_features(num_res))
    return features


def read_alignment_dir(
    alignment_dir: PathLike, sources: Sequence[MsaSource] = DEFAULT_MSA_SOURCES
) -> tuple[list[Msa], list[TemplateHit]]:
    """The MSAs (in ``sources`` order, capped) and HHsearch hits found in an alignment directory.

    For each source the first existing file among its ``filenames`` is used; absent sources are
    skipped. Hits come from the first existing ``.hhr`` in :data:`TEMPLATE_HITS_FILENAMES` (none: ``[]``).
    """
    alignment_dir = Path(alignment_dir)
    msas: list[Msa] = []
    for source in sources:
        path = next((alignment_dir / f for f in source.filenames if (alignment_dir / f).is_file()), None)
        if path is None:
            logger.debug("no %s MSA in %s", source.name, alignment_dir)
            continue
        msas.append(parse_msa_file(path, max_sequences=source.max_sequences))
    hits: list[TemplateHit] = []
    for name in TEMPLATE_HITS_FILENAMES:
        path = alignment_dir / name
        if path.is_file():
            hits = parse_hhr(path.read_text(), path=str(path))
            break
    return msas, hits


def build_raw_features_from_alignment_dir(
    alignment_dir: PathLike,
    template_featurizer: TemplateHitFeaturizer | None = None,
    sequence: str | None = None,
    description: str | None = None,
    query_pdb_id: str | None = None,
) -> dict[str, np.ndarray]:
    """:func:`build_raw_features` for an alignment directory (AlphaFold / OpenProteinSet layout).

    The query sequence defaults to the first entry of a ``*.fasta`` file in the directory, else to
    the first row of the first MSA; ``description`` defaults to the FASTA header, else the
    directory name.
    """
    alignment_dir = Path(alignment_dir)
    msas, hits = read_alignment_dir(alignment_dir)
    if sequence is None:
        fasta = sorted(alignment_dir.glob("*.fasta"))
        if fasta:
            sequences, descriptions = parse_fasta(fasta[0].read_text())
            if sequences:
                sequence = sequences[0]
                description = description if description is not None else descriptions[0].split()[0]
        if sequence is None:
            if not msas:
                raise MsaError("missing_alignment", "no query sequence and no MSA found", str(alignment_dir))
            sequence = msas[0].sequences[0].replace("-", "")
    if description is None:
        description = alignment_dir.name
    return build_raw_features(sequence, description, msas, hits, template_featurizer, query_pdb_id)
