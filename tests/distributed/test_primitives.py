"""DAP collectives (scalefold.distributed.primitives / axial): forward values and gradients equal
the single-process math, on 2 and 4 gloo processes in float64, including padding."""

from __future__ import annotations

import pytest
import torch

from scalefold.distributed import async_ops as A
from scalefold.distributed import axial
from scalefold.distributed import primitives as P
from scalefold.distributed.group import DAPGroup
from scalefold.distributed.launch import run_processes

pytestmark = pytest.mark.distributed


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _chunk(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world, dim=dim)[rank]


def _primitives_worker(rank: int, world: int) -> None:
    g = DAPGroup.world()
    x = _full(0, 2, 4 * world, 3 * world, 5)
    weights = [_full(10 + r, *x.shape) for r in range(world)]
    for dim in (-3, -2):
        # gather, "sum" backward: every rank consumes the gathered tensor with its own weights.
        local = _chunk(x, dim, rank, world).clone().requires_grad_()
        y = P.gather(local, dim, g, grad="sum")
        torch.testing.assert_close(y, x, rtol=0, atol=0)
        (y * weights[rank]).sum().backward()
        torch.testing.assert_close(local.grad, _chunk(sum(weights), dim, rank, world), rtol=1e-14, atol=1e-14)

        # gather, "split" backward: replicated consumer (same weights everywhere), counted once.
        local = _chunk(x, dim, rank, world).clone().requires_grad_()
        (P.gather(local, dim, g, grad="split") * weights[0]).sum().backward()
        torch.testing.assert_close(local.grad, _chunk(weights[0], dim, rank, world), rtol=0, atol=0)

        # scatter: replicated input, rank-local consumers; the gradient comes back whole.
        whole = x.clone().requires_grad_()
        part = P.scatter(whole, dim, g)
        torch.testing.assert_close(part, _chunk(x, dim, rank, world), rtol=0, atol=0)
        (part * _chunk(weights[rank], dim, rank, world)).sum().backward()
        expected = torch.cat([_chunk(weights[r], dim, r, world) for r in range(world)], dim=dim)
        torch.testing.assert_close(whole.grad, expected, rtol=0, atol=0)

    # all_to_all: row-sharded -> column-sharded, backward = the reverse switch.
    local = _chunk(x, -3, rank, world).clone().requires_grad_()
    y = P.all_to_all(local, -2, -3, g)
    torch.testing.assert_close(y, _chunk(x, -2, rank, world), rtol=0, atol=0)
    w = weights[0]
    (y * _chunk(w, -2, rank, world)).sum().backward()
    torch.testing.assert_close(local.grad, _chunk(w, -3, rank, world), rtol=0, atol=0)

    # bytes: one all_to_all of the local tensor sends (d-1)/d of it.
    g.stats.reset()
    P.all_to_all(local.detach(), -2, -3, g)
    assert g.stats.bytes["all_to_all"] == local.numel() * 8 * (world - 1) // world

    with pytest.raises(ValueError, match="not divisible"):
        P.all_to_all(torch.zeros(2, 3, world + 1, 1, dtype=torch.float64), -2, -3, g)


def _padding_worker(rank: int, world: int) -> None:
    """Real sizes not divisible by the group: scatter/switch/gather round trips are exact and
    padded entries never reach real ones (gradients of a rank-local loss, summed, are exact)."""
    g = DAPGroup.world()
    rows, cols = 2 * world + 1, 3 * world - 1
    plane = axial.Plane(g, rows, cols)
    x = _full(1, 1, rows, cols, 3).requires_grad_()
    w = _full(2, 1, rows, cols, 3)
    m = plane.scatter_rows(x)
    assert m.shape[-3] == plane.padded(rows) // world and m.shape[-2] == cols
    m = plane.row_to_col(m * 2.0)
    assert m.shape[-3] == rows and m.shape[-2] == plane.padded(cols) // world
    # a rank-local column-sharded consumer: weights of this rank's (padded) columns
    w_cols = plane.local(w, -2, cols)
    m = plane.col_to_row(m * w_cols)
    out = plane.gather_rows(m, grad="split")
    torch.testing.assert_close(out, 2.0 * x * w, rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * w, rtol=0, atol=0)
    # masks: local rows/columns of a replicated mask, padded with zeros
    mask = torch.ones(1, rows, cols, dtype=torch.float64)
    assert axial.mask_rows(mask, plane).shape[-2] == plane.padded(rows) // world
    total = torch.tensor(axial.mask_cols(mask, plane).sum().item())
    torch.distributed.all_reduce(total)
    assert total.item() == rows * cols


def _async_worker(rank: int, world: int) -> None:
    """Duality Async Operations: launch, independent compute, wait -- values and gradients equal
    the synchronous collectives and the single-process math (the reverse collective is launched
    by the wait's backward and waited by the launch's backward)."""
    x = _full(0, 1, 2 * world, 3 * world, 4)
    w_all = [_full(1 + r, *x.shape) for r in range(world)]
    w = w_all[rank]
    grads = {}
    for overlap in (True, False):
        g = DAPGroup.world(overlap=overlap)
        local = _chunk(x, -3, rank, world).clone().requires_grad_()
        other = _full(7, 3, 3).requires_grad_()
        pending_a2a = A.all_to_all_async(local * 2.0, -2, -3, g)
        pending_gather = A.gather_async(local * 3.0, -3, g, grad="sum")
        independent = other @ other  # runs while both collectives are in flight
        y, full = pending_a2a.wait(), pending_gather.wait()
        torch.testing.assert_close(y, 2.0 * _chunk(x, -2, rank, world), rtol=0, atol=0)
        torch.testing.assert_close(full, 3.0 * x, rtol=0, atol=0)
        ((y * _chunk(w, -2, rank, world)).sum() + (full * w).sum() + independent.sum()).backward()
        grads[overlap] = local.grad
        with pytest.raises(RuntimeError, match="twice"):
            pending_a2a.wait()
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)
    # all_to_all: rank k's loss weights its columns; gather "sum": every rank's weights count
    a2a_weights = torch.cat([_chunk(w_all[k], -2, k, world) for k in range(world)], dim=-2)
    expected = 2.0 * _chunk(a2a_weights, -3, rank, world) + 3.0 * _chunk(sum(w_all), -3, rank, world)
    torch.testing.assert_close(grads[True], expected, rtol=1e-13, atol=1e-13)


