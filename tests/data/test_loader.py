"""The data loaders: priority-queue (non-blocking) and in-order, with crash recovery."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from scalefold.data.loader import InOrderLoader, PriorityQueueLoader, Sampler
from scalefold.perf.loader_bench import SimulatedSample

FAST = 0.01  # seconds per ordinary sample


def _slow_start(worker_id: int) -> None:
    time.sleep(4.0)  # a worker start-up (imports, a loaded machine) longer than the sample timeout


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(i, 1000 + i) for i in range(n)]


def test_every_sample_delivered_exactly_once():
    """Each (index, seed) pair is built once and delivered once, with its own seed."""
    loader = PriorityQueueLoader(SimulatedSample(FAST, slow_fraction=0.3, slow_factor=3), _pairs(16), num_workers=2)
    got = [(pos, batch["index"], batch["seed"]) for pos, batch in loader]
    assert sorted(p for p, _, _ in got) == list(range(16))
    assert all(idx == pos and seed == 1000 + pos for pos, idx, seed in got)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_start_methods(context):
    """Workers work under fork and spawn (the sample function is pickled, nothing else shared)."""
    with PriorityQueueLoader(
        SimulatedSample(FAST, slow_fraction=0.0), _pairs(4), num_workers=2, mp_context=context
    ) as loader:
        assert sorted(p for p, _ in loader) == [0, 1, 2, 3]


def test_slow_sample_does_not_block(tmp_path):
    """A slow sample at position 0 is overtaken by later ready samples (best-effort order).

    Logical clock, not a wall-clock race: sample 0 finishes only once the loop has consumed three
    other batches (its release marker), so the outcome does not depend on the machine's load."""
    work = SimulatedSample(FAST, slow_fraction=0.0, hold=(0,), marker_dir=str(tmp_path))
    positions = []
    for position, _ in PriorityQueueLoader(work, _pairs(10), num_workers=2, prefetch_factor=4):
        positions.append(position)
        if len(positions) == 3:
            (tmp_path / "release-0").touch()
    assert sorted(positions) == list(range(10))
    assert positions[0] != 0 and positions.index(0) >= 3


def test_in_order_loader_blocks_on_slow_sample():
    """The reference in-order loader delivers strictly in order, so position 0 comes first."""
    work = SimulatedSample(FAST, slow_fraction=0.0, slow_factor=30, slow_indices=(0,))
    positions = [p for p, _ in InOrderLoader(work, _pairs(8), num_workers=2, prefetch_factor=2)]
    assert positions == list(range(8))


def test_deterministic_mode_is_strictly_ordered():
    """deterministic=True delivers in sampler order even when early samples are slow."""
    work = SimulatedSample(FAST, slow_fraction=0.0, slow_factor=20, slow_indices=(0, 3))
    loader = PriorityQueueLoader(work, _pairs(10), num_workers=2, deterministic=True)
    assert [p for p, _ in loader] == list(range(10))


def test_worker_crash_is_restarted_and_sample_retried(tmp_path):
    """A worker that dies mid-sample is replaced and the sample is built again, not lost."""
    work = SimulatedSample(FAST, slow_fraction=0.0, crash_once=(3,), marker_dir=str(tmp_path))
    loader = PriorityQueueLoader(work, _pairs(8), num_workers=2)
    positions = sorted(p for p, _ in loader)
    assert positions == list(range(8))
    assert loader.restarts == 1 and not loader.skipped
    assert (tmp_path / "crashed-3").exists()


def test_repeated_failure_is_skipped_with_reason(caplog):
    """A sample failing max_attempts times is skipped, recorded with its reason and logged."""
    work = SimulatedSample(FAST, slow_fraction=0.0, fail_always=(2,))
    loader = PriorityQueueLoader(work, _pairs(6), num_workers=2, max_attempts=2)
    with caplog.at_level(logging.WARNING, logger="scalefold.data.loader"):
        positions = sorted(p for p, _ in loader)
    assert positions == [0, 1, 3, 4, 5]
    [skip] = loader.skipped
    assert (skip.position, skip.index, skip.attempts) == (2, 2, 2)
    assert "injected failure" in skip.reason
    assert any("skipping sample at position 2" in r.getMessage() for r in caplog.records)


def test_deterministic_mode_skips_failed_position():
    """In strict order a skipped sample does not stall the positions after it."""
    work = SimulatedSample(FAST, slow_fraction=0.0, fail_always=(1,))
    loader = PriorityQueueLoader(work, _pairs(4), num_workers=2, max_attempts=1, deterministic=True)
    assert [p for p, _ in loader] == [0, 2, 3]


