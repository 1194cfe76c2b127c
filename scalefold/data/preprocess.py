"""``scalefold preprocess``: mmCIF files (+ per-chain alignment directories) → one dataset store.

Worker processes parse one mmCIF file each (and the alignments of its chains); the parent writes
the results to the store in a deterministic (sorted file) order. Nothing bad in one input stops
the run: a file or chain that cannot be used is skipped, the reason is logged, and the report
``<STORE>.report.json`` counts skips per reason with a few examples.

Alignment directories follow OpenProteinSet: ``<alignments_dir>/<pdb_id>_<author chain>/`` holding
``*.a3m`` / ``*.sto`` MSAs and ``*.hhr`` template hits. MSAs are merged and deduplicated in
AlphaFold's source order (uniref90, bfd/uniclust, mgnify, then any other file by name); raw jackhmmer
Stockholm outputs are capped as AlphaFold does (uniref90 10,000 rows, mgnify 501); a3m files are
used as they are (as the MLPerf reference does with OpenProteinSet).

Template hits are featurised here, once, against their query chain (schema >= 2 stores): the hits'
template structures are read from ``template_mmcif_dir`` (default: the mmCIF directory), with the
MLPerf reference's prefilter (template chain present in that directory, released at least 60 days
before the query, not the query's own entry, ...). The store keeps each hit's outcome and the
aligned template residues' atom37 coordinates, so training needs no mmCIF files; the per-sample
top-20 shuffle happens at training time (:func:`scalefold.data.templates.select_templates`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Union

import numpy as np

from scalefold.data.parsers import HhrError, MsaError, ParseError
from scalefold.data.parsers.hhr import parse_hhr
from scalefold.data.parsers.mmcif import check_chain_usable, parse_mmcif, read_entry_header
from scalefold.data.parsers.msa import Msa, merge_msas, parse_msa_file, validate_msa
from scalefold.data.store import Store, StoreWriter
from scalefold.data.templates import TemplateHitFeaturizer, template_cutoff

logger = logging.getLogger(__name__)
PathLike = Union[str, os.PathLike]

MMCIF_SUFFIXES = (".cif", ".cif.gz", ".mmcif")
MSA_SUFFIXES = (".a3m", ".sto")
TEMPLATE_SUFFIX = ".hhr"
# MSA source order for dedup (AlphaFold / MLPerf reference) and row caps for raw Stockholm hits.
MSA_SOURCE_ORDER = ("uniref90", "bfd", "uniclust", "mgnify")
STOCKHOLM_MAX_HITS = {"uniref90": 10_000, "mgnify": 501}
# Examples kept per skip reason in the report.
REPORT_EXAMPLES = 5


@dataclasses.dataclass(frozen=True)
class TemplateSource:
    """Where template structures come from, plus the prefilter's metadata (picklable).

    ``release_dates`` (pdb id → date) and ``chain_ids`` (``"{pdb_id}_{chain}"`` present) play the
    reference's ``pdb_release_dates`` / ``template_pdb_chain_ids``; see :func:`scan_template_entries`.
    ``max_template_date`` is the cutoff for query chains without a release date.
    """

    mmcif_dir: str
    release_dates: dict[str, str]
    chain_ids: frozenset[str] | None = None
    max_template_date: str = "9999-12-31"
    kalign_binary_path: str | None = None

    def featurizer(self, max_hits: int) -> TemplateHitFeaturizer:
        return TemplateHitFeaturizer(
            self.mmcif_dir,
            self.max_template_date,
            max_hits=max_hits,
            release_dates=self.release_dates,
            allowed_chain_ids=self.chain_ids,
            kalign_binary_path=self.kalign_binary_path,
        )


@dataclasses.dataclass(frozen=True)
class PreprocessOptions:
    """What a worker needs besides the file name (picklable)."""

    alignments_dir: str | None = None
    require_alignments: bool = True
    cluster_ids: dict[str, int] | None = None  # "PDBID_ENTITY" (upper) → cluster id
    templates: TemplateSource | None = None  # featurise template hits (None: store hits only)


def scan_template_entries(mmcif_dir: PathLike, workers: int = 1) -> tuple[dict[str, str], frozenset[str]]:
    """Release date of every entry and every ``"{pdb_id}_{author chain}"`` under ``mmcif_dir``.

    Unreadable files are left out (their hits then fail the prefilter as absent chains).
    """
    files = [str(p) for p in find_mmcif_files(mmcif_dir)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    if workers > 1:
        with multiprocessing.get_context(method).Pool(workers) as pool:
            headers = pool.map(_header_or_none, files, chunksize=16)
    else:
        headers = [_header_or_none(f) for f in files]
    release_dates: dict[str, str] = {}
    chain_ids: set[str] = set()
    for header in headers:
        if header is None:
            continue
        pdb_id, release_date, chains = header
        if release_date:
            release_dates[pdb_id] = release_date
        chain_ids.update(f"{pdb_id}_{c}" for c in chains)
    return release_dates, frozenset(chain_ids)


def _header_or_none(path: str):
    try:
        return read_entry_header(path)
    except ParseError:
        return None


# Per-process featurizer (built once per worker from the options' TemplateSource).
_FEATURIZER: tuple[TemplateSource, TemplateHitFeaturizer] | None = None
# All hits are assessed at preprocessing time; selection (max 4) happens per training sample.
_ASSESS_ALL = 1 << 30


def _featurizer_for(source: TemplateSource) -> TemplateHitFeaturizer:
    global _FEATURIZER
    if _FEATURIZER is None or _FEATURIZER[0] is not source:
        _FEATURIZER = (source, source.featurizer(max_hits=_ASSESS_ALL))
    return _FEATURIZER[1]


# ----------------------------------------------------------------------------------------------
# inputs


def find_mmcif_files(mmcif_dir: PathLike) -> list[Path]:
    """All mmCIF files under ``mmcif_dir`` (recursively), sorted."""
    root = Path(mmcif_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"mmCIF directory not found: {root}")
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.lower().endswith(MMCIF_SUFFIXES))


def load_cluster_ids(path: PathLike) -> dict[str, int]:
    """RCSB ``clusters-by-entity-*.txt``: line ``k`` lists ``PDBID_ENTITY`` members of cluster ``k``."""
    clusters: dict[str, int] = {}
    with open(path) as f:
        for cluster_id, line in enumerate(f.read().strip().splitlines()):
            for member in line.split():
                clusters[member.upper()] = cluster_id
    return clusters


def _msa_sort_key(path: Path) -> tuple[int, str]:
    name = path.name.lower()
    for rank, source in enumerate(MSA_SOURCE_ORDER):
        if name.startswith(source):
            return rank, name
    return len(MSA_SOURCE_ORDER), name


def load_chain_alignments(directory: PathLike, sequence: str) -> tuple[Msa | None, list]:
    """Merged, validated MSA and template hits of one chain's alignment directory.

    Raises :class:`MsaError` / :class:`HhrError` naming the offending file.
    """
    directory = Path(directory)
    msa_files = sorted((p for p in directory.iterdir() if p.suffix.lower() in MSA_SUFFIXES), key=_msa_sort_key)
    msas = []
    for path in msa_files:
        cap = None
        if path.suffix.lower() == ".sto":
            cap = next((n for source, n in STOCKHOLM_MAX_HITS.items() if path.name.lower().startswith(source)), None)
        msa = parse_msa_file(path, max_sequences=cap)
        validate_msa(msa, sequence, path=str(path))
        msas.append(msa)
    hits = []
    for path in sorted(p for p in directory.iterdir() if p.suffix.lower() == TEMPLATE_SUFFIX):
        for hit in parse_hhr(path.read_text(), path=str(path)):
            if max(hit.indices_query, default=-1) >= len(sequence):
                raise HhrError(
                    "hhr_query_length_mismatch",
                    f"hit {hit.index} ({hit.name.split()[0]}) aligns query residue {max(hit.indices_query) + 1} "
                    f"but the chain has {len(sequence)} residues",
                    str(path),
                )
            hits.append(hit)
    if not msa_files:
        raise MsaError("missing_alignment", "no .a3m/.sto file in alignment directory", str(directory))
    return merge_msas(msas), hits


# ----------------------------------------------------------------------------------------------
# worker


def _skip(file: str, chain: str | None, error: Exception) -> dict[str, str]:
    """A report line: the file, the chain ("" when the whole file failed), the reason, and a message
    that names the chain and the offending file."""
    reason = error.reason if isinstance(error, ParseError) else type(error).__name__
    message = str(error)
    if chain and f"chain {chain}" not in message:
        message = f"chain {chain}: {message}"
    return {"file": file, "chain": chain or "", "reason": reason, "message": message}


def process_file(path: str, options: PreprocessOptions) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Parse one mmCIF file and its chains' alignments → (chain records, skip records). Never raises."""
    records, skips = [], []
    try:
        entry = parse_mmcif(path)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a report line
        return [], [_skip(path, None, exc)]
    for author_chain_id, chain in entry.chains.items():
        chain_id = entry.chain_id(author_chain_id)
        try:
            check_chain_usable(entry, chain)
            msa, hits = None, []
            if options.alignments_dir is not None:
                directory = Path(options.alignments_dir) / chain_id
                if directory.is_dir():
                    msa, hits = load_chain_alignments(directory, chain.sequence)
                elif options.require_alignments:
                    raise MsaError("missing_alignment", f"no alignment directory for chain {chain_id}", str(directory))
            outcomes = None
            if hits and options.templates is not None:
                cutoff = template_cutoff(entry.release_date) if entry.release_date else None
                outcomes = _featurizer_for(options.templates).assess_hits(
                    chain.sequence, hits, query_pdb_id=entry.pdb_id, max_template_date=cutoff
                )
            cluster_id = -1
            if options.cluster_ids:
                cluster_id = options.cluster_ids.get(f"{entry.pdb_id}_{chain.entity_id}".upper(), -1)
            record: dict[str, Any] = {
                "chain_id": chain_id,
                "pdb_id": entry.pdb_id,
                "sequence": chain.sequence,
                "all_atom_positions": chain.all_atom_positions,
                "all_atom_mask": chain.all_atom_mask,
                "release_date": entry.release_date,
                "resolution": entry.resolution,
                "method": entry.exptl_method,
                "cluster_id": cluster_id,
                "template_hits": hits,
                "template_outcomes": outcomes,
            }
            if msa is not None:
                record["msa"], record["deletion_matrix"] = msa.to_arrays(np.int16)
            records.append(record)
        except Exception as exc:  # noqa: BLE001
            skips.append(_skip(path, chain_id, exc))
    return records, skips


