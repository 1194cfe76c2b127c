"""End to end: a corrupt chain in the store does not cost a step, hang a DAP group or split the ranks.

One chain of a tiny synthetic store gets an out-of-range MSA (HHblits ids beyond the alphabet), so
building its features fails; it is the chain the sampler draws for step 1. ``scalefold train --preset
tiny`` then runs single-rank and as one ``--dap 2`` group (2 gloo processes, one loader broadcasting
to the other rank): the loader gives the sample up (logged with the chain id and the reason, counted
in ``metrics.jsonl`` and the step-time summary), replaces it with a fresh draw, and every rank takes
all ``STEPS`` steps -- the same replacement in both runs, so the losses agree too. A two-rank
data-parallel run whose corrupt chain is rank 1's sample of step 2 also keeps both ranks in step.
Each run has a wall-clock limit: a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from scalefold.config.training import TrainConfig
from scalefold.data.dataset import StoreSample
from scalefold.data.pipeline import FeatureConfig
from scalefold.data.store import Store
from scalefold.data.synthetic import synthesize
from scalefold.distributed.launch import free_port
from scalefold.model.factory import build_model_config
from scalefold.train.training_data import sample_pairs, split_chains

STEPS = 3
RUN_TIMEOUT_S = 240  # a run takes well under a minute; past this it is hung
ARGS = ("--preset", "tiny", "--max-steps", str(STEPS), "--eval-every", "0", "--checkpoint-every", "0",
        "--precision", "fp64", "--deterministic", "--num-workers", "1")  # fmt: skip
FINISHED = re.compile(r"scalefold train: rank (\d+) finished at step (\d+) \((\d+) sample\(s\) skipped")


def _run(cmd: list[str], cwd: Path) -> tuple[int, str, str]:
    """``cmd`` in its own session, killed with everything it started when it exceeds the limit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks (and their loader workers)
        stdout, stderr = proc.communicate()
        pytest.fail(f"run hung (> {RUN_TIMEOUT_S} s): {' '.join(cmd)}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return proc.returncode, stdout, stderr


def _train(root: Path, name: str, nproc: int, *extra: str) -> tuple[str, str]:
    launch = [sys.executable, "-m", "scalefold"]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                  "--master-port", str(free_port()), "-m", "scalefold"]  # fmt: skip
    cmd = [*launch, "train", *ARGS, "--out", str(root / name), "--store", str(root / "store.h5"), *extra]
    rc, stdout, stderr = _run(cmd, root)
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    return stdout, stderr


def _make_store(root: Path, world_size: int, bad_rank: int, bad_step: int) -> tuple[str, dict[int, int]]:
    """A tiny synthetic store in ``root`` whose chain drawn by data-parallel rank ``bad_rank`` for step
    ``bad_step`` is corrupt. Returns (that chain's id, {rank: samples of the run that draw it})."""
    store_path = root / "store.h5"
    cfg = TrainConfig.from_preset("tiny", overrides={"out": str(root / "x"), "store": str(store_path)}, env={})
    synthesize(store_path, num_chains=cfg.synth_num_chains, num_families=cfg.synth_num_families,
               length_range=tuple(cfg.synth_length_range), seed=cfg.synth_seed)  # fmt: skip
    with Store.open(store_path) as store:
        train_ids, weights, _ = split_chains(store, cfg)
        pairs = {r: sample_pairs(weights, cfg.seed, 0, STEPS, rank=r, world_size=world_size) for r in range(world_size)}
        bad_index, bad_seed = pairs[bad_rank][bad_step - 1]
        bad_chain = train_ids[bad_index]
        row = store.chain_ids.index(bad_chain)
    with h5py.File(store_path, "r+") as f:  # corrupt the chain's MSA: ids beyond the HHblits alphabet
        lo, hi = (int(x) for x in f["chains/msa_offset"][row : row + 2])
        ids = f["msa/ids"][lo:hi]
        ids[:] = 120
        f["msa/ids"][lo:hi] = ids
    features = FeatureConfig.from_reference_config(build_model_config(cfg).to_dict())
    with pytest.raises(IndexError):  # the corruption does break feature building
        StoreSample(str(store_path), train_ids, features)(bad_index, bad_seed)
    return bad_chain, {r: sum(index == bad_index for index, _ in p) for r, p in pairs.items()}


