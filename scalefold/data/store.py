"""The dataset store: one HDF5 file holding every training chain, its MSA and its template hits.

Layout (schema version :data:`SCHEMA_VERSION`; root attribute ``schema_version``)::

    /chains/chain_id, pdb_id, release_date, method, sequence   [C] strings
    /chains/resolution [C] float32 (NaN = none), cluster_id [C] int64 (-1 = unknown), length [C] int32
    /chains/residue_offset [C+1] int64    → rows of /residues/*
    /chains/msa_offset     [C+1] int64    → cells of /msa/*   (depth x length per chain)
    /chains/msa_depth      [C]   int32
    /chains/template_offset[C+1] int64    → rows of /templates/*
    /residues/aatype [R] int8, all_atom_positions [R,37,3] float32, all_atom_mask [R,37] uint8
    /msa/ids [M] int8 (HHblits alphabet), /msa/deletions [M] int16 (saturating)
    /templates/index, aligned_cols [T] int32, sum_probs [T] float64, name, query, hit_sequence [T] strings,
    /templates/column_offset [T+1] int64 → /templates/indices_query, indices_hit [K] int32
    /templates/stage [T] int8 (index into templates.HIT_STAGES), reason, domain_name [T] strings
    /templates/residue_offset [T+1] int64 → rows of /template_residues/*
    /template_residues/query_index [P] int32, residue [P] uint8 (ASCII letter),
    /template_residues/all_atom_positions [P,37,3] float32, all_atom_mask [P,37] uint8

Template structures (schema 2; zero-centred per template chain as the MLPerf reference does, and
arginine NH1/NH2 as deposited, since schema 3): every hit is prefiltered and featurised against its query chain at
preprocessing time (:meth:`~scalefold.data.templates.TemplateHitFeaturizer.assess_hits`, cutoff = the
chain's release date minus 60 days); a usable hit keeps the atom37 coordinates of the template
residues aligned to the query, so training builds template features from the store alone
(:func:`~scalefold.data.templates.select_templates` does the seed-dependent top-20 shuffle).

Per-chain variable-size data lives in flat datasets addressed by offsets: one read per array
per sample, which is the fast random-access layout for h5py (one flat dataset per feature plus an
offsets index read 1000 random samples in 0.75 s against 1.1-1.4 s for one dataset per sample, h5py
3.16; compression buys little for float coordinates, so none is used).

The reader opens the file lazily and re-opens it after a ``fork`` (an HDF5 handle must not be
shared between processes), so a :class:`Store` can be handed to data-loader workers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import h5py
import numpy as np

from scalefold import residue_constants as rc
from scalefold.data.parsers.hhr import TemplateHit
from scalefold.data.templates import HIT_STAGES, STAGE_OK, STAGE_UNPROCESSED, AlignedTemplate, HitOutcome
from scalefold.errors import UserError

PathLike = Union[str, os.PathLike]

SCHEMA_VERSION = 3
# What changed in each version (named in the error a reader of another version raises).
SCHEMA_HISTORY = {
    1: "template hits without template structures",
    2: "template hits with their precomputed template structures (training needs no mmCIF directory)",
    3: "the MLPerf reference's coordinates: template chains zero-centred, arginine NH1/NH2 as deposited",
}
FORMAT_NAME = "scalefold-store"
DELETION_DTYPE = np.int16
# Chains buffered in memory by the writer before they are appended to the file.
DEFAULT_FLUSH_EVERY = 256

_STR = h5py.string_dtype()
_CHAIN_STRING_COLUMNS = ("chain_id", "pdb_id", "release_date", "method", "sequence")
_TEMPLATE_STRING_COLUMNS = ("name", "query", "hit_sequence", "reason", "domain_name")


STORE_EXPECTED = "an HDF5 store written by `scalefold synth` or `scalefold preprocess`"
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_HDF5_SIGNATURE_OFFSETS = (0, 512, 1024, 2048)  # HDF5 looks for its superblock after a user block of 2**k bytes


class StoreSchemaError(UserError, ValueError):
    """The file is not a store, or was written with another schema version."""


class StoreFileError(UserError, FileNotFoundError):
    """The store path is missing, a directory or unreadable (a user error: exit 3; a file of another
    format is a :class:`StoreSchemaError`)."""


def _preview(head: bytes) -> str:
    text = head[:24].decode("latin-1").splitlines()[0] if head else ""
    return repr(text) if text.isprintable() else "binary data"


def check_store_file(path: PathLike) -> Path:
    """``path`` if it is a readable HDF5 file, else :class:`StoreFileError` (missing, a directory) or
    :class:`StoreSchemaError` (empty, another format) saying what it is instead: checked before h5py,
    whose errors name neither."""
    p = Path(path)
    if not p.exists():
        raise StoreFileError(f"store {p} does not exist (expected {STORE_EXPECTED})")
    if p.is_dir():
        raise StoreFileError(f"store {p} is a directory (expected {STORE_EXPECTED})")
    try:
        with open(p, "rb") as f:
            head = f.read(_HDF5_SIGNATURE_OFFSETS[-1] + len(_HDF5_SIGNATURE))
    except OSError as exc:
        raise StoreFileError(f"store {p} cannot be read ({exc.strerror})") from exc
    if not head:
        raise StoreSchemaError(f"store {p} is empty (0 bytes; expected {STORE_EXPECTED})")
    if not any(head[o : o + len(_HDF5_SIGNATURE)] == _HDF5_SIGNATURE for o in _HDF5_SIGNATURE_OFFSETS):
        raise StoreSchemaError(f"store {p} is not an HDF5 file (it starts with {_preview(head)}; expected {STORE_EXPECTED})")
    return p


def _aatype(sequence: str) -> np.ndarray:
    """One-letter sequence → int ids in ``restypes_with_x`` order (unknown → X = 20)."""
    unknown = rc.restype_num
    return np.array([rc.restype_order.get(c, unknown) for c in sequence], dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# writer


class StoreWriter:
    """Append chains to a new store; the file appears (atomically renamed) on :meth:`close`."""

    def __init__(self, path: PathLike, flush_every: int = DEFAULT_FLUSH_EVERY, overwrite: bool = True) -> None:
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} exists")
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._file = h5py.File(self._tmp, "w")
        self._file.attrs["schema_version"] = SCHEMA_VERSION
        self._file.attrs["format"] = FORMAT_NAME
        self._flush_every = flush_every
        self._buffer: list[dict[str, Any]] = []
        self._seen: set[str] = set()
        self._counts = {"chains": 0, "residues": 0, "msa": 0, "templates": 0, "columns": 0, "template_residues": 0}
        self._create_datasets()

    # -- layout
    def _create_datasets(self) -> None:
        f = self._file

        def grow(name: str, dtype, tail: tuple = ()) -> None:
            f.create_dataset(name, shape=(0, *tail), maxshape=(None, *tail), dtype=dtype, chunks=True)

        for col in _CHAIN_STRING_COLUMNS:
            grow(f"chains/{col}", _STR)
        grow("chains/resolution", np.float32)
        grow("chains/cluster_id", np.int64)
        grow("chains/length", np.int32)
        grow("chains/msa_depth", np.int32)
        for col in ("residue_offset", "msa_offset", "template_offset"):
            f.create_dataset(f"chains/{col}", data=np.zeros(1, np.int64), maxshape=(None,), chunks=True)
        grow("residues/aatype", np.int8)
        grow("residues/all_atom_positions", np.float32, (rc.atom_type_num, 3))
        grow("residues/all_atom_mask", np.uint8, (rc.atom_type_num,))
        grow("msa/ids", np.int8)
        grow("msa/deletions", DELETION_DTYPE)
        grow("templates/index", np.int32)
        grow("templates/aligned_cols", np.int32)
        grow("templates/sum_probs", np.float64)
        for col in _TEMPLATE_STRING_COLUMNS:
            grow(f"templates/{col}", _STR)
        f.create_dataset("templates/column_offset", data=np.zeros(1, np.int64), maxshape=(None,), chunks=True)
        grow("templates/indices_query", np.int32)
        grow("templates/indices_hit", np.int32)
        grow("templates/stage", np.int8)
        f.create_dataset("templates/residue_offset", data=np.zeros(1, np.int64), maxshape=(None,), chunks=True)
        grow("template_residues/query_index", np.int32)
        grow("template_residues/residue", np.uint8)
        grow("template_residues/all_atom_positions", np.float32, (rc.atom_type_num, 3))
        grow("template_residues/all_atom_mask", np.uint8, (rc.atom_type_num,))

    # -- public API
    def add_chain(
        self,
        chain_id: str,
        *,
        sequence: str,
        all_atom_positions: np.ndarray,
        all_atom_mask: np.ndarray,
        pdb_id: str | None = None,
        release_date: str | None = None,
        resolution: float | None = None,
        cluster_id: int = -1,
        method: str = "",
        msa: np.ndarray | None = None,
        deletion_matrix: np.ndarray | None = None,
        template_hits: Sequence[TemplateHit] = (),
        template_outcomes: Sequence[HitOutcome] | None = None,
    ) -> None:
        """Queue one chain. ``msa`` holds HHblits ids ``[N_seq, N_res]``; ``deletion_matrix`` the same shape.

        ``template_outcomes`` (one per hit, from ``TemplateHitFeaturizer.assess_hits``) carry the
        template structures; without them the hits are stored as never assessed, and training on
        this chain raises a clear error.
        """
        if chain_id in self._seen:
            raise ValueError(f"duplicate chain id {chain_id!r}")
        num_res = len(sequence)
        positions = np.asarray(all_atom_positions, dtype=np.float32)
        mask = np.asarray(all_atom_mask)
        if positions.shape != (num_res, rc.atom_type_num, 3) or mask.shape != (num_res, rc.atom_type_num):
            raise ValueError(
                f"{chain_id}: coordinates {positions.shape} / mask {mask.shape} do not match sequence length {num_res}"
            )
        if msa is None:
            msa_ids = np.zeros((0, num_res), np.int8)
            deletions = np.zeros((0, num_res), DELETION_DTYPE)
        else:
            msa_ids = np.asarray(msa).astype(np.int8)
            if deletion_matrix is None:
                deletion_matrix = np.zeros(msa_ids.shape, np.int64)
            limit = np.iinfo(DELETION_DTYPE).max
            deletions = np.minimum(np.asarray(deletion_matrix, dtype=np.int64), limit).astype(DELETION_DTYPE)
            if msa_ids.ndim != 2 or msa_ids.shape[1] != num_res or deletions.shape != msa_ids.shape:
                raise ValueError(f"{chain_id}: MSA {msa_ids.shape} / deletions {deletions.shape} vs length {num_res}")
        template_hits = list(template_hits)
        if template_outcomes is None:
            template_outcomes = [HitOutcome(STAGE_UNPROCESSED, _hit_sum_probs(h)) for h in template_hits]
        template_outcomes = list(template_outcomes)
        if len(template_outcomes) != len(template_hits):
            raise ValueError(f"{chain_id}: {len(template_outcomes)} template outcomes for {len(template_hits)} hits")
        for outcome in template_outcomes:
            _check_outcome(chain_id, outcome, num_res)
        self._seen.add(chain_id)
        self._buffer.append(
            {
                "chain_id": chain_id,
                "pdb_id": pdb_id if pdb_id is not None else chain_id.rsplit("_", 1)[0],
                "release_date": release_date or "",
                "method": method or "",
                "sequence": sequence,
                "resolution": float("nan") if resolution is None else float(resolution),
                "cluster_id": int(cluster_id),
                "positions": positions,
                "mask": (mask > 0).astype(np.uint8),
                "msa": msa_ids,
                "deletions": deletions,
                "templates": template_hits,
                "outcomes": template_outcomes,
            }
        )
        if len(self._buffer) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Append the buffered chains to the file."""
        if not self._buffer:
            return
        rows = self._buffer
        self._buffer = []
        f, n = self._file, self._counts
        lengths = np.array([len(r["sequence"]) for r in rows], np.int64)
        depths = np.array([r["msa"].shape[0] for r in rows], np.int64)
        num_templates = np.array([len(r["templates"]) for r in rows], np.int64)

        for col in _CHAIN_STRING_COLUMNS:
            _append(f[f"chains/{col}"], np.array([r[col] for r in rows], dtype=object))
        _append(f["chains/resolution"], np.array([r["resolution"] for r in rows], np.float32))
        _append(f["chains/cluster_id"], np.array([r["cluster_id"] for r in rows], np.int64))
        _append(f["chains/length"], lengths.astype(np.int32))
        _append(f["chains/msa_depth"], depths.astype(np.int32))
        _append(f["chains/residue_offset"], n["residues"] + np.cumsum(lengths))
        _append(f["chains/msa_offset"], n["msa"] + np.cumsum(depths * lengths))
        _append(f["chains/template_offset"], n["templates"] + np.cumsum(num_templates))

        _append(f["residues/aatype"], np.concatenate([_aatype(r["sequence"]) for r in rows]).astype(np.int8))
        _append(f["residues/all_atom_positions"], np.concatenate([r["positions"] for r in rows]))
        _append(f["residues/all_atom_mask"], np.concatenate([r["mask"] for r in rows]))
        _append(f["msa/ids"], np.concatenate([r["msa"].reshape(-1) for r in rows]))
        _append(f["msa/deletions"], np.concatenate([r["deletions"].reshape(-1) for r in rows]))

        hits = [h for r in rows for h in r["templates"]]
        if hits:
            widths = np.array([len(h.indices_query) for h in hits], np.int64)
            _append(f["templates/index"], np.array([h.index for h in hits], np.int32))
            _append(f["templates/aligned_cols"], np.array([h.aligned_cols for h in hits], np.int32))
            _append(f["templates/sum_probs"], np.array([h.sum_probs for h in hits], np.float64))
            _append(f["templates/name"], np.array([h.name for h in hits], dtype=object))
            _append(f["templates/query"], np.array([h.query for h in hits], dtype=object))
            _append(f["templates/hit_sequence"], np.array([h.hit_sequence for h in hits], dtype=object))
            _append(f["templates/column_offset"], n["columns"] + np.cumsum(widths))
            _append(f["templates/indices_query"], np.concatenate([np.asarray(h.indices_query, np.int32) for h in hits]))
            _append(f["templates/indices_hit"], np.concatenate([np.asarray(h.indices_hit, np.int32) for h in hits]))
            n["columns"] += int(widths.sum())
            self._append_outcomes([o for r in rows for o in r["outcomes"]])

        n["chains"] += len(rows)
        n["residues"] += int(lengths.sum())
        n["msa"] += int((depths * lengths).sum())
        n["templates"] += int(num_templates.sum())

    def _append_outcomes(self, outcomes: list[HitOutcome]) -> None:
        f, n = self._file, self._counts
        templates = [o.template for o in outcomes if o.template is not None]
        sizes = np.array([0 if o.template is None else len(o.template.query_index) for o in outcomes], np.int64)
        _append(f["templates/stage"], np.array([HIT_STAGES.index(o.stage) for o in outcomes], np.int8))
        _append(f["templates/reason"], np.array([o.reason for o in outcomes], dtype=object))
        names = [o.template.domain_name if o.template is not None else "" for o in outcomes]
        _append(f["templates/domain_name"], np.array(names, dtype=object))
        _append(f["templates/residue_offset"], n["template_residues"] + np.cumsum(sizes))
        if templates:
            _append(f["template_residues/query_index"], np.concatenate([t.query_index for t in templates]))
            letters = np.frombuffer("".join(t.residues for t in templates).encode("ascii"), np.uint8)
            _append(f["template_residues/residue"], letters)
            positions = np.concatenate([t.all_atom_positions for t in templates]).astype(np.float32)
            _append(f["template_residues/all_atom_positions"], positions)
            masks = np.concatenate([t.all_atom_mask for t in templates]).astype(np.uint8)
            _append(f["template_residues/all_atom_mask"], masks)
        n["template_residues"] += int(sizes.sum())

    @property
    def num_chains(self) -> int:
        return self._counts["chains"] + len(self._buffer)

    def __contains__(self, chain_id: str) -> bool:
        return chain_id in self._seen

    def close(self) -> None:
        """Flush, close and move the finished file into place."""
        if self._file is None:
            return
        self.flush()
        self._file.attrs["num_chains"] = self._counts["chains"]
        self._file.close()
        self._file = None
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Discard the partial file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _hit_sum_probs(hit: TemplateHit) -> float:
    return 0.0 if hit.sum_probs is None else float(hit.sum_probs)


