"""Rank discovery from launcher environments (pure functions over env dicts) and rank partitioning."""

from __future__ import annotations

import subprocess

import pytest

from scalefold.distributed.context import ParallelContext
from scalefold.distributed.layout import LayoutError, ParallelLayout
from scalefold.distributed.runtime import (
    SLURM_PORT_BASE,
    Runtime,
    cuda_device_index,
    discover,
    expand_slurm_nodelist,
    init_distributed,
    resolve_slurm_master,
)


def test_torchrun_environment():
    """torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_* are used as given."""
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node7", "MASTER_PORT": "1234"}  # fmt: skip
    info = discover(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 5, 16, 1)
    assert (info.local_world_size, info.num_nodes, info.master_addr, info.master_port) == (4, 4, "node7", 1234)


def test_slurm_srun_environment():
    """srun: SLURM_PROCID/STEP_NUM_TASKS/LOCALID; master = first node of the node list; port from the job id."""
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
           "SLURM_NODELIST": "dgx[007-008]", "SLURM_JOB_ID": "4242"}  # fmt: skip
    info = discover(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 9, 16, 1)
    assert (info.local_world_size, info.num_nodes) == (8, 2)
    assert info.master_addr == "dgx007"
    assert info.master_port == SLURM_PORT_BASE + 4242
    assert discover({**env, "MASTER_PORT": "2000", "MASTER_ADDR": "x"}).master_port == 2000