# Options of this worker process, set once by the pool initializer (not pickled with every task).
_WORKER_OPTIONS: PreprocessOptions | None = None


def _init_worker(options: PreprocessOptions) -> None:
    global _WORKER_OPTIONS
    _WORKER_OPTIONS = options


def _process_in_worker(path: str):
    return process_file(path, _WORKER_OPTIONS)


# ----------------------------------------------------------------------------------------------
# driver


def report_path(store_path: PathLike) -> Path:
    """Where the report of a store goes: ``<STORE>.report.json``."""
    return Path(str(store_path) + ".report.json")


def preprocess(
    mmcif_dir: PathLike,
    alignments_dir: PathLike | None,
    out: PathLike,
    workers: int = 1,
    *,
    require_alignments: bool = True,
    cluster_file: PathLike | None = None,
    progress: bool = True,
    templates: bool = True,
    template_mmcif_dir: PathLike | None = None,
    kalign_binary_path: str | None = None,
) -> dict[str, Any]:
    """Build a store from a directory of mmCIF files; returns (and writes) the report.

    Args:
        mmcif_dir: directory searched recursively for ``*.cif``, ``*.cif.gz``, ``*.mmcif``.
        alignments_dir: per-chain alignment directories (``<pdb_id>_<chain>/``), or None for none.
        out: store path; the report goes to ``<out>.report.json``.
        workers: worker processes (0 or 1 = parse in this process).
        require_alignments: with ``alignments_dir``, skip chains that have no alignment directory
            (reason ``missing_alignment``); False keeps them without MSA.
        cluster_file: optional RCSB clusters-by-entity file for ``cluster_id``.
        progress: show a tqdm progress bar.
        templates: featurise the chains' template hits (store their template structures); False
            stores the hits only (training on such chains then fails with a clear error).
        template_mmcif_dir: where template structures are read (default: ``mmcif_dir``); scanned
            first for release dates and chain ids (the prefilter's metadata).
        kalign_binary_path: ``kalign`` for template realignment (default: from ``PATH``, else the
            pure-Python fallback).
    """
    start = time.perf_counter()
    files = [str(p) for p in find_mmcif_files(mmcif_dir)]
    options = preprocess_options(
        mmcif_dir, alignments_dir, workers, require_alignments=require_alignments, cluster_file=cluster_file,
        templates=templates, template_mmcif_dir=template_mmcif_dir, kalign_binary_path=kalign_binary_path,
    )  # fmt: skip
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written, skipped = write_store(out, files, options, workers, progress)

    report = build_report(out, files, written, skipped, workers, time.perf_counter() - start)
    report_path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def preprocess_options(
    mmcif_dir: PathLike,
    alignments_dir: PathLike | None,
    workers: int,
    *,
    require_alignments: bool,
    cluster_file: PathLike | None,
    templates: bool,
    template_mmcif_dir: PathLike | None,
    kalign_binary_path: str | None,
) -> PreprocessOptions:
    """The workers' :class:`PreprocessOptions` for :func:`preprocess`'s arguments: checks the
    alignments directory, reads the cluster file, and (with templates and alignments) scans the
    template mmCIF directory for the prefilter's release dates and chain ids."""
    if alignments_dir is not None and not Path(alignments_dir).is_dir():
        raise FileNotFoundError(f"alignments directory not found: {alignments_dir}")
    template_source = None
    if templates and alignments_dir is not None:
        template_dir = Path(template_mmcif_dir if template_mmcif_dir is not None else mmcif_dir)
        release_dates, chain_ids = scan_template_entries(template_dir, workers)
        template_source = TemplateSource(
            str(template_dir), release_dates, chain_ids, kalign_binary_path=kalign_binary_path
        )
    return PreprocessOptions(
        alignments_dir=None if alignments_dir is None else str(alignments_dir),
        require_alignments=require_alignments,
        cluster_ids=load_cluster_ids(cluster_file) if cluster_file is not None else None,
        templates=template_source,
    )


