"""The heartbeat's protocol on real processes (gloo over torch.multiprocessing, the default group's TCPStore
as the side channel), without a model: the faults a ``scalefold train`` test cannot inject cheaply.

* a rank whose code raises: it claims the fault; its peers, whose collective breaks, name it and its error;
* a rank whose main thread is stuck while its process lives (its heartbeat goes on): the peers waiting
  for it find it behind them once their own progress stopped for ``stall_timeout_s``, and every rank --
  the stuck one too -- is ended by its heartbeat thread after ``dead_peer_timeout_s``;
* the settings that make NCCL end a run whose peer died, and the resume command, as pure functions.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from scalefold.distributed.heartbeat import EXIT_RANK_FAILED, Heartbeat, connect_store
from scalefold.distributed.launch import _entry, free_port
from scalefold.distributed.runtime import RankInfo, nccl_fault_environment, resume_command

pytestmark = pytest.mark.distributed

STALL_S, DEAD_PEER_S = 3.0, 4.0


def _heartbeat(rank: int, world: int, out: Path) -> Heartbeat:
    def leave(status: int) -> None:  # what the heartbeat thread does last: record the line, then exit
        (out / f"rank{rank}.json").write_text(json.dumps({"status": status, "line": hb.ended_with, "by": "thread"}))
        os._exit(0)

    store = connect_store("127.0.0.1", int(os.environ["MASTER_PORT"]), timeout_s=10)
    hb = Heartbeat(store, rank, world, stall_timeout_s=STALL_S, dead_peer_timeout_s=DEAD_PEER_S, interval_s=0.2,
                   fault_dir=out / "faults", resume="scalefold train --resume", hosts_store=rank == 0,
                   exit_fn=leave)  # fmt: skip
    return hb.start()


def _raises(rank: int, world: int, out: str) -> None:
    out = Path(out)
    hb = _heartbeat(rank, world, out)
    dist.barrier()
    hb.mark(1)
    if rank == 1:
        exc = ValueError("a bad batch")
        assert hb.explain(exc) is None  # its own error: claimed, its traceback is the report
        (out / "rank1.json").write_text(json.dumps({"status": 1, "line": "", "by": "itself"}))
        os._exit(0)  # gone (status 0: torch.multiprocessing would terminate the others at once on a failure)
    try:
        dist.barrier()  # breaks: rank 1 is gone
    except RuntimeError as exc:
        failure = hb.explain(exc)
        (out / f"rank{rank}.json").write_text(json.dumps({"status": failure.exit_status, "line": failure.line,
                                                          "by": "main"}))  # fmt: skip
    hb.stop(None)  # rank 0 holds the store (run_processes): it waits for its peers to have read the fault
    os._exit(0)


def _stuck(rank: int, world: int, out: str) -> None:
    hb = _heartbeat(rank, world, Path(out))
    dist.barrier()
    hb.mark(1)
    hb.mark(1, waiting=True)  # step 1 done everywhere: the watch of one's own progress is armed
    if rank == 1:
        time.sleep(120)  # stuck waiting for its next batch (a hung file read); its heartbeat thread beats on
    hb.mark(2)
    dist.barrier()  # waits for rank 1 until the heartbeat ends this rank
    os._exit(3)  # never reached


@pytest.fixture(scope="module")
def run_ranks():
    """``run_ranks(fn, world, *args)``: :func:`~scalefold.distributed.launch.run_processes` (its entry: a gloo
    default group, ``fn``, the exit) with the ranks forked by multiprocessing's forkserver, which imported torch
    and the heartbeat once, instead of spawned (each importing them); stopped at the end if started here."""
    from multiprocessing import forkserver

    started = forkserver._forkserver._forkserver_pid is None
    if started:
        forkserver.set_forkserver_preload(["torch", "scalefold.distributed.heartbeat", "scalefold.distributed.runtime"])

    def run(fn, world: int, *args) -> None:
        mp.start_processes(_entry, args=(fn, world, free_port(), 1, args), nprocs=world, start_method="forkserver")

    yield run
    if started:
        forkserver._forkserver._stop()


def _results(out: Path, world: int) -> dict[int, dict]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if (out / f"rank{r}.json").exists()}


def test_a_rank_that_raises_is_named_with_its_error(tmp_path, run_ranks):
    run_ranks(_raises, 3, str(tmp_path))  # every rank leaves by os._exit(0) after writing its result
    results = _results(tmp_path, 3)
    assert sorted(results) == [0, 1, 2], results
    for rank in (0, 2):
        line = results[rank]["line"]
        assert results[rank]["status"] == EXIT_RANK_FAILED
        assert line.startswith("scalefold train: rank 1 (host ") and "failed (ValueError: a bad batch) at step 1" in line
        assert f"rank {rank} stops" in line and line.endswith("resume: scalefold train --resume")
        assert (tmp_path / "faults" / f"rank{rank}.txt").exists()


def test_a_stuck_main_thread_is_found_behind_its_peers(tmp_path, run_ranks):
    t0 = time.monotonic()
    try:
        run_ranks(_stuck, 3, str(tmp_path))
    except Exception:  # noqa: BLE001 -- the ranks are ended by their heartbeats (os._exit after writing their line)
        pass
    elapsed = time.monotonic() - t0
    results = _results(tmp_path, 3)
    assert sorted(results) == [0, 1, 2], results
    for rank, result in results.items():
        assert result["by"] == "thread" and result["status"] == EXIT_RANK_FAILED
        line = result["line"]
        assert line.startswith("scalefold train: rank 1 (host ") and "made no progress for" in line
        assert "(waiting for its batch while its peers wait) at step 1" in line
        assert ("this rank stops" if rank == 1 else f"rank {rank} stops") in line
        assert f"[its main thread was still blocked after {DEAD_PEER_S:g} s]" in line
    assert elapsed < 100  # not the 120 s of the stuck rank's sleep, nor the process group's 30 min


def test_nccl_settings_and_the_resume_command():
    """The NCCL variables set before the process group (the user's own values kept), and the resume command
    of each launcher (``--resume`` added once, ``--overwrite`` dropped)."""
    env = nccl_fault_environment("runs/x/faults", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert env == {"TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "runs/x/faults/nccl_trace_rank_"}  # fmt: skip
    assert nccl_fault_environment(None, {})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    argv = ["train", "--preset", "mlperf", "--out", "runs/a b", "--overwrite"]
    torchrun = RankInfo("torchrun", world_size=8, local_world_size=4, num_nodes=2)
    assert resume_command(torchrun, argv) == ("torchrun --nnodes 2 (and the same rendezvous) --nproc-per-node 4 -m "
                                              "scalefold train --preset mlperf --out 'runs/a b' --resume")  # fmt: skip
    assert resume_command(RankInfo("slurm", world_size=16), argv + ["--resume"]).startswith("srun --ntasks 16 scalefold train")
    assert resume_command(RankInfo("single"), ["-q"], default_args=["train", "--out", "o"]) == "scalefold train --out o --resume"