@pytest.fixture(scope="module")
def corrupt_store(tmp_path_factory) -> tuple[Path, str, int]:
    """(run root holding ``store.h5``, the corrupt chain's id, how many of the run's samples draw it):
    the chain of step 1 of one data-parallel rank (single-rank and dap 2 runs alike)."""
    root = tmp_path_factory.mktemp("bad_samples")
    bad_chain, skips = _make_store(root, world_size=1, bad_rank=0, bad_step=1)
    return root, bad_chain, skips[0]


def _step_records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _check_run(stdout: str, stderr: str, out: Path, ranks: int, bad_chain: str, skips: dict[int, int]) -> list[dict]:
    """Every rank finished all STEPS steps; rank r's loader skipped ``skips.get(r, 0)`` samples (the
    corrupt chain), each logged with chain id and reason and replaced; metrics.jsonl (the main rank:
    rank 0's loader) has STEPS step records, counts the skips of all ranks and lists rank 0's."""
    finished = {int(r): (int(s), int(n)) for r, s, n in FINISHED.findall(stdout)}
    assert sorted(finished) == list(range(ranks)), stdout[-3000:] + stderr[-3000:]
    assert {s for s, _ in finished.values()} == {STEPS}, finished  # every rank took every step
    assert {r: n for r, (_, n) in finished.items()} == {r: skips.get(r, 0) for r in range(ranks)}
    # the skip: logged with the chain id and the reason, counted in metrics.jsonl and the summary
    skip_lines = [ln for ln in stdout.splitlines() if f"skipped sample {bad_chain} " in ln]
    assert len(skip_lines) == sum(skips.values()) > 0, stdout[-3000:]
    assert all("IndexError" in ln and "replaced by " in ln for ln in skip_lines), skip_lines
    assert "skipping sample at position" in stderr and "IndexError" in stderr  # the loader's own log
    records = _step_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["samples_skipped"] == sum(skips.values())  # summed over ranks each step
    logged = [s for r in records for s in r.get("skipped_samples", [])]
    assert [s["chain_id"] for s in logged] == [bad_chain] * skips.get(0, 0)
    assert all(s["reason"].startswith("IndexError") and s["replaced_by"] != bad_chain for s in logged)
    if skips.get(0, 0):
        assert f"data: {skips[0]} sample(s) skipped and replaced: {bad_chain} (IndexError" in stdout
    return records


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_corrupt_chain_is_skipped_and_replaced_single_rank(corrupt_store):
    root, bad_chain, expected = corrupt_store
    stdout, stderr = _train(root, "single", 1)
    _check_run(stdout, stderr, root / "single", 1, bad_chain, {0: expected})


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_corrupt_chain_dap2_group_stays_in_lockstep(corrupt_store):
    """``--dap 2``: the loader rank replaces the sample, the receiver gets every step's header and
    batch, both ranks finish all steps -- and the run equals the single-rank one (same replacement)."""
    root, bad_chain, expected = corrupt_store
    stdout, stderr = _train(root, "dap2", 2, "--dap", "2")
    assert "parallel layout: world 2 = dp 1 x bp 1 x dap 2" in stdout
    dap = _check_run(stdout, stderr, root / "dap2", 2, bad_chain, {0: expected})  # rank 1 runs no loader
    if (root / "single" / "metrics.jsonl").exists():  # the single-rank test ran first (module order)
        single = _step_records(root / "single" / "metrics.jsonl")
        for a, b in zip(dap, single):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-9), a["step"]


@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_corrupt_chain_on_one_data_parallel_rank_costs_no_step(tmp_path):
    """Two data-parallel ranks (DDP), each with its own loader: the corrupt chain is rank 1's sample
    of step 2. Rank 1 replaces it, so both ranks still take all steps (DDP's all-reduce of a step a
    rank skipped would hang) and the run ends normally."""
    bad_chain, skips = _make_store(tmp_path, world_size=2, bad_rank=1, bad_step=2)
    stdout, stderr = _train(tmp_path, "dp2", 2)
    assert "parallel layout: world 2 = dp 2 x bp 1 x dap 1" in stdout
    _check_run(stdout, stderr, tmp_path / "dp2", 2, bad_chain, skips)
