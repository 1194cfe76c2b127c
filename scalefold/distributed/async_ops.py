"""Duality Async Operations: overlap a DAP collective with independent compute, in forward *and*
in backward.

A collective is bracketed by two autograd Functions sharing one :class:`AsyncHandle` (kept in both
``ctx`` objects; no module globals, any number in flight):

* forward  -- ``_Launch`` starts the collective and returns an empty *token*; the independent
  compute runs; ``_Wait(token)`` waits and returns the result;
* backward -- ``_Wait.backward`` starts the *reverse* collective on the incoming gradient (the
  reverse all_to_all, the reduce-scatter of a gather) and returns an empty token gradient; the
  backward of the independent compute runs (autograd visits later-created nodes first);
  ``_Launch.backward`` waits and hands the input its gradient.

Usage (``EvoformerBlockCore``: the MSA all_to_all of step 5 under the whole pair stack)::

    pending = col_to_row_async(m, plane)     # launched
    z = pair_stack(z)                        # independent compute
    m = pending.wait()                       # result (differentiable)

Activation checkpointing: the original graph's nodes keep their own handles for backward. A
recomputation (a forward run *inside* a backward pass) does not launch at all: it issues the
synchronous collective when (and only if) ``wait()`` is reached. Non-reentrant checkpointing stops
recomputing as soon as the saved tensors it needs exist, which in an Evoformer block is before the
MSA all_to_all's ``wait()``: a collective launched there would be left in flight, never waited for
(wasted bytes every block, and with gloo an abort at process-group teardown). Every rank recomputes
the same ops, so the deferred collectives still match across the group.
With ``DAPGroup.overlap`` off the same calls run the synchronous collectives at launch
(:func:`scalefold.distributed.primitives.all_to_all` / ``gather``), which must give identical
results (tested).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scalefold.distributed import primitives as P
from scalefold.distributed.group import DAPGroup

Start = Callable[[torch.Tensor], P.Pending]


class AsyncHandle:
    """One collective in flight (``forward``) and its reverse (``backward``), each a function
    ``tensor -> Pending`` that starts the collective without waiting."""

    def __init__(self, forward: Start, backward: Start) -> None:
        self._start_forward, self._start_backward = forward, backward
        self._forward: P.Pending | None = None
        self._backward: P.Pending | None = None

    def launch(self, x: torch.Tensor) -> None:
        if self._forward is not None:
            raise RuntimeError("AsyncHandle: collective already launched")
        self._forward = self._start_forward(x.detach())

    def result(self) -> torch.Tensor:
        if self._forward is None:
            raise RuntimeError("AsyncHandle: wait() before launch()")
        pending, self._forward = self._forward, None
        return pending.wait()

    def launch_backward(self, grad: torch.Tensor) -> None:
        self._backward = self._start_backward(grad.contiguous())

    def grad(self) -> torch.Tensor:
        if self._backward is None:
            raise RuntimeError("AsyncHandle: backward wait before the reverse collective was launched")
        pending, self._backward = self._backward, None
        return pending.wait()


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, handle: AsyncHandle) -> torch.Tensor:
        ctx.handle = handle
        handle.launch(x)
        return x.new_empty(0)  # token: connects _Wait to x in the graph

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        return ctx.handle.grad(), None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: torch.Tensor, handle: AsyncHandle) -> torch.Tensor:
        ctx.handle = handle
        return handle.result()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.handle.launch_backward(grad)
        return grad.new_zeros(0), None


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread: a forward computed now is an
    activation-checkpointing recomputation."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class Overlapped:
    """A collective launched on ``x``; :meth:`wait` returns its (differentiable) result.

    ``overlap``: launch now, asynchronously (Duality Async Operations); otherwise the synchronous
    collective runs now. During a checkpoint recomputation (:func:`in_backward`) nothing is
    launched: the synchronous collective runs at :meth:`wait`, or never if the recomputation stops
    before it."""

    def __init__(self, x: torch.Tensor, forward: Start, backward: Start, sync: Callable[[torch.Tensor], torch.Tensor], overlap: bool):
        self._result: torch.Tensor | None = None
        self._token: torch.Tensor | None = None
        self._deferred: tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None = None
        if in_backward():
            self._deferred = (sync, x)
        elif overlap:
            self._handle = AsyncHandle(forward, backward)
            self._token = _Launch.apply(x, self._handle)
        else:
            self._result = sync(x)

    def wait(self) -> torch.Tensor:
        if self._token is not None:
            token, self._token = self._token, None
            return _Wait.apply(token, self._handle)
        if self._deferred is not None:
            (sync, x), self._deferred = self._deferred, None
            return sync(x)
        if self._result is None:
            raise RuntimeError("Overlapped.wait() called twice")
        out, self._result = self._result, None
        return out


def all_to_all_async(x: torch.Tensor, split_dim: int, cat_dim: int, g: DAPGroup) -> Overlapped:
    """:func:`~scalefold.distributed.primitives.all_to_all`, overlapped (backward: the reverse)."""
    return Overlapped(
        x,
        lambda t: P.start_all_to_all(t, split_dim, cat_dim, g, async_op=True),
        lambda t: P.start_all_to_all(t, cat_dim, split_dim, g, async_op=True),
        lambda t: P.all_to_all(t, split_dim, cat_dim, g),
        g.overlap,
    )


def gather_async(x: torch.Tensor, dim: int, g: DAPGroup, grad: str = "sum") -> Overlapped:
    """:func:`~scalefold.distributed.primitives.gather`, overlapped (backward: an async
    reduce-scatter for ``grad="sum"``, the local chunk for ``"split"``)."""
    if grad not in P.GATHER_GRADS:
        raise ValueError(f"gather grad must be one of {P.GATHER_GRADS}, got {grad!r}")
    if grad == "sum":
        backward = lambda t: P.start_reduce_scatter(t, dim, g, async_op=True)  # noqa: E731
    else:
        backward = lambda t: P.Pending(None, lambda: P.split_local(t, dim, g).contiguous())  # noqa: E731
    return Overlapped(
        x,
        lambda t: P.start_all_gather(t, dim, g, async_op=True),
        backward,
        lambda t: P.gather(t, dim, g, grad=grad),
        g.overlap,
    )


__all__ = ["AsyncHandle", "Overlapped", "all_to_all_async", "gather_async", "in_backward"]