def test_torchrun_takes_precedence_over_slurm():
    """torchrun inside a Slurm allocation: torchrun's variables describe the process."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert discover(env).launcher == "torchrun"


def test_open_mpi_mpich_and_pmix_environments():
    """Open MPI OMPI_COMM_WORLD_*, MPICH PMI_RANK/PMI_SIZE and PMIx PMIX_RANK are recognised."""
    ompi = discover({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})  # fmt: skip
    assert (ompi.launcher, ompi.rank, ompi.world_size, ompi.local_rank, ompi.num_nodes) == ("mpi", 3, 8, 1, 4)
    assert ompi.master_addr is None  # to be broadcast with mpi4py
    mpich = discover({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    assert (mpich.rank, mpich.world_size, mpich.local_rank, mpich.num_nodes) == (2, 4, 0, 4)
    pmix = discover({"PMIX_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (pmix.rank, pmix.world_size, pmix.local_rank) == (1, 2, -1)  # local rank derived with mpi4py


def test_single_process_default():
    """No launcher variables: one process, no distributed initialisation."""
    info = discover({})
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)
    runtime = init_distributed(env={})
    assert not runtime.distributed and runtime.parallel.is_train_rank and runtime.parallel.is_main_train_rank
    assert runtime.parallel.layout.train_ranks() == [0] and runtime.parallel.eval_ranks == [] and runtime.parallel.log_ranks == (0,)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[001-003,7],login1", ["gpu001", "gpu002", "gpu003", "gpu7", "login1"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("x[09-11]", ["x09", "x10", "x11"]),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    """Slurm host-list syntax (ranges, zero padding, several groups) expands like scontrol show hostnames."""
    assert expand_slurm_nodelist(nodelist) == hosts


def test_resolve_master_prefers_scontrol(monkeypatch):
    """With scontrol on PATH its first hostname is the master; otherwise the list is parsed."""
    import scalefold.distributed.runtime as rt

    monkeypatch.setattr(rt.shutil, "which", lambda name: "/usr/bin/scontrol")
    fake = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout="hostA\nhostB\n", stderr="")  # noqa: E731
    assert resolve_slurm_master("h[1-2]", run=fake) == "hostA"
    monkeypatch.setattr(rt.shutil, "which", lambda name: None)
    assert resolve_slurm_master("h[1-2]") == "h1"


def test_layout_roles():
    """The last num_async_eval_ranks ranks evaluate; roles, the data-parallel rank (shared by a DAP group)
    and the log ranks all come from the one layout object."""
    layout = ParallelLayout(8, dap=2, num_eval_ranks=2).validate()
    assert layout.train_ranks() == [0, 1, 2, 3, 4, 5] and layout.eval_ranks() == [6, 7]
    with pytest.raises(LayoutError, match="leave no training rank"):
        ParallelLayout(2, num_eval_ranks=2).validate()
    rt = ParallelContext(layout, rank=6)
    assert rt.is_eval_rank and rt.is_main_eval_rank and not rt.is_train_rank and rt.async_eval
    assert rt.dp_rank == -1 and rt.log_ranks == (0, 6)
    rt1 = ParallelContext(layout, rank=3)
    assert rt1.dp_rank == 1 and rt1.num_train_ranks == 6 and rt1.layout.dp == 3  # ranks 2, 3: one DAP group


_MPI_SCRIPT = """
import sys, pathlib
import torch, torch.distributed as dist
from scalefold.distributed.runtime import init_distributed
rt = init_distributed(num_async_eval_ranks=1)
t = torch.tensor([float(rt.rank + 1)])
dist.all_reduce(t)
fields = [rt.launcher, rt.rank, rt.world_size, rt.local_rank, rt.parallel.layout.train_ranks(), rt.parallel.eval_ranks, float(t)]
pathlib.Path(sys.argv[1], f"rank{rt.rank}.txt").write_text(" ".join(map(str, fields)))
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_mpirun_launch_bootstraps_gloo_through_mpi4py(tmp_path):
    """Under `mpirun -n 2` (no MASTER_ADDR) ranks come from the MPI environment, the master address
    and port are broadcast with mpi4py, and gloo collectives work across the two ranks."""
    import os
    import shutil
    import sys
    from pathlib import Path

    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (pip install mpi4py mpich)")
    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "mpi_boot.py"
    script.write_text(_MPI_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([mpirun, "-n", "2", sys.executable, str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(2)]
    assert results == [
        ["mpi", "0", "2", "0", "[0]", "[1]", "3.0"],
        ["mpi", "1", "2", "1", "[0]", "[1]", "3.0"],
    ]


_BOOT_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from scalefold.distributed.runtime import init_distributed, shutdown
runtime = init_distributed(num_async_eval_ranks=1, timeout_s=300)
t = torch.tensor([float(runtime.rank + 1)])
dist.all_reduce(t)
print(json.dumps({"launcher": runtime.launcher, "rank": runtime.rank, "world": runtime.world_size,
                  "local_rank": runtime.local_rank, "backend": runtime.backend, "train": runtime.parallel.layout.train_ranks(),
                  "eval": runtime.parallel.eval_ranks, "sum": float(t)}), flush=True)
shutdown(runtime)
"""


def _free_port_in(lo: int, hi: int) -> int:
    import random
    import socket

    for _ in range(200):
        port = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"no free port in [{lo}, {hi})")


def _launcher_env(launcher: str, rank: int, world: int, port: int) -> dict[str, str]:
    if launcher == "torchrun":
        return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    if launcher == "slurm":  # srun without torchrun: master = first node, port derived from the job id
        return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank),
                "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": f"{world}",
                "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_ID": str(port - SLURM_PORT_BASE)}  # fmt: skip
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),  # mpirun (Open MPI)
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "mpi"])
def test_each_launcher_environment_bootstraps_real_gloo_groups(tmp_path, launcher):
    """Two processes started with only a launcher's environment (torchrun, srun, Open MPI's mpirun)
    find their ranks through the one code path, form a gloo group (all-reduce of 1 + 2 = 3) and split
    into 1 training + 1 evaluation rank."""
    import json
    import os
    import sys

    world = 2
    port = _free_port_in(SLURM_PORT_BASE + 1000, SLURM_PORT_BASE + 19000)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_")) and k not in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    base["OMP_NUM_THREADS"] = "1"
    script = tmp_path / "boot.py"
    script.write_text(_BOOT_SCRIPT)
    procs = [
        subprocess.Popen([sys.executable, str(script)], env={**base, **_launcher_env(launcher, r, world, port)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, out + err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert outputs == [
        {"launcher": launcher, "rank": r, "world": world, "local_rank": r, "backend": "gloo", "train": [0],
         "eval": [1], "sum": 3.0}
        for r in range(world)
    ]  # fmt: skip


def test_mpirun_without_mpi4py_is_a_clear_error(monkeypatch):
    """An MPI launch lacking MASTER_ADDR/MASTER_PORT needs mpi4py; without it: LaunchError saying how to fix it."""
    import sys

    from scalefold.distributed.runtime import LaunchError

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `import mpi4py` raises ImportError
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    with pytest.raises(LaunchError, match=r"pip install 'scalefold\[mpi\]'") as info:
        init_distributed(env=env)
    assert "MASTER_ADDR" in str(info.value) and "MASTER_PORT" in str(info.value)


def test_train_passes_the_configured_timeouts(monkeypatch):
    """process_group_timeout_s reaches init_distributed; eval_timeout_s (like it, settable by SCALEFOLD_* and
    flags) is the asynchronous-evaluation stall timeout; both must be > 0."""
    from scalefold.commands.train import add_parsers
    from scalefold.config.training import TrainConfig
    from scalefold.train import trainer as loop

    class _Stop(Exception):
        pass

    seen = {}

    def fake_init_distributed(*args, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(loop, "init_distributed", fake_init_distributed)
    env = {"SCALEFOLD_PROCESS_GROUP_TIMEOUT_S": "42", "SCALEFOLD_EVAL_TIMEOUT_S": "7.5"}
    cfg = TrainConfig.from_preset("tiny", env=env)
    assert (cfg.process_group_timeout_s, cfg.eval_timeout_s) == (42.0, 7.5)
    assert TrainConfig.from_preset("tiny", env={}).eval_timeout_s == 1800.0
    with pytest.raises(_Stop):
        loop.train(cfg)
    assert seen["timeout_s"] == 42.0
    with pytest.raises(ValueError, match="eval_timeout_s"):
        TrainConfig.from_preset("tiny", overrides={"eval_timeout_s": 0}, env={})

    import argparse

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    args = parser.parse_args(["train", "--eval-timeout-s", "60", "--process-group-timeout-s", "90",
                              "--synthesize-missing-store"])  # fmt: skip
    assert (args.eval_timeout_s, args.process_group_timeout_s, args.synthesize_missing_store) == (60.0, 90.0, True)


def _shutdown_entry(rank: int, world_size: int, port: int, leaver: int, out_dir: str) -> None:
    import json
    import os
    import sys
    import time

    import torch.distributed as dist

    from scalefold.distributed.runtime import shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if rank == leaver:  # a peer that is gone without any goodbye (crashed, killed)
        os._exit(0)
    sys.stderr = open(os.path.join(out_dir, f"stderr{rank}.txt"), "w")  # noqa: SIM115 (closed at exit)
    t0 = time.monotonic()
    shutdown(Runtime(rank=rank, world_size=world_size, backend="gloo"), clean=True, barrier_timeout_s=3.0)
    sys.stderr.flush()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": time.monotonic() - t0, "initialized": dist.is_initialized()}, f)


@pytest.mark.parametrize("leaver", [-1, 1], ids=["all-finish", "peer-gone"])
def test_shutdown_meets_peers_at_a_barrier_that_cannot_hang(tmp_path, leaver):
    """A cleanly finished rank waits for its peers at a gloo exit barrier before destroying the group;
    a peer that never arrives (gone) makes it leave after the barrier's timeout with a message on stderr,
    instead of hanging."""
    import json

    import torch.multiprocessing as mp

    from scalefold.distributed.launch import free_port

    mp.spawn(_shutdown_entry, args=(2, free_port(), leaver, str(tmp_path)), nprocs=2, join=True)
    stayers = [r for r in range(2) if r != leaver]
    for rank in stayers:
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not result["initialized"]
        assert result["seconds"] < 60
        stderr = (tmp_path / f"stderr{rank}.txt").read_text()
        if leaver < 0:
            assert stderr == ""
        else:
            assert "exit barrier failed" in stderr


def test_cuda_device_per_local_rank():
    """Several visible GPUs: local rank i takes GPU i, and more local ranks than GPUs is refused with a
    message (NCCL cannot put two ranks on one GPU); one visible GPU (bound per task) serves every rank."""
    assert [cuda_device_index(r, 8, 8) for r in range(8)] == list(range(8))
    assert [cuda_device_index(r, 8, 1) for r in range(8)] == [0] * 8  # srun --gpus-per-task=1
    with pytest.raises(RuntimeError, match="9 ranks on this node but 8 visible GPUs"):
        cuda_device_index(8, 9, 8)
