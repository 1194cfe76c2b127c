"""The DALI loader of ``bench/dali_loader.py`` (benchmark-only: measured slower, not part of
ScaleFold) builds the same batches as the native loaders, so its timing is a fair comparison.
Skipped without DALI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from scalefold.data.dataset import StoreSample
from scalefold.data.loader import InOrderLoader
from scalefold.data.pipeline import FeatureConfig
from scalefold.perf.loader_bench import SimulatedSample

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: shadows nothing
from dali_loader import DaliLoader, dali_available  # noqa: E402

AVAILABLE, DETAIL = dali_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=DETAIL)


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(i, 1000 + i) for i in range(n)]


def test_delivers_every_sample_in_order_and_skips_failures():
    """Every pair comes back once, in sampler order, with its own seed; a sample that always
    raises is retried, then skipped and recorded (as with the native loaders)."""
    work = SimulatedSample(0.005, slow_fraction=0.0, fail_always=(3,), payload_bytes=4)
    loader = DaliLoader(work, _pairs(8), num_workers=2, prefetch_factor=2, mp_context="fork", max_attempts=2)
    got = [(position, int(batch["index"]), int(batch["seed"]), batch["payload"].shape) for position, batch in loader]
    assert got == [(p, p, 1000 + p, (4,)) for p in range(8) if p != 3]
    assert [(s.position, s.index, s.seed, s.attempts) for s in loader.skipped] == [(3, 3, 1003, 2)]


def test_store_batches_equal_native_loader(tmp_path):
    """Training batches from a store through DALI (spawned workers) equal the in-order loader's,
    key by key, shape, dtype and value."""
    from scalefold.data.synthetic import synthesize

    store = tmp_path / "synth.h5"
    synthesize(store, num_chains=3, num_families=1, length_range=(20, 28))
    from scalefold.data.store import Store

    with Store.open(store) as s:
        chain_ids = s.chain_ids
    sample = StoreSample(str(store), chain_ids, FeatureConfig.tiny())
    pairs = [(i % len(chain_ids), 7 + i) for i in range(4)]
    native = dict(InOrderLoader(sample, pairs, num_workers=1, mp_context="fork"))
    dali = dict(DaliLoader(sample, pairs, num_workers=2, mp_context="spawn"))
    assert sorted(dali) == sorted(native) == list(range(4))
    for position, batch in dali.items():
        expected = native[position]
        assert set(batch) == set(expected)
        for key, value in expected.items():
            assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key


def test_unsupported_options_are_refused():
    """Options DALI cannot honour fail loudly instead of being ignored."""
    work = SimulatedSample(0.0)
    with pytest.raises(ValueError, match="timeout"):
        DaliLoader(work, _pairs(2), sample_timeout=1.0)
    with pytest.raises(ValueError, match="worker_init"):
        DaliLoader(work, _pairs(2), worker_init=print)
