"""Differentiable collectives of Dynamic Axial Parallelism (DAP) over one DAP process group.

Every function takes a :class:`~scalefold.distributed.group.DAPGroup` and a tensor dimension:

* :func:`scatter` -- keep this rank's chunk; backward all-gathers the gradient;
* :func:`gather`  -- all-gather the chunks; backward is either ``"sum"`` (reduce-scatter: the
  gathered tensor feeds rank-local compute, e.g. pair biases, triangle projections, the outer
  product mean's right projection, so each rank holds only a partial gradient) or ``"split"``
  (keep this rank's chunk: only for outputs consumed by *replicated* compute, e.g. a stack's exit);
* :func:`all_to_all` -- switch the sharded dimension (``split_dim`` becomes sharded, ``cat_dim``
  becomes whole); its backward is the reverse switch.

Chunks are equal: the sharded dimension must be divisible by the group size (the axial layer,
:mod:`scalefold.distributed.axial`, pads). Each call adds the bytes this rank sends to
``group.stats`` (the logical volume of the collective: all_to_all ``(d-1)/d`` of the local
tensor, all-gather / reduce-scatter ``(d-1)`` local chunks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scalefold.distributed.group import CommStats, DAPGroup

GATHER_GRADS = ("sum", "split")

# torch >= 2.12 names the flat-tensor collectives *_single (the *_tensor names are deprecated)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _pos(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def _check_divisible(x: torch.Tensor, dim: int, g: DAPGroup, what: str) -> None:
    if x.shape[dim] % g.size:
        raise ValueError(f"{what}: dimension {dim} of shape {tuple(x.shape)} is not divisible by DAP size {g.size}")


def split_local(x: torch.Tensor, dim: int, g: DAPGroup) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (a view; no communication)."""
    _check_divisible(x, dim, g, "split")
    chunk = x.shape[dim] // g.size
    return x.narrow(dim, g.rank * chunk, chunk)


class Pending:
    """A collective that may still be in flight: :meth:`wait` returns its result (once).
    An asynchronous one (``work`` given) counts in ``stats.in_flight`` until it is waited for."""

    def __init__(self, work: dist.Work | None, finish, stats: CommStats | None = None) -> None:
        self._work, self._finish = work, finish
        self._stats = stats if work is not None else None
        if self._stats is not None:
            self._stats.in_flight += 1

    def wait(self) -> torch.Tensor:
        if self._finish is None:
            raise RuntimeError("Pending.wait() called twice on the same collective")
        if self._work is not None:
            self._work.wait()
        if self._stats is not None:
            self._stats.in_flight -= 1
            self._stats = None
        out, self._finish, self._work = self._finish(), None, None
        return out


def start_all_gather(x: torch.Tensor, dim: int, g: DAPGroup, async_op: bool = False) -> Pending:
    """Concatenate every rank's ``x`` along ``dim`` (no autograd); ``async_op``: do not wait."""
    p = _pos(x, dim)
    flat = x.reshape(-1)
    out = flat.new_empty(g.size * flat.numel())
    work = _ALL_GATHER(out, flat.contiguous(), group=g.group, async_op=async_op)
    g.stats.add("all_gather", x.numel() * x.element_size() * (g.size - 1))
    shape = (g.size,) + tuple(x.shape)
    return Pending(work if async_op else None, lambda: out.view(shape).movedim(0, p).flatten(p, p + 1), g.stats)


