"""Whole-step graphs where the users run (issue 39): ``--cuda-graphs step`` at DP-2, DAP-2, DAP-2 x DP-2 and BP-2 x DAP-2
under ``torch.distributed.run`` on gloo, over the CPU's emulated capture (replays run no Python; DAP's
all-to-all / all-gather, the agreement's all-reduce and the flat gradient all-reduce recorded inside the
graph, each rank's verdict agreed): every step's metrics and the final checkpoint's weights bit-identical to
the same run with graphs off, the replays counted in the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scalefold.checkpoint.files import load_checkpoint
from scalefold.config.training import TrainConfig
from scalefold.data.synthetic import synthesize
from scalefold.distributed.launch import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 3
ARGS = ("--preset", "tiny", "--max-steps", str(STEPS), "--eval-every", "0", "--checkpoint-every", str(STEPS),
        "--deterministic", "--num-workers", "1", "--no-progress", "--grad-reduce", "flat")  # fmt: skip


DRIVER = Path(__file__).resolve().with_name("train_twice.py")


def _train_eager_then_graphed(root: Path, store: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    """ONE ``torch.distributed.run`` launch of ``nproc`` ranks: the eager run (``--cuda-graphs off``, into
    ``root/off``), then in the same ranks the graphed run (``--cuda-graphs step``, ``root/step``) through the
    test-only driver (tests/distributed/train_twice.py: the second run forms its own process group on a
    fresh rendezvous store). Both read ``store``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    common = [*ARGS, "--store", str(store), *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), str(DRIVER), str(free_port()), *common, "--out", str(root / "off"), "--cuda-graphs", "off",
           "--then", *common, "--out", str(root / "step"), "--cuda-graphs", "step"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _metrics(path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k != "tflops"}
            for r in map(json.loads, path.read_text().splitlines())]  # fmt: skip


def test_whole_step_graphs_at_dp2_equal_eager(tmp_path, tiny_store):
    """DP-2: the flat gradient all-reduce and the agreement captured inside the graph; replayed bit for bit."""
    proc = _train_eager_then_graphed(tmp_path, tiny_store, 2)
    assert "the flat gradient all-reduce inside" in proc.stdout, proc.stdout[-2000:]
    assert f"cuda graphs (whole step): {STEPS - 1} step(s) graphed" in proc.stdout, proc.stdout[-2000:]
    _assert_same_run(tmp_path)


@pytest.mark.parametrize("nproc", [2, 4], ids=["dap2", "dap2xdp2"])
def test_whole_step_graphs_at_dap_layouts_equal_eager(tmp_path, tiny_store, nproc):
    """DAP-2 and DAP-2 x DP-2: DAP's all-to-all / all-gather / reduce-scatter (forward and backward, overlapped
    or not), the agreement's all-reduce and the flat gradient all-reduce recorded inside the graph, every rank
    agreeing on the verdict: replayed, and the run's metrics and weights are the eager run's bit for bit."""
    proc = _train_eager_then_graphed(tmp_path, tiny_store, nproc, "--dap", "2")
    assert "DAP 2 (its collectives inside the graph)" in proc.stdout, proc.stdout[-2000:]
    assert f"cuda graphs (whole step): {STEPS - 1} step(s) graphed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "whole-step graphs are off" not in proc.stderr, proc.stderr[-2000:]
    _assert_same_run(tmp_path)


def test_whole_step_graphs_at_bp2xdap2_equal_eager(tmp_path, tiny_store):
    """BP-2 x DAP-2 (Parallel Evoformer): the branches draw dropout from their own generators, seeded before
    the step and advanced by each replay (no host reseeding inside), the branch broadcast and gradient sum
    inside the graph: replayed, bit-identical to eager."""
    extra = ("--dap", "2", "--bp", "2", "--parallel-evoformer")
    proc = _train_eager_then_graphed(tmp_path, tiny_store, 4, *extra)
    assert "DAP 2 x BP 2 (its collectives inside the graph)" in proc.stdout, proc.stdout[-2000:]
    assert f"cuda graphs (whole step): {STEPS - 1} step(s) graphed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    _assert_same_run(tmp_path)


def test_whole_step_graphs_at_bp2_on_the_demo_preset_with_dropout_equal_eager(tmp_path):
    """BP-2 on demo (tiny has no dropout): the two branches' masks drawn inside the replay from their own
    generators, bit-identical to eager. Its store: the demo preset's chain lengths and seed, but 20 chains (its
    320 take ~20 CPU s to synthesise; the claim is the model's dropout, not the store's size)."""
    cfg = TrainConfig.from_preset("demo", env={})
    store = tmp_path / "demo-store.h5"
    synthesize(store, num_chains=20, num_families=2, length_range=tuple(cfg.synth_length_range), seed=cfg.synth_seed)
    extra = ("--preset", "demo", "--bp", "2", "--parallel-evoformer")
    proc = _train_eager_then_graphed(tmp_path, store, 2, *extra)
    assert f"cuda graphs (whole step): {STEPS - 1} step(s) graphed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    _assert_same_run(tmp_path)


def _assert_same_run(root) -> None:
    off, step = _metrics(root / "off" / "metrics.jsonl"), _metrics(root / "step" / "metrics.jsonl")
    assert len(off) == STEPS and off == step
    ckpt = f"checkpoints/checkpoint_{STEPS:08d}.pt"
    a = load_checkpoint(root / "off" / ckpt)["alphafold_state_dict"]
    b = load_checkpoint(root / "step" / ckpt)["alphafold_state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