def _checkpoint_worker(rank: int, world: int) -> None:
    """Activation checkpointing around launch -> compute -> wait: non-reentrant checkpointing stops
    recomputing once its saved tensors exist, i.e. before the wait. The recomputation must leave no
    collective in flight (it issues nothing: the original graph's handles serve the backward), and
    values and gradients equal the run without checkpointing, async or not."""
    from torch.utils.checkpoint import checkpoint

    x = _full(0, 1, 2 * world, 3 * world, 4)
    w = _full(1 + rank, 1, 2 * world, 3, 4)

    def region(local: torch.Tensor, g: DAPGroup):
        pending = A.all_to_all_async(local * 2.0, -2, -3, g)
        kept = local.sin() * local  # saved tensors: the recomputation stops after this
        return kept, pending.wait()

    results = {}
    for overlap in (True, False):
        for ckpt in ("none", "non-reentrant", "reentrant"):
            g = DAPGroup.world(overlap=overlap)
            local = _chunk(x, -3, rank, world).clone().requires_grad_()
            if ckpt == "none":
                kept, y = region(local, g)
            else:
                kept, y = checkpoint(region, local, g, use_reentrant=ckpt == "reentrant")
            g.stats.reset()
            (kept.sum() + (y * w).sum()).backward()
            assert g.stats.in_flight == 0, f"overlap {overlap} checkpoint {ckpt}: a collective left in flight"
            # backward: the reverse all_to_all; a non-reentrant recomputation stops before the wait
            # and sends nothing, a reentrant one reruns the region (its collective, synchronously)
            calls = 2 if ckpt == "reentrant" else 1
            assert dict(g.stats.calls) == {"all_to_all": calls}, (overlap, ckpt, dict(g.stats.calls))
            results[overlap, ckpt] = (y.detach(), local.grad)
    y_ref, grad_ref = results[False, "none"]
    for key, (y, grad) in results.items():
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
        torch.testing.assert_close(grad, grad_ref, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def _bf16_worker(rank: int, world: int) -> None:
    """bf16 activations: gather (async, reduce-scatter backward) and all_to_all are exact."""
    g = DAPGroup.world()
    x = _full(0, 1, 2 * world, 3 * world, 3).bfloat16()
    local = _chunk(x, -3, rank, world).clone().requires_grad_()
    full = A.gather_async(local, -3, g).wait()
    switched = P.all_to_all(local, -2, -3, g)
    assert full.dtype == switched.dtype == torch.bfloat16
    assert torch.equal(full, x) and torch.equal(switched, _chunk(x, -2, rank, world))
    (full.float().sum() + 2 * switched.float().sum()).backward()
    assert local.grad.dtype == torch.bfloat16 and torch.equal(local.grad, torch.full_like(local, world + 2.0))


def _two_rank_worker(rank: int, world: int) -> None:
    _primitives_worker(rank, world)
    _padding_worker(rank, world)
    _async_worker(rank, world)
    _checkpoint_worker(rank, world)
    _bf16_worker(rank, world)


def test_collectives_match_single_process_math_2():
    """2 ranks: gather (sum / split backward), scatter, all_to_all vs the full math; padded layout
    switches (scatter -> row_to_col -> col_to_row -> gather exact, padding never leaks); async
    launch/wait pairs == synchronous collectives in values and gradients, also under activation
    checkpointing (no collective left in flight by the recomputation)."""
    run_processes(_two_rank_worker, 2)


def test_collectives_match_single_process_math_4():
    """4 ranks: the same collectives and async pairs."""
    run_processes(_four_rank_worker, 4)


def _four_rank_worker(rank: int, world: int) -> None:
    _primitives_worker(rank, world)
    _async_worker(rank, world)


def test_calls_are_identity_when_dap_is_off():
    """With plane None the named calls return the very same tensor object (no copy)."""
    x = torch.randn(1, 3, 4, 2)
    for fn in (axial.scatter_rows, axial.gather_rows, axial.gather_cols, axial.row_to_col, axial.col_to_row):
        assert fn(x, None) is x
    assert axial.mask_rows(x[..., 0], None) is not None


def test_row_chunks_are_contiguous_views():
    """Sharding dim 1 of a batch-1 ``[1, A, B, C]`` (the row layout): a rank's chunk is a contiguous
    view of the whole tensor (no copy), and the padded chunk of a ragged size too."""
    g = DAPGroup(group=None, size=4, rank=2)  # no communication below
    x = torch.randn(1, 8, 6, 3)
    chunk = P.split_local(x, axial.ROWS, g)
    assert chunk.is_contiguous() and chunk.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(chunk, x[:, 4:6])
    plane = axial.Plane(g, rows=7, cols=6)
    local = plane.local(torch.randn(1, 7, 6, 3), axial.ROWS, 7)  # padded to 8 rows: rank 2 holds rows 4, 5
    assert local.shape == (1, 2, 6, 3) and local.is_contiguous()
