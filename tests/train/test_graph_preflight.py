"""``--cuda-graphs`` / ``--grad-reduce`` against the launch, checked on every rank before the process group forms
(issue 46, item 8): whole-step graphs on several training ranks take the capturable flat gradient all-reduce
themselves, in one line; a mistake in a multi-rank run ends each rank with one line and exit status 3, with no
collective, heartbeat or gloo traceback behind it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scalefold.compilation.graphed_step import CudaGraphsUnavailable
from scalefold.config.training import TrainConfig
from scalefold.distributed.launch import free_port
from scalefold.distributed.layout import ParallelLayout
from scalefold.optim.flat_reduce import graphed_reduce_line, resolve_grad_reduce
from scalefold.train.trainer import check_graph_modes


def _cfg(**overrides) -> TrainConfig:
    return TrainConfig.from_preset("tiny", overrides=overrides, env={})


def test_whole_step_graphs_choose_the_flat_reduction_in_one_line(capsys):
    assert resolve_grad_reduce("ddp", 2, graphed=True) == "flat"  # DDP's reducer cannot be captured
    assert resolve_grad_reduce("ddp", 2) == "ddp"  # the eager (deterministic) runs' default is unchanged
    assert resolve_grad_reduce("ddp", 1, graphed=True) == "local"
    assert graphed_reduce_line("flat", 2) is None and graphed_reduce_line("ddp", 1) is None
    layout = ParallelLayout(4, dap=2)  # DAP 2 x DP 2: four training ranks
    cfg = _cfg(cuda_graphs="step")
    assert cfg.grad_reduce == "ddp"
    check_graph_modes(cfg, layout, "cpu", rank=0)  # no CudaGraphsUnavailable: the flat reduction is chosen
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("scalefold train: --cuda-graphs step with 4 training ranks: the "
                                                   "gradient all-reduce is the flat one (--grad-reduce flat")  # fmt: skip
    check_graph_modes(cfg, layout, "cpu", rank=1)  # said once, by the main training rank
    check_graph_modes(_cfg(cuda_graphs="step", grad_reduce="flat"), layout, "cpu", rank=0)  # asked for: nothing to say
    check_graph_modes(_cfg(cuda_graphs="off"), layout, "cpu", rank=0)
    assert capsys.readouterr().out == ""
    with pytest.raises(CudaGraphsUnavailable, match="--cuda-graphs on needs a CUDA device"):
        check_graph_modes(_cfg(cuda_graphs="on"), layout, "cpu", rank=3)


@pytest.mark.distributed
def test_a_configuration_error_ends_every_rank_before_the_process_group(tmp_path):
    """``torchrun --nproc-per-node 4 -m scalefold train --preset tiny --dap 2 --cuda-graphs on`` on a CPU, rank by
    rank as torchrun starts them (its environment), but only two of the four started: had the process group
    formed first, each would wait for the missing peers; each ends at once with its one line, exit status 3, and
    nothing else on its stdout or stderr, nothing written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    env.update(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, "-m", "scalefold", "train", "--preset", "tiny", "--dap", "2", "--cuda-graphs", "on",
           "--out", str(tmp_path / "run"), "--store", str(tmp_path / "store.h5"), "--no-count-flops"]  # fmt: skip
    procs = {rank: subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=tmp_path,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 3)}  # fmt: skip
    for rank, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        lines = (out + err).strip().splitlines()
        assert proc.returncode == 3, (rank, out[-2000:], err[-2000:])
        assert lines == ["scalefold train: configuration error: --cuda-graphs on needs a CUDA device (this run "
                         "computes on cpu); use --cuda-graphs auto or off"], (rank, lines)  # fmt: skip
    assert not (tmp_path / "run").exists() and not (tmp_path / "store.h5").exists()
