"""Collectives in the emulated capture keep a GPU's rule: an output is valid only after its ``wait()``
(scalefold.compilation.emulated_collectives). A replay poisons a collective's outputs at issue and writes them
at the recorded wait, so a consumer placed before the wait reads the poison and the replay differs from
eager; a collective issued in the region and never waited there is refused at the line that issued it. One
real gloo process group of one rank (the two-rank replays of DAP's collectives: test_emulated_collectives.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scalefold.compilation.emulated_capture import CaptureRefused, record

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():  # another module's group in this process: use it
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("group") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _waits_then_reads(x):
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    out = torch.empty(x.numel())
    dist.all_gather_into_tensor(out, x * 3)  # synchronous: waits inside
    return x * 2 + out


def _reads_before_waiting(x):
    work = dist.all_reduce(x, async_op=True)
    early = x * 2  # planted: reads the all-reduce's buffer before its wait
    work.wait()
    return early + x


def _never_waits(x):
    dist.all_reduce(x, async_op=True)  # planted: never waited
    return x * 2


def test_waits_in_place_replay_as_eager_and_a_read_before_the_wait_reads_poison():
    x = torch.arange(3.0)
    graph = record(_waits_then_reads, x)
    x.copy_(torch.tensor([1.0, -2.0, 5.0]))
    assert torch.equal(graph.replay(), _waits_then_reads(x.clone()))

    y = torch.arange(3.0)
    early = record(_reads_before_waiting, y)
    y.copy_(torch.tensor([1.0, -2.0, 5.0]))
    eager = _reads_before_waiting(y.clone())
    replayed = early.replay()
    assert torch.isfinite(eager).all() and torch.isnan(replayed).all()  # eager on the CPU hides the race
    assert torch.equal(y, torch.tensor([1.0, -2.0, 5.0]))  # the output written at the wait


def test_a_collective_never_waited_is_refused_at_the_line_that_issued_it():
    with pytest.raises(CaptureRefused, match="never waited") as info:
        record(_never_waits, torch.ones(2))
    assert info.value.rule == "never_waited"
    assert info.value.where.startswith("tests/compilation/test_collective_waits.py:") and "(_never_waits)" in info.value.where