def test_sample_timeout_kills_and_retries(tmp_path):
    """A sample exceeding sample_timeout has its worker killed; after max_attempts it is skipped.

    The timeout counts from the moment the worker starts the sample (its "start" message), not from
    dispatch: worker start-up under load (forkserver, imports) does not eat into it. Sample 1 never
    finishes on its own (held, no release marker); the others take 10 ms against a 5 s timeout, a
    margin no loaded machine eats."""
    work = SimulatedSample(FAST, slow_fraction=0.0, hold=(1,), marker_dir=str(tmp_path))
    loader = PriorityQueueLoader(work, _pairs(4), num_workers=2, max_attempts=1, sample_timeout=5.0)
    assert sorted(p for p, _ in loader) == [0, 2, 3]
    [skip] = loader.skipped
    assert skip.position == 1 and "timed out after 5 s" in skip.reason and loader.restarts == 1


def test_sample_timeout_counts_from_the_start_of_the_sample_not_from_worker_start_up():
    """Worker start-up slower than sample_timeout (a loaded machine, heavy imports) does not time out
    the samples sent to it before it was ready: the clock starts with the worker's "start" message.
    (4 s start-up against a 3 s timeout; the 10 ms samples have 3 s from their start: load-proof.)"""
    work = SimulatedSample(FAST, slow_fraction=0.0)
    loader = PriorityQueueLoader(
        work, _pairs(4), num_workers=2, max_attempts=1, sample_timeout=3.0, worker_init=_slow_start
    )
    assert sorted(p for p, _ in loader) == [0, 1, 2, 3]
    assert not loader.skipped and loader.restarts == 0


def test_clean_shutdown_when_leaving_early():
    """Breaking out of the loop inside ``with`` stops and reaps every worker process."""
    work = SimulatedSample(FAST, slow_fraction=0.0)
    with PriorityQueueLoader(work, _pairs(50), num_workers=2) as loader:
        for step, _ in enumerate(loader):
            pids = loader.worker_pids
            if step == 2:
                break
    assert loader.worker_pids == [] and len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_broadcast_hook_applied():
    """The broadcast hook sees (and may replace) every batch before the training loop."""
    seen = []

    def hook(batch):
        seen.append(batch["index"])
        return {**batch, "broadcast": True}

    loader = PriorityQueueLoader(SimulatedSample(FAST, slow_fraction=0.0), _pairs(3), num_workers=1, broadcast=hook)
    assert all(b["broadcast"] for _, b in loader) and sorted(seen) == [0, 1, 2]


def test_sampler_matches_reference_semantics():
    """Indices: torch.multinomial with replacement; seeds: torch.randint(0, 2**63-1); same seed for
    both generators; rank::world_size sharding; ``start`` skips consumed pairs."""
    weights = [0.5, 1.0, 2.0, 0.25]
    sampler = Sampler(weights, num_samples=12, seed=7, rank=1, world_size=2, start=1)
    idx = torch.multinomial(
        torch.tensor(weights, dtype=torch.float64), 12, True, generator=torch.Generator().manual_seed(7)
    )
    seeds = torch.randint(0, 2**63 - 1, [12], generator=torch.Generator().manual_seed(7))
    expected = list(zip(idx.tolist(), seeds.tolist()))[1::2][1:]
    assert list(sampler) == expected and len(sampler) == 5


def test_make_loader_by_name():
    """--loader names map to the loader classes; an unknown name is a clear error."""
    from scalefold.data.loader import LOADERS, make_loader

    work = SimulatedSample(FAST, slow_fraction=0.0)
    assert isinstance(make_loader("pq", work, _pairs(2), deterministic=False), PriorityQueueLoader)
    in_order = make_loader("inorder", work, _pairs(3), num_workers=1, deterministic=False)
    assert isinstance(in_order, InOrderLoader) and [p for p, _ in in_order] == [0, 1, 2]
    assert LOADERS == ("pq", "inorder")  # DALI was measured slower: bench/dali_loader.py
    for name in ("torch", "dali"):
        with pytest.raises(ValueError, match=f"unknown loader '{name}'.*pq, inorder"):
            make_loader(name, work, _pairs(1))