def _check_outcome(chain_id: str, outcome: HitOutcome, num_res: int) -> None:
    """Refuse outcomes the store cannot round-trip exactly."""
    if outcome.stage not in HIT_STAGES:
        raise ValueError(f"{chain_id}: unknown template hit stage {outcome.stage!r}")
    template = outcome.template
    if (template is None) != (outcome.stage != STAGE_OK):
        raise ValueError(f"{chain_id}: a template structure is given exactly for hits of stage {STAGE_OK!r}")
    if template is None:
        return
    size = len(template.query_index)
    if (
        len(template.residues) != size
        or np.shape(template.all_atom_positions) != (size, rc.atom_type_num, 3)
        or np.shape(template.all_atom_mask) != (size, rc.atom_type_num)
    ):
        raise ValueError(f"{chain_id}: template {template.domain_name} arrays do not match its {size} residues")
    if size and (min(template.query_index) < 0 or max(template.query_index) >= num_res):
        raise ValueError(f"{chain_id}: template {template.domain_name} covers residues outside the chain")
    if not np.isin(template.all_atom_mask, (0.0, 1.0)).all():
        raise ValueError(f"{chain_id}: template {template.domain_name} atom mask is not 0/1")
    if not template.residues.isascii():
        raise ValueError(f"{chain_id}: template {template.domain_name} residues are not ASCII letters")


