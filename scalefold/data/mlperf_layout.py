"""The MLPerf HPC OpenFold "processed" dataset: read it directly, or convert it to a store.

Layout (the MLPerf reference's ``scripts/preprocess_*.py`` output)::

    pdb_mmcif/processed/chains.csv      pdb_chain_id, pdb_id, author_chain_id, mmcif_chain_ids,
                                        release_date, resolution, pdb_cluster_id, sequence_length, sequence
    pdb_mmcif/processed/dicts/<pdb_id[1:3]>
                                        pickle: {pdb_id: {"sequences": {author: str},
                                        "atoms": {author: {"all_atom_positions": (zlib bytes, shape),
                                        "all_atom_mask": (zlib bytes, shape)}}, "release_date", "resolution", ...}}
    open_protein_set/processed/pdb_alignments/{k}.db + super.index
                                        super.index (JSON): chain → {"db": "k.db", "files": [[name, start, size]]};
                                        the .db shards are the files concatenated byte for byte.

**Security:** the ``dicts/`` shards are Python pickles. Unpickling a file can execute arbitrary
code, so reading them needs an explicit ``allow_pickle=True`` (CLI ``--allow-pickle``) and should only
be done for files from a source you trust. Even then a restricted unpickler is used that only
rebuilds plain containers (dict/list/tuple/str/bytes/numbers); ``chains.csv`` and the alignment
databases need no unpickling.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import pickle
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import numpy as np

from scalefold import residue_constants as rc
from scalefold.data.parsers.hhr import parse_hhr
from scalefold.data.parsers.mmcif import MmcifChain, MmcifEntry
from scalefold.data.parsers.msa import merge_msas, parse_a3m, validate_msa
from scalefold.data.pickle_policy import PICKLE_RISK
from scalefold.data.templates import TemplateHitFeaturizer, template_cutoff
from scalefold.errors import UserError

PathLike = Union[str, os.PathLike]

CHAINS_CSV = "pdb_mmcif/processed/chains.csv"
DICTS_DIR = "pdb_mmcif/processed/dicts"
ALIGNMENTS_DIR = "open_protein_set/processed/pdb_alignments"
SUPER_INDEX = "super.index"
# MSA files of a chain in the reference's dedup order, and its template hits file.
A3M_FILES = ("uniref90_hits.a3m", "bfd_uniclust_hits.a3m", "mgnify_hits.a3m")
HHR_FILE = "pdb70_hits.hhr"



class PickleNotAllowedError(UserError, PermissionError):
    """Raised when a pickle shard would be read without the explicit opt-in."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global: only built-in containers and scalars can be rebuilt."""

    _ALLOWED = {("collections", "OrderedDict"), ("collections", "defaultdict"), ("builtins", "bytearray")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from an MLPerf dicts shard")


def _decompress(blob: tuple, dtype) -> np.ndarray:
    data, shape = blob
    return np.frombuffer(zlib.decompress(data), dtype=dtype).reshape(shape).copy()


class MlperfLayout:
    """Reader for the processed MLPerf layout rooted at ``root`` (the directory holding
    ``pdb_mmcif/`` and ``open_protein_set/``).

    ``chain_ids``/``chains`` come from ``chains.csv``; :meth:`alignments` from the ``.db`` shards;
    :meth:`get` returns the same dict as :meth:`scalefold.data.store.Store.get` (needs
    ``allow_pickle=True`` for the coordinates).
    """

    def __init__(self, root: PathLike, allow_pickle: bool = False) -> None:
        self.root = Path(root)
        self.allow_pickle = allow_pickle
        csv_path = self.root / CHAINS_CSV
        if not csv_path.is_file():
            raise FileNotFoundError(f"not an MLPerf processed layout: {csv_path} missing")
        self._chains = self._read_chains(csv_path)
        self._index = {row["pdb_chain_id"]: row for row in self._chains}
        self._super_index: dict[str, dict] | None = None
        self._shard_cache: dict[str, dict] = {}

    # -- chain table
    @staticmethod
    def _read_chains(path: Path) -> list[dict[str, Any]]:
        rows = []
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                row["resolution"] = float(row["resolution"]) if row.get("resolution") else float("nan")
                row["pdb_cluster_id"] = int(row["pdb_cluster_id"]) if row.get("pdb_cluster_id") else -1
                row["sequence_length"] = int(row["sequence_length"])
                rows.append(row)
        return rows

    @property
    def chain_ids(self) -> list[str]:
        return [row["pdb_chain_id"] for row in self._chains]

    def chains(self) -> Iterator[dict[str, Any]]:
        """Rows of ``chains.csv`` (resolution float/NaN, cluster id int/-1)."""
        return iter(self._chains)

    # -- alignments
    def _alignments_dir(self) -> Path:
        return self.root / ALIGNMENTS_DIR

    def alignments(self, chain_id: str) -> dict[str, str]:
        """``{file name: text}`` of one chain's alignments (empty when the chain has none)."""
        if self._super_index is None:
            path = self._alignments_dir() / SUPER_INDEX
            self._super_index = json.loads(path.read_text()) if path.is_file() else {}
        entry = self._super_index.get(chain_id)
        if entry is None:
            return {}
        out = {}
        with open(self._alignments_dir() / entry["db"], "rb") as f:
            for name, start, size in entry["files"]:
                f.seek(start)
                out[name] = f.read(size).decode("utf-8")
        return out

    # -- structures (pickles)
    def _shard(self, pdb_id: str) -> dict:
        if not self.allow_pickle:
            raise PickleNotAllowedError(f"refusing to read {self.root / DICTS_DIR / pdb_id[1:3]}: {PICKLE_RISK}")
        name = pdb_id[1:3]
        if name not in self._shard_cache:
            data = (self.root / DICTS_DIR / name).read_bytes()
            self._shard_cache = {name: _PlainDataUnpickler(io.BytesIO(data)).load()}  # keep one shard
        return self._shard_cache[name]

    def entry(self, pdb_id: str) -> dict:
        """The reference's per-entry dict with decompressed atoms (needs ``allow_pickle``)."""
        raw = self._shard(pdb_id)[pdb_id]
        atoms = {
            chain: {
                "all_atom_positions": _decompress(arrays["all_atom_positions"], np.float32),
                "all_atom_mask": _decompress(arrays["all_atom_mask"], bool),
            }
            for chain, arrays in raw["atoms"].items()
        }
        return {**raw, "atoms": atoms}

    def mmcif_entry(self, pdb_id: str) -> MmcifEntry:
        """One entry as an :class:`MmcifEntry` (template structures; needs ``allow_pickle``).

        Raises ``FileNotFoundError`` when the entry is not in the layout.
        """
        try:
            raw = self.entry(pdb_id)
        except (KeyError, FileNotFoundError) as exc:
            raise FileNotFoundError(f"{pdb_id} not in {self.root / DICTS_DIR}") from exc
        chains = {
            author: MmcifChain(
                author_chain_id=author,
                mmcif_chain_id="",
                entity_id="",
                sequence=sequence,
                residue_names=(),
                all_atom_positions=raw["atoms"][author]["all_atom_positions"].astype(np.float32),
                all_atom_mask=raw["atoms"][author]["all_atom_mask"].astype(np.float32),
                author_residue_ids=(),
            )
            for author, sequence in raw["sequences"].items()
            if author in raw["atoms"]
        }
        release_date = raw.get("release_date")
        return MmcifEntry(
            pdb_id=pdb_id,
            path=None,
            exptl_method=str(raw.get("exptl_method", "")),
            release_date=str(release_date)[:10] if release_date else None,
            resolution=float("nan"),
            chains=chains,
        )

    def template_featurizer(self, max_hits: int, kalign_binary_path: str | None = None) -> TemplateHitFeaturizer:
        """The reference's featurizer over this layout: templates are chains of ``chains.csv``
        (``template_pdb_chain_ids``), their release dates the prefilter's dates."""
        release_dates = {row["pdb_id"]: row["release_date"] for row in self._chains if row.get("release_date")}
        return TemplateHitFeaturizer(
            None,
            "9999-12-31",
            max_hits=max_hits,
            release_dates=release_dates,
            allowed_chain_ids=set(self.chain_ids),
            kalign_binary_path=kalign_binary_path,
            load_structure=functools.lru_cache(maxsize=64)(self.mmcif_entry),
        )

    def get(self, chain_id: str) -> dict[str, Any]:
        """Same keys as ``Store.get``: structure from ``dicts/``, MSA/templates from the alignment db."""
        row = self._index[chain_id]
        entry = self.entry(row["pdb_id"])
        author = row["author_chain_id"]
        sequence = entry["sequences"][author]
        atoms = entry["atoms"][author]
        out: dict[str, Any] = {
            "chain_id": chain_id,
            "pdb_id": row["pdb_id"],
            "sequence": sequence,
            "aatype": np.array([rc.restype_order.get(c, rc.restype_num) for c in sequence], dtype=np.int64),
            "all_atom_positions": atoms["all_atom_positions"].astype(np.float32),
            "all_atom_mask": atoms["all_atom_mask"].astype(np.float32),
            "resolution": row["resolution"],
            "release_date": row["release_date"] or None,
            "cluster_id": row["pdb_cluster_id"],
            "method": entry.get("exptl_method", ""),
        }
        alignments = self.alignments(chain_id)
        msas = [parse_a3m(alignments[name]) for name in A3M_FILES if alignments.get(name)]
        if msas:
            for name, msa in zip([n for n in A3M_FILES if alignments.get(n)], msas):
                validate_msa(msa, sequence, path=f"{chain_id}/{name}")
            ids, deletions = merge_msas(msas).to_arrays(np.int16)
            out["msa"], out["deletion_matrix"] = ids.astype(np.int32), deletions.astype(np.int32)
        if alignments.get(HHR_FILE):
            out["template_hits"] = parse_hhr(alignments[HHR_FILE], path=f"{chain_id}/{HHR_FILE}")
        return out


def convert_to_store(
    root: PathLike, out: PathLike, allow_pickle: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Write every chain of an MLPerf layout into a store; returns a report (also ``<out>.report.json``).

    Chains that fail (bad MSA, missing entry) are skipped and counted per reason, as in ``preprocess``.
    """
    from tqdm import tqdm

    from scalefold.data.preprocess import build_report, report_path
    from scalefold.data.store import Store

    if not allow_pickle:
        raise PickleNotAllowedError(f"converting {root} needs the structure pickles: {PICKLE_RISK}")
    layout = MlperfLayout(root, allow_pickle=allow_pickle)
    featurizer = layout.template_featurizer(max_hits=1 << 30)  # every hit assessed; 4 picked per sample
    start = time.perf_counter()
    skipped, written = [], 0
    ids = sorted(layout.chain_ids, key=lambda c: (c[1:3], c))  # shard order: each pickle read once
    with Store.create(out) as writer:
        for chain_id in tqdm(ids, desc="convert", unit="chain", disable=not progress):
            try:
                d = layout.get(chain_id)
                outcomes = None
                if d.get("template_hits"):
                    cutoff = template_cutoff(d["release_date"]) if d["release_date"] else None
                    outcomes = featurizer.assess_hits(
                        d["sequence"], d["template_hits"], query_pdb_id=d["pdb_id"], max_template_date=cutoff
                    )
            except Exception as exc:  # noqa: BLE001 - report and go on
                reason = getattr(exc, "reason", type(exc).__name__)
                skipped.append({"file": str(root), "chain": chain_id, "reason": reason, "message": str(exc)})
                continue
            resolution = d["resolution"]
            writer.add_chain(
                chain_id,
                pdb_id=d["pdb_id"],
                sequence=d["sequence"],
                all_atom_positions=d["all_atom_positions"],
                all_atom_mask=d["all_atom_mask"],
                release_date=d["release_date"],
                resolution=None if math.isnan(resolution) else resolution,
                cluster_id=d["cluster_id"],
                method=d["method"],
                msa=d.get("msa"),
                deletion_matrix=d.get("deletion_matrix"),
                template_hits=d.get("template_hits", ()),
                template_outcomes=outcomes,
            )
            written += 1
    report = build_report(Path(out), [str(root)], written, skipped, workers=1, elapsed=time.perf_counter() - start)
    report_path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


__all__ = ["MlperfLayout", "convert_to_store", "PickleNotAllowedError", "PICKLE_RISK"]
