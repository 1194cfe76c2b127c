"""End to end: ``torch.distributed.run --nproc-per-node 2 -m scalefold train --preset tiny --dap 2
--deterministic --precision fp64`` (and ``--bp 2 --parallel-evoformer``) gives the single-rank run's
per-step losses and gradient norms (``metrics.jsonl``) and, after 3 steps, its weights -- dropout on,
one loader per DAP group / BP pair with the batch broadcast, DDP over the model-parallel ranks with
the ``x dap`` / ``x bp`` gradient factors and the bucket-norm clip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from scalefold.checkpoint.files import load_checkpoint
from scalefold.distributed.launch import free_port

pytestmark = pytest.mark.distributed

STEPS = 3  # the heads' "final" inits are zero: Evoformer weights move from step 2 on
ARGS = ("--preset", "tiny", "--max-steps", str(STEPS), "--eval-every", "0", "--checkpoint-every", str(STEPS),
        "--precision", "fp64", "--deterministic", "--num-workers", "1")  # fmt: skip


def _train(root, store, name: str, nproc: int, *extra: str, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launch = [sys.executable, "-m", "scalefold"]
    if nproc > 1 and launcher == "mpirun":  # ranks from PMI_*, master address broadcast with mpi4py
        launch = [_mpirun(), "-n", str(nproc), *launch]
    elif nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                  "--master-port", str(free_port()), "-m", "scalefold"]  # fmt: skip
    cmd = [*launch, "train", *ARGS, "--out", str(root / name), "--store", str(store), *extra]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _mpirun() -> str:
    import shutil
    from pathlib import Path

    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (pip install mpi4py mpich)")
    return mpirun


def _records(path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, tiny_store):
    """The single-rank run both DAP-2 launches (torchrun, mpirun) are compared with: run once for the module."""
    root = tmp_path_factory.mktemp("single_rank")
    _train(root, tiny_store, "single", 1)
    return root / "single"


def _assert_same_run(single, parallel) -> dict:
    """Per-step losses and gradient norms, and the final weights, of two runs (their run directories) agree."""
    ref, par = _records(single / "metrics.jsonl"), _records(parallel / "metrics.jsonl")
    assert [r["step"] for r in par] == list(range(1, STEPS + 1)) == [r["step"] for r in ref]
    for a, b in zip(par, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-11), (parallel, a["step"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-10), (parallel, a["step"])

    ckpt = f"checkpoints/checkpoint_{STEPS:08d}.pt"
    w_ref = load_checkpoint(single / ckpt)["alphafold_state_dict"]
    w_par = load_checkpoint(parallel / ckpt)["alphafold_state_dict"]
    assert w_ref.keys() == w_par.keys()
    for name, w in w_ref.items():
        torch.testing.assert_close(w_par[name], w, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{parallel} {name}: {m}")
    return w_ref


def test_dap2_training_run_equals_single_rank(tmp_path, tiny_store, single_run):
    proc = _train(tmp_path, tiny_store, "dap2", 2, "--dap", "2")
    assert "parallel layout: world 2 = dp 1 x bp 1 x dap 2" in proc.stdout
    w_single = _assert_same_run(single_run, tmp_path / "dap2")
    # the sharded blocks did train (their gradients went through the DAP collectives)
    key = "evoformer_stack.blocks.0.core.tri_mul_out.linear_z.weight"
    assert w_single[key].abs().max() > 1e-6, "Evoformer weights did not move: the test would not see DAP gradients"


def test_bp2_training_run_equals_single_rank_parallel_evoformer(tmp_path, tiny_store):
    """``--bp 2 --parallel-evoformer`` on 2 processes == the serial Parallel Evoformer on one: the
    branch broadcasts, the summed pair-input gradient, the x bp factor on branch-owned parameters
    and DDP with unused (other-branch) parameters, through the whole training loop."""
    _train(tmp_path, tiny_store, "single", 1, "--parallel-evoformer")
    proc = _train(tmp_path, tiny_store, "bp2", 2, "--parallel-evoformer", "--bp", "2")
    assert "parallel layout: world 2 = dp 1 x bp 2 x dap 1" in proc.stdout
    w_single = _assert_same_run(tmp_path / "single", tmp_path / "bp2")
    for key in ("evoformer_stack.blocks.0.msa_att_col.mha.linear_o.weight",  # MSA branch (zero init)
                "evoformer_stack.blocks.0.core.tri_att_end.mha.linear_o.weight"):  # pair branch  # fmt: skip
        assert w_single[key].abs().max() > 1e-6, f"{key} did not move: the test would not see BP gradients"


def test_invalid_layout_rejected_before_any_work(tmp_path):
    """``--dap 2`` on one process fails with the layout message before a store is synthesised."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "RANK", "WORLD_SIZE"))}
    cmd = [sys.executable, "-m", "scalefold", "train", "--preset", "tiny", "--dap", "2", "--out", str(tmp_path / "o"),
           "--store", str(tmp_path / "store.h5")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "invalid parallel layout" in proc.stderr and "not divisible by bp x dap = 1 x 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "store.h5").exists()


def test_dap2_under_mpirun_equals_single_rank(tmp_path, tiny_store, request):
    """The same DAP-2 run launched by ``mpirun -n 2`` (MPI rank discovery, no torchrun variables)."""
    _mpirun()  # skips before the single-rank run when MPI is absent
    single_run = request.getfixturevalue("single_run")
    proc = _train(tmp_path, tiny_store, "dap2_mpi", 2, "--dap", "2", launcher="mpirun")
    # no RANK/WORLD_SIZE/MASTER_* in the environment: a world of 2 can only come from MPI discovery
    assert "parallel layout: world 2 = dp 1 x bp 1 x dap 2" in proc.stdout
    _assert_same_run(single_run, tmp_path / "dap2_mpi")
