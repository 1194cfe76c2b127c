"""Every rank of a group captures, or none (NCCL's rule for captured collectives): a capture that fails on
one rank turns whole-step graphs off on all of them, each saying so in one line, and nobody hangs (two
processes over gloo; both cases, nobody failing and rank 1 failing, in one pair of processes and one step build)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scalefold.distributed.launch import free_port

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.distributed]
CASES = {"none fails": -1, "rank 1 fails": 1}


def _rank(rank: int, port: int, out) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from scalefold.compilation.emulated_capture import EmulatedGraphBackend
        from scalefold.compilation.graphed_step import WholeStepGraphs
        from scalefold.config.training import TrainConfig
        from scalefold.train.step import TrainingStep

        class Failing(EmulatedGraphBackend):
            def capture(self, fn, static_args):
                raise RuntimeError("operation not permitted when stream is capturing")

        step = TrainingStep.build(TrainConfig.from_preset("tiny", env={}))
        for case, fail_on in CASES.items():  # each case its own graphs over the one step (nothing carried over)
            lines: list[str] = []
            backend = Failing() if rank == fail_on else EmulatedGraphBackend()
            graphs = WholeStepGraphs(step, backend=backend, warn=lines.append, group=dist.group.WORLD)
            captured = graphs.warm_up(step.batch, counts=[0])
            out.put((case, rank, captured, graphs.active, lines))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def verdicts() -> dict:
    """``{case: {rank: (captured, active, lines)}}`` from one pair of ranks that ran every case in turn."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict = {case: {} for case in CASES}
    for _ in range(len(procs) * len(CASES)):
        case, rank, *rest = out.get(timeout=600)
        results[case][rank] = rest
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_the_capture_verdict_is_agreed_between_ranks(verdicts, case):
    fail_on = CASES[case]
    for rank, (captured, active, lines) in verdicts[case].items():
        if fail_on < 0:
            assert captured == [0] and active and lines == []
            continue
        assert captured == [] and not active and len(lines) == 1, (rank, lines)
        expect = "capture failed: RuntimeError" if rank == fail_on else "another rank's capture failed"
        assert expect in lines[0] and "off for this run" in lines[0], (rank, lines)