def start_reduce_scatter(x: torch.Tensor, dim: int, g: DAPGroup, async_op: bool = False) -> Pending:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim`` (no autograd)."""
    _check_divisible(x, dim, g, "reduce_scatter")
    p = _pos(x, dim)
    parts = x.unflatten(p, (g.size, x.shape[p] // g.size)).movedim(p, 0).contiguous()
    out = x.new_empty(parts.shape[1:])
    work = _REDUCE_SCATTER(out.view(-1), parts.view(-1), group=g.group, async_op=async_op)
    g.stats.add("reduce_scatter", out.numel() * out.element_size() * (g.size - 1))
    return Pending(work if async_op else None, lambda: out, g.stats)


def start_all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, g: DAPGroup, async_op: bool = False) -> Pending:
    """Send chunk ``k`` of ``split_dim`` to rank ``k``; concatenate the received chunks along
    ``cat_dim`` (no autograd)."""
    _check_divisible(x, split_dim, g, "all_to_all")
    sp, cp = _pos(x, split_dim), _pos(x, cat_dim)
    parts = x.unflatten(sp, (g.size, x.shape[sp] // g.size)).movedim(sp, 0).contiguous()
    out = torch.empty_like(parts)
    work = dist.all_to_all_single(out, parts, group=g.group, async_op=async_op)
    g.stats.add("all_to_all", x.numel() * x.element_size() * (g.size - 1) // g.size)
    return Pending(work if async_op else None, lambda: out.movedim(0, cp).flatten(cp, cp + 1), g.stats)


def all_gather_raw(x: torch.Tensor, dim: int, g: DAPGroup) -> torch.Tensor:
    return start_all_gather(x, dim, g).wait()


def reduce_scatter_raw(x: torch.Tensor, dim: int, g: DAPGroup) -> torch.Tensor:
    return start_reduce_scatter(x, dim, g).wait()


def all_to_all_raw(x: torch.Tensor, split_dim: int, cat_dim: int, g: DAPGroup) -> torch.Tensor:
    return start_all_to_all(x, split_dim, cat_dim, g).wait()


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, g: DAPGroup) -> torch.Tensor:
        ctx.dim, ctx.g = dim, g
        return split_local(x, dim, g).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_raw(grad, ctx.dim, ctx.g), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, g: DAPGroup, grad: str) -> torch.Tensor:
        ctx.dim, ctx.g, ctx.grad = dim, g, grad
        return all_gather_raw(x, dim, g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.grad == "sum":
            return reduce_scatter_raw(grad, ctx.dim, ctx.g), None, None, None
        return split_local(grad, ctx.dim, ctx.g).contiguous(), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split_dim: int, cat_dim: int, g: DAPGroup) -> torch.Tensor:
        ctx.dims, ctx.g = (split_dim, cat_dim), g
        return all_to_all_raw(x, split_dim, cat_dim, g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_dim, cat_dim = ctx.dims
        return all_to_all_raw(grad, cat_dim, split_dim, ctx.g), None, None, None


def scatter(x: torch.Tensor, dim: int, g: DAPGroup) -> torch.Tensor:
    """This rank's chunk of the replicated ``x``; the gradient is all-gathered (replicated)."""
    return _Scatter.apply(x, dim, g)


def gather(x: torch.Tensor, dim: int, g: DAPGroup, grad: str = "sum") -> torch.Tensor:
    """All-gather ``x`` along ``dim``. ``grad="sum"``: backward reduce-scatters (the gathered
    tensor feeds rank-local compute); ``grad="split"``: backward keeps the local chunk (the
    gathered tensor feeds replicated compute only)."""
    if grad not in GATHER_GRADS:
        raise ValueError(f"gather grad must be one of {GATHER_GRADS}, got {grad!r}")
    return _Gather.apply(x, dim, g, grad)


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, g: DAPGroup) -> torch.Tensor:
    """Make ``split_dim`` sharded and ``cat_dim`` whole; backward switches back."""
    return _AllToAll.apply(x, split_dim, cat_dim, g)


__all__ = [
    "GATHER_GRADS",
    "split_local",
    "Pending",
    "start_all_gather",
    "start_reduce_scatter",
    "start_all_to_all",
    "all_gather_raw",
    "reduce_scatter_raw",
    "all_to_all_raw",
    "scatter",
    "gather",
    "all_to_all",
]
