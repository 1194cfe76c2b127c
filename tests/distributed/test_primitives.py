"""DAP collectives (scalefold.distributed.primitives / axial): forward values and gradients equal
the single-process math, on 2 and 4 gloo processes in float64, including padding."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process_math(world):
    """gather (sum / split backward), scatter, all_to_all: values and gradients vs the full math."""
    run_processes(_primitives_worker, world)


def test_padded_layout_switches_round_trip():
    """Plane with non-divisible sizes: scatter -> row_to_col -> col_to_row -> gather is exact."""
    run_processes(_padding_worker, 2)


def test_calls_are_identity_when_dap_is_off():
    """With plane None the named calls return the very same tensor object (no copy)."""
    x = torch.randn(1, 3, 4, 2)
    for fn in (axial.scatter_rows, axial.gather_rows, axial.gather_cols, axial.row_to_col, axial.col_to_row):
        assert fn(x, None) is x
    assert axial.mask_rows(x[..., 0], None) is not None
