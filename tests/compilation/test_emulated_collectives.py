"""The emulated capture records DAP's collectives (synchronous and asynchronous, forward and backward) and the
gradient all-reduce, and a replay computes what eager does on new data: two processes over gloo.

gloo finishes a reduce-scatter inside ``Work.wait()`` by copying this rank's chunk out of a buffer of its own;
recorded, that copy would put the capture's stale chunk over every replay's result (found as a last-bit
difference in DAP-2's backward, issue 39). A replay on new data shows it: the recorded function's result must
follow the data."""

from __future__ import annotations

import os
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scalefold.distributed.launch import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]


def _collectives(x: torch.Tensor, w: torch.Tensor, g) -> torch.Tensor:  # noqa: ANN001
    """Every collective DAP and the flat reduction issue, differentiated: forward and backward both communicate."""
    from scalefold.distributed import async_ops as A
    from scalefold.distributed import primitives as P

    y = P.all_to_all(x * w, 0, 1, g)  # rows sharded -> columns sharded
    pending = A.all_to_all_async(y.tanh(), 1, 0, g)  # and back, overlapped with the next line
    z = P.gather(y * 2.0, 1, g, grad="sum")  # backward: a reduce-scatter
    back = pending.wait()
    u = A.gather_async(back, 0, g).wait()  # backward: an asynchronous reduce-scatter
    loss = (z.square().sum() + (u * u.flip(0)).sum()) / 7.0
    (grad,) = torch.autograd.grad(loss, w)
    grad = grad.contiguous()
    dist.all_reduce(grad)  # the data-parallel reduction of the gradient
    return torch.cat([loss.reshape(1), grad.reshape(-1), P.reduce_scatter_raw(z.detach(), 0, g).reshape(-1)])


def _rank(rank: int, port: int, out) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from scalefold.compilation.emulated_capture import record
        from scalefold.distributed.group import DAPGroup

        results = {}
        for overlap in (True, False):
            g = DAPGroup.world(overlap=overlap)
            torch.manual_seed(rank)
            x, w = torch.randn(4, 6), torch.randn(4, 6, requires_grad=True)
            graph = record(_collectives, x, w, g)
            rows = []
            for trial in range(3):  # new data in the captured buffers each time: the replay must follow it
                with torch.no_grad():
                    x.copy_(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * trial + rank)))
                    w.mul_(1.25)
                rows.append((graph.replay().clone(), _collectives(x, w, g)))
            # compared here: tensors through a queue outlive a process only as shared memory it must keep open
            results[overlap] = ([float((r - e).abs().max()) if not torch.equal(r, e) else 0.0 for r, e in rows],
                                not torch.equal(rows[0][1], rows[1][1]))  # fmt: skip
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


def test_replayed_collectives_follow_the_data_bit_for_bit():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(_collect(out, procs))
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    for rank, by_overlap in results.items():
        for overlap, (differences, data_changed) in by_overlap.items():
            assert differences == [0.0, 0.0, 0.0], (rank, overlap, differences)  # replay == eager, bit for bit
            assert data_changed


def _collect(out, procs) -> list:  # noqa: ANN001
    """Every process's result, or fail at once when one died without one (no wait for a timeout)."""
    got = []
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=2))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank died: exit codes {dead}"
    return got
