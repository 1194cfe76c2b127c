"""Data-parallel gradient reduction from the optimizer's flat gradient buffers (``--grad-reduce flat``).

DDP (``--grad-reduce ddp``, the reference) copies every gradient into buckets of its own, all-reduces
them from its C++ reducer with a Python communication hook and a future's callback (the clipping norm,
:mod:`scalefold.optim.clipping`), and copies the result back into ``.grad``; the DAP/BP gradient factors
are one tensor hook per parameter (:func:`scalefold.distributed.grad_sync.install_grad_scale_hooks`).
None of that can be captured in a CUDA graph. :class:`FlatGradReducer` does the same reduction on the
:class:`~scalefold.optim.adam_swa.FlatAdamSWA` flat gradient buffers themselves:

* **buckets** are slices (views) of the flat buffers, cut on parameter boundaries, of about
  :data:`BUCKET_BYTES`, in reverse parameter order (backward produces the last parameters' gradients
  first); together they tile every flat buffer, alignment padding included, exactly once
  (:func:`plan_buckets`);
* the **factor** of every element -- ``(dap if DAP-sharded) * (bp if branch-owned) / world_size`` -- is
  applied in place before the all-reduce, one ``mul_`` per contiguous run of equal factors (the runs are
  built once; a bucket of one factor is one ``mul_``), so the all-reduce is a plain sum. The factors are
  powers of two at power-of-two world sizes, so the values entering the sum are bit for bit DDP's
  (``g * s`` by the hook, then ``/ world_size`` by DDP's hook);
* every call is an in-place tensor collective on a preallocated buffer (``all_reduce`` of a view), with
  no host read and no Python future or callback -- capturable on NCCL;
* **when**: with ``overlap`` a ``register_post_accumulate_grad_hook`` per parameter counts the arrivals
  of each bucket on the host and issues the bucket once it is complete and every bucket before it has
  been issued (one order on every rank, as NCCL and gloo need); what backward did not complete (a
  Parallel Evoformer rank's unused branch, parameters without gradient) is issued after backward by
  :meth:`FlatGradReducer.reduce`. Without ``overlap`` (a CUDA graph's capture: the counting hooks are
  host Python, replays run none) :meth:`~FlatGradReducer.reduce` issues every bucket after backward;
* the **clipping norm** is then taken from the reduced buffers on the device
  (:meth:`~scalefold.optim.clipping.GradClipper.clip_flat_`).

The one dispatch point between the two is ``--grad-reduce`` (:func:`resolve_grad_reduce`); the Trainer
builds DDP or this reducer from it, and :class:`~scalefold.train.step.TrainingStep` calls whichever
``reduce`` it was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scalefold.config.training import GRAD_REDUCE_MODES
from scalefold.optim.adam_swa import FlatAdamSWA
from scalefold.optim.clipping import ClipResult, GradClipper

#: Bytes per bucket: DDP's default ``bucket_cap_mb`` (25 MiB), so both paths launch about as many
#: all-reduces and the comparison is like for like. On NCCL a 25 MiB all-reduce is past the size where the
#: ring reaches most of the link's bus bandwidth (the latency term is ~1 % of it on NVLink), while the
#: 93 M-parameter fp32 gradient (373 MB) still splits into ~15 buckets that backward can overlap; larger
#: buckets overlap less, smaller ones pay the per-call latency more often.
BUCKET_BYTES = 25 * 2**20

#: ``--grad-reduce auto``'s verdict for eager steps: whether the flat path, overlapped with backward, was
#: measured as fast as DDP's eager overlap. Measured (``bench/flat_reduce.py``, bench/RESULTS.md; gloo, DP-2,
#: 2-core CPU): never slower -- flat / DDP, median of the per-round ratios: whole step 0.95 (tiny), 0.98 (demo),
#: backward + reduction 1.00 / 0.96, reduction-bound at the MLPerf layout 0.87 -- with 2 operators per bucket
#: where DDP adds ~3 per parameter (its copies in and out of its buckets). A graphed step always takes the flat
#: path (DDP cannot be captured). Not yet measured on NCCL.
FLAT_AS_FAST_AS_DDP = True


def resolve_grad_reduce(mode: str, world_size: int, graphed: bool = False) -> str:
    """The path of ``--grad-reduce mode`` for ``world_size`` training ranks: ``"ddp"`` or ``"flat"``;
    ``"local"`` for one rank (nothing to reduce). A ``graphed`` step (``--cuda-graphs step``) always takes the
    flat path, whatever ``mode`` says: DDP's reducer cannot be captured (:func:`graphed_reduce_line` says so in
    one line). ``auto``: the flat path where it is as fast as DDP (:data:`FLAT_AS_FAST_AS_DDP`); else DDP. The
    default ``ddp`` of eager runs (the deterministic runs) is unchanged."""
    if mode not in GRAD_REDUCE_MODES:
        raise ValueError(f"unknown grad_reduce mode {mode!r}; expected one of {GRAD_REDUCE_MODES}")
    if world_size <= 1:
        return "local"
    if graphed:
        return "flat"
    if mode == "auto":
        return "flat" if FLAT_AS_FAST_AS_DDP else "ddp"
    return mode


def graphed_reduce_line(mode: str, world_size: int) -> str | None:
    """The one line a run prints where ``--cuda-graphs step`` chose the gradient reduction for it (``mode``, on
    ``world_size`` > 1 training ranks, would have taken DDP's); None where the graph changed nothing."""
    if world_size <= 1 or resolve_grad_reduce(mode, world_size) == "flat":
        return None
    return (f"scalefold train: --cuda-graphs step with {world_size} training ranks: the gradient all-reduce is the "
            f"flat one (--grad-reduce flat, captured inside the graph; --grad-reduce {mode} would use DDP's reducer, "
            "which a CUDA graph cannot hold)")


@dataclass(frozen=True, eq=False)
class Bucket:
    """One all-reduce: ``view`` is ``opt.groups[group].grad[start:stop]``; ``runs`` the ``(start, stop,
    factor)`` of its contiguous runs of one factor, relative to the view; ``params`` the optimizer's
    parameter indices whose gradients lie inside."""

    group: int
    start: int
    stop: int
    view: torch.Tensor
    runs: tuple[tuple[int, int, float], ...]
    params: tuple[int, ...]

    def __post_init__(self) -> None:
        # the runs' views, built once: issuing a bucket slices nothing (one mul_ per run that is not x 1)
        scaled = tuple((self.view if (a, b) == (0, self.view.numel()) else self.view[a:b], f)
                       for a, b, f in self.runs if f != 1.0)  # fmt: skip
        object.__setattr__(self, "scaled", scaled)


def _runs(bounds: Sequence[tuple[int, int, float]]) -> tuple[tuple[int, int, float], ...]:
    """Adjacent ``(start, stop, factor)`` spans of one factor merged."""
    merged: list[list] = []
    for start, stop, factor in bounds:
        if merged and merged[-1][2] == factor and merged[-1][1] == start:
            merged[-1][1] = stop
        else:
            merged.append([start, stop, factor])
    return tuple((a, b, f) for a, b, f in merged)


def plan_buckets(opt: FlatAdamSWA, factors: Sequence[float], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Buckets tiling each flat gradient buffer of ``opt`` (``factors``: each parameter's, in the optimizer's
    order): parameters taken from the buffer's end, a bucket closed once it holds ``bucket_bytes``; a
    parameter (and the padding after it) is never split."""
    buckets: list[Bucket] = []
    for g, group in enumerate(opt.groups):
        total, itemsize = group.grad.numel(), group.grad.element_size()
        # each parameter's span runs to the next one's offset (its alignment padding included)
        spans = [(o, (group.offsets[k + 1] if k + 1 < len(group.offsets) else total), i)
                 for k, (o, i) in enumerate(zip(group.offsets, group.indices))]  # fmt: skip
        members: list[tuple[int, int, int]] = []
        for span in reversed(spans):
            members.append(span)
            if (members[0][1] - span[0]) * itemsize >= bucket_bytes or span is spans[0]:
                start, stop = span[0], members[0][1]
                runs = _runs([(a - start, b - start, factors[i]) for a, b, i in reversed(members)])
                buckets.append(Bucket(group=g, start=start, stop=stop, view=group.grad[start:stop], runs=runs,
                                      params=tuple(i for _, _, i in members)))  # fmt: skip
                members = []
    return buckets


class FlatGradReducer:
    """The gradient average over ``process_group`` on ``opt``'s flat gradient buffers, DAP/BP factors fused.

    Args:
        opt: the optimizer whose flat ``grad`` buffers hold the gradients (``.grad`` are views of them).
        process_group: the training ranks (``None``: the default group).
        scales: ``{parameter: factor}`` of the parameters whose factor is not 1 (the DAP/BP gradient
            factors, :func:`scalefold.distributed.grad_sync.grad_scales`); the model must then carry no
            factor hooks of its own (``ParallelContext.wrap(model, grad_hooks=False)``).
        overlap: issue buckets from backward as they fill (counting hooks); else all after backward.
        bucket_bytes: bytes per bucket (:data:`BUCKET_BYTES`).
    """

    def __init__(self, opt: FlatAdamSWA, process_group: dist.ProcessGroup | None = None,
                 scales: Mapping[nn.Parameter, float] | None = None, *, overlap: bool = True,
                 bucket_bytes: int = BUCKET_BYTES) -> None:  # fmt: skip
        self.opt, self.group = opt, process_group
        self.world_size = dist.get_world_size(process_group)
        scales = scales or {}
        known = {id(p) for p in opt.params} | {id(p) for p in (opt.compute_params or ())}
        unknown = [p for p in scales if id(p) not in known]
        if unknown:
            raise ValueError(f"{len(unknown)} scaled parameter(s) are not optimised by this optimizer")
        by_id = {id(p): float(s) for p, s in scales.items()}
        factors = [by_id.get(id(p), 1.0) / self.world_size for p in opt.params]
        self.buckets = plan_buckets(opt, factors, bucket_bytes)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.params}
        holders = opt.compute_params if opt.compute_params is not None else opt.params
        self._holders = holders
        self._expected = [sum(1 for i in bucket.params if holders[i].requires_grad) for bucket in self.buckets]
        self._handles: list[Any] = []
        self._works: list[Any] = []
        self.issued_in_backward = 0
        self._reset()
        self.overlap = False
        self.set_overlap(overlap)

    # -- layout ------------------------------------------------------------------------------------

    @property
    def launches(self) -> dict[str, int]:
        """Calls one reduction makes: ``all_reduce`` (one per bucket) and ``scale`` (one ``mul_`` per run of a
        factor not 1)."""
        return {"all_reduce": len(self.buckets), "scale": sum(len(b.scaled) for b in self.buckets)}

    def describe(self) -> str:
        """One line for the start-up log."""
        n = self.launches
        when = "issued as backward fills them" if self.overlap else "after backward"
        return (f"flat gradient buffers, {n['all_reduce']} bucket(s) of <= {BUCKET_BYTES >> 20} MiB over "
                f"{self.world_size} rank(s), {when}; {n['scale']} scale run(s)")

    def set_overlap(self, overlap: bool) -> None:
        """Issue buckets from backward's gradient-ready hooks (``True``) or all after backward (``False``:
        what a CUDA graph captures, since its replays run no Python hook)."""
        if overlap == self.overlap:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if overlap:
            for i, holder in enumerate(self._holders):
                if holder.requires_grad:
                    self._handles.append(holder.register_post_accumulate_grad_hook(
                        lambda _p, i=i: self._arrived(i)))  # fmt: skip
        self.overlap = overlap

    # -- one step -----------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._pending = list(self._expected)
        self._next = 0
        self._arrivals: set[int] = set()
        self._late: list[int] = []

    def _arrived(self, i: int) -> None:
        """A parameter's gradient is complete (backward's hook, host side): issue what is ready, in order."""
        b = self._bucket_of[i]
        if i in self._arrivals or b < self._next:  # accumulated again, or after its bucket went out
            self._late.append(i)
            return
        self._arrivals.add(i)
        self._pending[b] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._issue(self._next)

    def _issue(self, b: int) -> None:
        bucket = self.buckets[b]
        for view, factor in bucket.scaled:
            view.mul_(factor)
        self._works.append(dist.all_reduce(bucket.view, group=self.group, async_op=True))
        self._next = b + 1

    @torch.no_grad()
    def reduce(self) -> None:
        """After backward: issue every bucket not issued yet (in order) and wait for all of them (on NCCL
        the wait is the stream's, on the device). The flat buffers then hold the averaged gradient."""
        self.issued_in_backward = self._next  # buckets the hooks issued before backward returned (diagnostics)
        while self._next < len(self.buckets):
            self._issue(self._next)
        works, late = self._works, self._late
        self._works = []
        self._reset()
        for work in works:
            work.wait()
        if late:
            names = ", ".join(self.opt.names[i] for i in late[:3])
            raise RuntimeError(f"gradient of {names} arrived after its bucket was reduced (a parameter used by two "
                               "backward passes?): use --grad-reduce ddp, or the flat path without overlap")  # fmt: skip

    def reduce_and_clip(self, clipper: GradClipper) -> ClipResult:
        """:meth:`reduce`, then the global norm and clip scale of the reduced buffers (on the device)."""
        self.reduce()
        return clipper.clip_flat_(self.opt.grad_buffers())

    @torch.no_grad()
    def broadcast_parameters(self, src: int = 0) -> None:
        """The weights of the group's rank ``src`` on every rank (as DDP's construction does): one broadcast
        per flat master buffer, then the compute copy rewritten from it."""
        root = dist.get_global_rank(self.group, src) if self.group is not None else src
        for group in self.opt.groups:
            dist.broadcast(group.master, src=root, group=self.group)
        self.opt.sync_compute_from_master()

    def close(self) -> None:
        """Remove the gradient-ready hooks."""
        self.set_overlap(False)


__all__ = ["BUCKET_BYTES", "Bucket", "FlatGradReducer", "graphed_reduce_line", "plan_buckets", "resolve_grad_reduce"]