def write_store(
    out: Path, files: list[str], options: PreprocessOptions, workers: int, progress: bool
) -> tuple[int, list[dict[str, str]]]:
    """Parse ``files`` (in ``workers`` processes; 0 or 1: in this one) and write their chains to a
    new store at ``out`` in file order. Returns (chains written, skips), the skips logged."""
    from tqdm import tqdm

    skipped: list[dict[str, str]] = []
    written = 0

    # Workers are forked before the store is opened (no HDF5 handle crosses the fork); "spawn" where
    # fork does not exist.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_init_worker, initargs=(options,))
    else:
        _init_worker(options)
    try:
        results = pool.imap(_process_in_worker, files, chunksize=1) if pool else map(_process_in_worker, files)
        first_file: dict[str, str] = {}  # chain id -> the file it was written from
        with Store.create(out) as writer:
            progress_bar = tqdm(results, total=len(files), desc="preprocess", unit="file", disable=not progress)
            for path, (records, skips) in zip(files, progress_bar):
                written += _add_records(writer, path, records, skips, first_file)
                _log_skips(skips)
                skipped.extend(skips)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return written, skipped


def _add_records(
    writer: StoreWriter,
    path: str,
    records: list[dict[str, Any]],
    skips: list[dict[str, str]],
    first_file: dict[str, str],
) -> int:
    """Add the chain records parsed from ``path`` to the store; a chain already written from
    another file (the same entry in two files) is appended to ``skips`` instead. Returns how many
    chains were added."""
    written = 0
    for record in records:
        chain_id = record.pop("chain_id")
        if chain_id in writer:  # the same entry in two files
            skips.append(
                {
                    "file": path,
                    "chain": chain_id,
                    "reason": "duplicate_chain",
                    "message": f"{path}: chain {chain_id} was already read from {first_file[chain_id]}",
                }
            )
            continue
        writer.add_chain(chain_id, **record)
        first_file[chain_id] = path
        written += 1
    return written