def _append(dataset: h5py.Dataset, values: np.ndarray) -> None:
    start = dataset.shape[0]
    dataset.resize(start + len(values), axis=0)
    dataset[start:] = values


# ----------------------------------------------------------------------------------------------
# reader


class Store:
    """Read access to a store file. Use :meth:`open` (reader) or :meth:`create` (writer).

    ``with Store.open(path) as s: s.chain_ids; s.get(chain_id)``
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self._handle: h5py.File | None = None
        self._pid: int | None = None
        self._index: dict[str, int] | None = None
        self._chain_ids: list[str] | None = None
        self._offsets: dict[str, np.ndarray] | None = None
        check_store_file(self.path)
        self._check_schema()

    # -- construction
    @classmethod
    def open(cls, path: PathLike) -> Store:
        """Open a store for reading (the HDF5 file itself is opened lazily, per process)."""
        return cls(path)

    @staticmethod
    def create(path: PathLike, flush_every: int = DEFAULT_FLUSH_EVERY, overwrite: bool = True) -> StoreWriter:
        """A :class:`StoreWriter` for a new store at ``path``."""
        return StoreWriter(path, flush_every=flush_every, overwrite=overwrite)

    # -- process-local handle
    def _file(self) -> h5py.File:
        if self._handle is None or self._pid != os.getpid():
            # After a fork the inherited handle belongs to the parent: drop it without closing.
            self._handle = h5py.File(self.path, "r")
            self._pid = os.getpid()
        return self._handle

    def _check_schema(self) -> None:
        try:
            with h5py.File(self.path, "r") as f:
                version = f.attrs.get("schema_version")
                fmt = f.attrs.get("format")
        except OSError as exc:  # the signature was right: a truncated or damaged file
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StoreSchemaError(f"store {self.path} is truncated or corrupt (HDF5: {reason})") from exc
        if fmt is not None and str(fmt) != FORMAT_NAME:
            raise StoreSchemaError(f"{self.path}: not a {FORMAT_NAME} file (format={fmt!r})")
        if version is None:
            raise StoreSchemaError(f"{self.path}: no 'schema_version' attribute; not a {FORMAT_NAME} file")
        if int(version) != SCHEMA_VERSION:
            found = SCHEMA_HISTORY.get(int(version), "unknown to this ScaleFold")
            raise StoreSchemaError(
                f"{self.path}: store schema version {int(version)} ({found}) is not supported by this "
                f"ScaleFold (expects version {SCHEMA_VERSION}: {SCHEMA_HISTORY[SCHEMA_VERSION]}); "
                "re-run `scalefold preprocess` (or `scalefold synth`) to rebuild it"
            )

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:  # picklable for spawned workers: no handle, no caches
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    # -- chain table
    def _load_index(self) -> None:
        f = self._file()
        self._chain_ids = list(f["chains/chain_id"].asstr()[:])
        self._index = {c: i for i, c in enumerate(self._chain_ids)}
        self._offsets = {
            key: f[f"chains/{key}"][:] for key in ("residue_offset", "msa_offset", "template_offset", "length")
        }

    @property
    def chain_ids(self) -> list[str]:
        """All chain ids (``"{pdb_id}_{author chain id}"``) in file order."""
        if self._chain_ids is None:
            self._load_index()
        return list(self._chain_ids)

    def __len__(self) -> int:
        return len(self.chain_ids)

    def __contains__(self, chain_id: str) -> bool:
        if self._index is None:
            self._load_index()
        return chain_id in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self.chain_ids)

    def chain_table(self, with_sequence: bool = False) -> dict[str, np.ndarray]:
        """Whole chain table as column arrays (for filters and samplers)."""
        f = self._file()
        columns = ["chain_id", "pdb_id", "release_date", "method"] + (["sequence"] if with_sequence else [])
        table = {c: np.asarray(f[f"chains/{c}"].asstr()[:], dtype=object) for c in columns}
        for c in ("resolution", "cluster_id", "length", "msa_depth"):
            table[c] = f[f"chains/{c}"][:]
        offsets = f["chains/template_offset"][:]
        table["num_templates"] = np.diff(offsets)
        return table

    @property
    def schema_version(self) -> int:
        return int(self._file().attrs["schema_version"])

    # -- one chain
    def get(self, chain_id: str) -> dict[str, Any]:
        """All stored data of one chain.

        Returns a dict with ``chain_id``, ``pdb_id``, ``sequence`` (str), ``aatype`` (int64 ``[N]``,
        ``restypes_with_x`` order), ``all_atom_positions`` (float32 ``[N,37,3]``), ``all_atom_mask``
        (float32 ``[N,37]``), ``resolution`` (float, NaN if none), ``release_date`` (str or None),
        ``cluster_id``, ``method``, and when present ``msa`` / ``deletion_matrix`` (int32
        ``[N_seq, N]``, HHblits ids), ``template_hits`` (list of :class:`TemplateHit`) and
        ``template_outcomes`` (list of :class:`~scalefold.data.templates.HitOutcome`, one per hit).
        """
        if self._index is None:
            self._load_index()
        try:
            i = self._index[chain_id]
        except KeyError:
            raise KeyError(f"chain {chain_id!r} not in store {self.path}") from None
        f = self._file()
        res = self._offsets["residue_offset"]
        r0, r1 = int(res[i]), int(res[i + 1])
        release_date = f["chains/release_date"].asstr()[i]
        out: dict[str, Any] = {
            "chain_id": chain_id,
            "pdb_id": f["chains/pdb_id"].asstr()[i],
            "sequence": f["chains/sequence"].asstr()[i],
            "aatype": f["residues/aatype"][r0:r1].astype(np.int64),
            "all_atom_positions": f["residues/all_atom_positions"][r0:r1],
            "all_atom_mask": f["residues/all_atom_mask"][r0:r1].astype(np.float32),
            "resolution": float(f["chains/resolution"][i]),
            "release_date": release_date or None,
            "cluster_id": int(f["chains/cluster_id"][i]),
            "method": f["chains/method"].asstr()[i],
        }
        num_res = r1 - r0
        m0, m1 = int(self._offsets["msa_offset"][i]), int(self._offsets["msa_offset"][i + 1])
        if m1 > m0:
            out["msa"] = f["msa/ids"][m0:m1].astype(np.int32).reshape(-1, num_res)
            out["deletion_matrix"] = f["msa/deletions"][m0:m1].astype(np.int32).reshape(-1, num_res)
        t0, t1 = int(self._offsets["template_offset"][i]), int(self._offsets["template_offset"][i + 1])
        if t1 > t0:
            out["template_hits"] = self._template_hits(t0, t1)
            out["template_outcomes"] = self._template_outcomes(t0, t1)
        return out

    def _template_outcomes(self, t0: int, t1: int) -> list[HitOutcome]:
        f = self._file()
        stages = f["templates/stage"][t0:t1]
        reasons = f["templates/reason"].asstr()[t0:t1]
        names = f["templates/domain_name"].asstr()[t0:t1]
        probs = f["templates/sum_probs"][t0:t1]
        rows = f["templates/residue_offset"][t0 : t1 + 1]
        p0, p1 = int(rows[0]), int(rows[-1])
        residues = f["template_residues"]
        query_index = residues["query_index"][p0:p1]
        letters = residues["residue"][p0:p1].tobytes().decode("ascii")
        positions = residues["all_atom_positions"][p0:p1]
        masks = residues["all_atom_mask"][p0:p1].astype(np.float32)
        outcomes = []
        for k in range(t1 - t0):
            stage = HIT_STAGES[int(stages[k])]
            template = None
            if stage == STAGE_OK:
                a, b = int(rows[k]) - p0, int(rows[k + 1]) - p0
                template = AlignedTemplate(
                    domain_name=str(names[k]),
                    sum_probs=float(probs[k]),
                    query_index=query_index[a:b],
                    residues=letters[a:b],
                    all_atom_positions=positions[a:b],
                    all_atom_mask=masks[a:b],
                )
            outcomes.append(HitOutcome(stage, float(probs[k]), str(reasons[k]), template))
        return outcomes

    def _template_hits(self, t0: int, t1: int) -> list[TemplateHit]:
        f = self._file()
        cols = f["templates/column_offset"][t0 : t1 + 1]
        iq = f["templates/indices_query"][cols[0] : cols[-1]]
        ih = f["templates/indices_hit"][cols[0] : cols[-1]]
        names = f["templates/name"].asstr()[t0:t1]
        queries = f["templates/query"].asstr()[t0:t1]
        hit_seqs = f["templates/hit_sequence"].asstr()[t0:t1]
        index = f["templates/index"][t0:t1]
        aligned = f["templates/aligned_cols"][t0:t1]
        probs = f["templates/sum_probs"][t0:t1]
        hits = []
        for k in range(t1 - t0):
            a, b = int(cols[k] - cols[0]), int(cols[k + 1] - cols[0])
            hits.append(
                TemplateHit(
                    index=int(index[k]),
                    name=str(names[k]),
                    aligned_cols=int(aligned[k]),
                    sum_probs=float(probs[k]),
                    query=str(queries[k]),
                    hit_sequence=str(hit_seqs[k]),
                    indices_query=iq[a:b].tolist(),
                    indices_hit=ih[a:b].tolist(),
                )
            )
        return hits


def is_missing_resolution(resolution: float) -> bool:
    """True for the store's "no resolution" marker (NaN)."""
    return resolution is None or math.isnan(resolution)


__all__ = ["Store", "StoreWriter", "StoreSchemaError", "StoreFileError", "check_store_file", "SCHEMA_VERSION", "is_missing_resolution"]
