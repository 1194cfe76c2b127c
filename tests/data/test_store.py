"""The HDF5 dataset store: round trip, schema versioning, lazy per-process opening."""

from __future__ import annotations

import math
import multiprocessing
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest

from scalefold.data.parsers.hhr import TemplateHit
from scalefold.data.store import SCHEMA_VERSION, Store, StoreSchemaError


def _chain(rng: np.random.Generator, n: int, depth: int) -> dict:
    mask = (rng.random((n, 37)) < 0.4).astype(np.float32)
    return {
        "sequence": "".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWYX"), n)),
        "all_atom_positions": (rng.normal(size=(n, 37, 3)) * mask[..., None]).astype(np.float32),
        "all_atom_mask": mask,
        "msa": rng.integers(0, 22, (depth, n)) if depth else None,
        "deletion_matrix": rng.integers(0, 400, (depth, n)) if depth else None,
    }


HIT = TemplateHit(
    index=3,
    name="1ABC_A something",
    aligned_cols=3,
    sum_probs=2.5,
    query="AC-D",
    hit_sequence="A-GD",
    indices_query=[1, 2, -1, 3],
    indices_hit=[4, -1, 5, 6],
)


@pytest.fixture()
def store_and_chains(tmp_path: Path):
    rng = np.random.default_rng(0)
    chains = {"1abc_A": _chain(rng, 7, 3), "1abc_B": _chain(rng, 5, 0), "2xyz_Q": _chain(rng, 11, 1)}
    path = tmp_path / "s.h5"
    with Store.create(path, flush_every=2) as writer:  # exercise several flushes
        writer.add_chain(
            "1abc_A",
            **chains["1abc_A"],
            release_date="2001-02-03",
            resolution=2.0,
            cluster_id=7,
            method="X-RAY DIFFRACTION",
            template_hits=[HIT, HIT],
        )
        writer.add_chain("1abc_B", **chains["1abc_B"], release_date=None, resolution=None)
        writer.add_chain("2xyz_Q", **chains["2xyz_Q"], template_hits=[HIT])
    return path, chains


def test_round_trip(store_and_chains) -> None:
    """Everything written comes back: arrays, metadata, MSA (int8 ids, deletions), template hit records."""
    path, chains = store_and_chains
    with Store.open(path) as s:
        assert s.chain_ids == ["1abc_A", "1abc_B", "2xyz_Q"] and len(s) == 3 and "2xyz_Q" in s
        for chain_id, expected in chains.items():
            got = s.get(chain_id)
            assert got["sequence"] == expected["sequence"]
            assert got["aatype"].dtype == np.int64 and got["aatype"].shape == (len(expected["sequence"]),)
            np.testing.assert_array_equal(got["all_atom_positions"], expected["all_atom_positions"])
            np.testing.assert_array_equal(got["all_atom_mask"], expected["all_atom_mask"])
            assert got["all_atom_positions"].dtype == np.float32 and got["all_atom_mask"].dtype == np.float32
            if expected["msa"] is None:
                assert "msa" not in got and "deletion_matrix" not in got
            else:
                np.testing.assert_array_equal(got["msa"], expected["msa"])
                np.testing.assert_array_equal(got["deletion_matrix"], expected["deletion_matrix"])
        a = s.get("1abc_A")
        assert (a["release_date"], a["resolution"], a["cluster_id"], a["method"], a["pdb_id"]) == (
            "2001-02-03",
            2.0,
            7,
            "X-RAY DIFFRACTION",
            "1abc",
        )
        assert a["template_hits"] == [HIT, HIT]
        b = s.get("1abc_B")
        assert b["release_date"] is None and math.isnan(b["resolution"]) and b["cluster_id"] == -1
        assert "template_hits" not in b
        table = s.chain_table()
        assert table["length"].tolist() == [7, 5, 11] and table["num_templates"].tolist() == [2, 0, 1]
        with pytest.raises(KeyError, match="9zzz_A"):
            s.get("9zzz_A")


def test_aatype_uses_restype_order_with_unknown_as_x(tmp_path: Path) -> None:
    """aatype follows restypes order (A=0, R=1, …) and maps X / non-standard letters to 20."""
    path = tmp_path / "a.h5"
    with Store.create(path) as w:
        w.add_chain("1aaa_A", sequence="ARXV", all_atom_positions=np.zeros((4, 37, 3)), all_atom_mask=np.zeros((4, 37)))
    with Store.open(path) as s:
        assert s.get("1aaa_A")["aatype"].tolist() == [0, 1, 20, 19]


def test_other_schema_version_is_refused(store_and_chains) -> None:
    """A store stamped with another schema version → StoreSchemaError naming the file and both versions."""
    path, _ = store_and_chains
    with h5py.File(path, "a") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(StoreSchemaError) as info:
        Store.open(path)
    message = str(info.value)
    assert str(path) in message and str(SCHEMA_VERSION + 1) in message and str(SCHEMA_VERSION) in message


def test_non_store_files_are_refused(tmp_path: Path) -> None:
    """A plain HDF5 file or a non-HDF5 file is not accepted as a store."""
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(StoreSchemaError, match="schema_version"):
        Store.open(plain)
    text = tmp_path / "text.h5"
    text.write_text("hello")
    with pytest.raises(StoreSchemaError):
        Store.open(text)


def test_failed_write_leaves_no_store(tmp_path: Path) -> None:
    """An exception inside the writer context leaves neither the store nor the partial file behind."""
    path = tmp_path / "x.h5"
    with pytest.raises(ValueError):
        with Store.create(path) as w:
            w.add_chain(
                "1aaa_A", sequence="AR", all_atom_positions=np.zeros((3, 37, 3)), all_atom_mask=np.zeros((3, 37))
            )
    assert not path.exists() and not list(tmp_path.iterdir())


def _read_in_child(store: Store, queue) -> None:
    queue.put(store.get("2xyz_Q")["sequence"])


def test_store_is_usable_after_fork_and_picklable(store_and_chains) -> None:
    """A store opened (and read) in the parent can be used in forked children and survives pickling."""
    path, chains = store_and_chains
    store = Store.open(path)
    store.get("1abc_A")  # parent holds an open handle now
    if "fork" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=_read_in_child, args=(store, queue))
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0 and queue.get(timeout=5) == chains["2xyz_Q"]["sequence"]
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get("1abc_B")["sequence"] == chains["1abc_B"]["sequence"]
    assert store.get("1abc_A")["sequence"] == chains["1abc_A"]["sequence"]  # parent handle still fine
    store.close()
    clone.close()