def _log_skips(skips: list[dict[str, str]]) -> None:
    for skip in skips:
        logger.warning(
            "skipped %s%s (%s): %s",
            skip["file"],
            f" chain {skip['chain']}" if skip["chain"] else "",
            skip["reason"],
            skip["message"],
        )


def build_report(
    out: Path, files: list[str], written: int, skipped: list[dict[str, str]], workers: int, elapsed: float
) -> dict[str, Any]:
    """The preprocessing report (``<STORE>.report.json``).

    ``skipped`` groups the skips by reason (count + the first few examples); ``skipped_items``
    lists every skipped file (``chain`` empty: the whole file failed) and chain with its reason
    and message, in input order, so no dropped chain goes unrecorded.
    """
    by_reason: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "examples": []})
    for skip in skipped:
        group = by_reason[skip["reason"]]
        group["count"] += 1
        if len(group["examples"]) < REPORT_EXAMPLES:
            group["examples"].append({k: skip[k] for k in ("file", "chain", "message")})
    failed_files = {s["file"] for s in skipped if not s["chain"]}
    with Store.open(out) as store:
        schema_version = store.schema_version
    return {
        "store": str(out),
        "schema_version": schema_version,
        "files_total": len(files),
        "files_failed": len(failed_files),
        "chains_written": written,
        "chains_skipped": sum(1 for s in skipped if s["chain"]),
        "skipped": dict(sorted(by_reason.items())),
        "skipped_items": [{k: skip[k] for k in ("file", "chain", "reason", "message")} for skip in skipped],
        "workers": workers,
        "elapsed_s": round(elapsed, 3),
        "chains_per_s": round(written / elapsed, 2) if elapsed > 0 else None,
    }


__all__ = [
    "PreprocessOptions",
    "TemplateSource",
    "find_mmcif_files",
    "load_chain_alignments",
    "load_cluster_ids",
    "preprocess",
    "preprocess_options",
    "process_file",
    "report_path",
    "scan_template_entries",
    "write_store",
]