def test_bench_loader_cli_prints_json_last(tmp_path):
    """``scalefold bench loader --json`` (the interface other parts rely on): a table, then one
    JSON line last with ``wait_ratio`` = pq wait / in-order wait and ``wait_fraction`` = pq wait /
    pq loop time, consistent with the per-loader numbers; ``--plot`` writes a PNG."""
    import json
    import subprocess
    import sys

    plot = tmp_path / "stall.png"
    cmd = [sys.executable, "-m", "scalefold", "bench", "loader", "--json", "--plot", str(plot), "--steps", "12",
           "--step-ms", "10", "--prep-ms", "5", "--workers", "2", "--prefetch", "2", "--mp-context", "fork"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("loader stall: 12 steps")
    result = json.loads(lines[-1])
    assert result["wait_ratio"] == pytest.approx(result["pq_wait_s"] / result["in_order_wait_s"])
    assert result["wait_fraction"] == pytest.approx(result["pq_wait_s"] / result["pq_loop_s"])
    assert result["pq_loop_s"] >= 12 * 0.010 and result["extra_loaders"] == []
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _tensor_sample(index: int, seed: int) -> dict:
    if index == 3:
        raise ValueError("sample 3 is broken (injected failure)")
    return {"x": torch.arange(4, dtype=torch.float32) + index, "seed": torch.tensor(seed), "mask": torch.ones(2, 5)}


def _group_worker(rank: int, world: int, out_dir: str) -> None:
    import json

    from scalefold.data.loader import group_batches

    loader = None
    if rank == 0:
        loader = PriorityQueueLoader(_tensor_sample, _pairs(6), num_workers=2, deterministic=True, mp_context="fork")
    got = [
        (position, batch["x"].tolist(), int(batch["seed"]), list(batch["mask"].shape), str(batch["x"].dtype))
        for position, batch in group_batches(loader, src=0)
    ]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


@pytest.mark.distributed
def test_group_batches_one_loader_per_dap_group(tmp_path):
    """Two gloo ranks as one DAP group: only rank 0 runs a loader; both ranks get the same
    (position, batch) sequence -- names, shapes, dtypes, values; a skipped sample is skipped on
    both -- and both stop together at the end of the data."""
    import json

    from scalefold.distributed.launch import run_processes

    run_processes(_group_worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = [[p, [float(p + k) for k in range(4)], 1000 + p, [2, 5], "torch.float32"] for p in range(6) if p != 3]
    assert ranks[0] == ranks[1] == expected


def _replace_with_clean(position: int, k: int, failed: frozenset) -> tuple[int, int]:
    assert failed == frozenset({2})  # the hook learns which indices failed
    return 100 + position, 5000 + k


@pytest.mark.parametrize("deterministic", [False, True])
def test_failed_sample_is_replaced_and_the_position_still_delivered(caplog, deterministic):
    """With a ``replace`` hook a skipped sample's position gets the hook's (index, seed): every
    position is delivered (the step count of a run does not change), the skip is recorded with its
    reason and replacement, and logged."""
    work = SimulatedSample(FAST, slow_fraction=0.0, fail_always=(2,))
    loader = PriorityQueueLoader(
        work, _pairs(5), num_workers=2, max_attempts=2, deterministic=deterministic, replace=_replace_with_clean
    )
    with caplog.at_level(logging.WARNING, logger="scalefold.data.loader"):
        got = {pos: (batch["index"], batch["seed"]) for pos, batch in loader}
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert got[2] == (102, 5001) and all(got[p] == (p, 1000 + p) for p in (0, 1, 3, 4))
    [skip] = loader.skipped
    assert (skip.position, skip.index, skip.attempts, skip.replaced_by) == (2, 2, 2, (102, 5001))
    assert "injected failure" in skip.reason
    messages = [r.getMessage() for r in caplog.records]
    assert any("skipping sample at position 2" in m for m in messages)
    assert any("replacement 1/" in m and "index 102" in m for m in messages)


def _replace_with_broken(position: int, k: int, failed: frozenset) -> tuple[int, int]:
    return 2, k  # index 2 always fails


def test_replacements_failing_too_stop_the_loader_with_an_error():
    """A position whose ``max_replacements`` replacements all fail ends the iteration with an error
    (no silent short epoch, no hang)."""
    work = SimulatedSample(FAST, slow_fraction=0.0, fail_always=(2,))
    loader = PriorityQueueLoader(
        work, _pairs(4), num_workers=1, max_attempts=1, replace=_replace_with_broken, max_replacements=2
    )
    with pytest.raises(RuntimeError, match="data loader failed") as info:
        list(loader)
    assert "2 replacement samples failed as well" in str(info.value.__cause__)
    assert len(loader.skipped) == 3 and loader.worker_pids == []


def _failing_group_worker(rank: int, world: int, out_dir: str) -> None:
    from scalefold.data.loader import DataLoaderFailed, group_batches

    loader = None
    if rank == 0:
        loader = PriorityQueueLoader(
            _tensor_sample, _pairs(6), num_workers=1, deterministic=True, mp_context="fork", max_attempts=1,
            replace=_replace_with_three, max_replacements=1,
        )  # fmt: skip
    got, error = [], None
    try:
        for position, _ in group_batches(loader, src=0, with_batch=False):
            got.append(position)
    except (DataLoaderFailed, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{got}\n{error}\n")


def _replace_with_three(position: int, k: int, failed: frozenset) -> tuple[int, int]:
    return 3, 0  # the broken index again


@pytest.mark.distributed
def test_group_batches_tells_receivers_when_the_loader_fails(tmp_path):
    """The loader rank's loader fails (position 3 cannot be built or replaced): both ranks stop at the
    same batch and the receiver raises DataLoaderFailed naming the error instead of waiting forever."""
    from scalefold.distributed.launch import run_processes

    run_processes(_failing_group_worker, 2, str(tmp_path))
    src, receiver = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    # the error surfaces as soon as the loader fails (batches still queued may be dropped): same prefix on both
    assert src[0] == receiver[0] and src[0] in ("[]", "[0]", "[0, 1]", "[0, 1, 2]")
    assert src[1].startswith("RuntimeError: data loader failed")
    assert receiver[1].startswith("DataLoaderFailed: the data loader of this rank's group failed on rank 0")
    assert "replacement samples failed as well" in receiver[1]
