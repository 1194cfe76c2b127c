"""Gradients produced where they live: each block's parameter gradients written into their slots of the
optimizer's flat gradient buffer by the block's own backward, without autograd's accumulation kernel per
parameter.

:class:`~scalefold.optim.adam_swa.FlatAdamSWA` keeps every ``.grad`` a view of one flat buffer; autograd's
``AccumulateGrad`` then adds each parameter's gradient into its view -- one ``add_`` launch per parameter per
step (5,047 of the MLPerf step's launches), reading and writing every gradient once more. The model already
takes each block's ``Linear`` weights through one autograd node
(:class:`scalefold.model.primitives.WeightCasts`: the block's weights cast to bf16 together under autocast, or,
without a cast, handed through as they are), and its ``LayerNorm`` weights through another (never cast). With :func:`attach_grad_slots` that node's backward writes the
block's gradients into the buffer itself: the gradients in buffer order, with zeros over the gaps between them
(alignment padding, a LayerNorm's slots: adding zero leaves them as they are), concatenated and added into the
buffer's span in **one** ``add_`` per run of nearby slots (the cast back to fp32 fused into the add), and hands
autograd no gradient for them (``AccumulateGrad`` then adds nothing; the parameters' post-accumulate hooks --
:class:`~scalefold.optim.flat_reduce.FlatGradReducer`'s arrivals, DDP's readiness -- still run, after the write).

The values are autograd's own: the buffer is zero before backward and ``0 + g`` is ``g``, so every gradient is
bit for bit what ``AccumulateGrad`` wrote (``tests/optim/test_grad_slots.py``: fp32 and fp64 steps, bf16
autocast; with DDP and the flat reducer). A group falls back to autograd's accumulation (the slow path) where
a member is not in the flat buffer (a parameter the optimizer does not hold, a module added later), carries a
tensor hook (the DAP/BP gradient factors of ``--grad-reduce ddp``), or its ``.grad`` is no longer the buffer's
view, and hands its gradients to autograd where this backward does not write ``.grad`` (``torch.autograd.grad``,
``backward(inputs=...)`` without them); parameters outside the model's groups (a user's own module, the few that are neither a ``Linear``'s nor a
``LayerNorm``'s) always take it.
:func:`attach_grad_slots` says so in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

#: Slots further apart than this many elements start a new run (one ``add_`` each) instead of adding zeros over
#: the gap: alignment padding (< 32) and a LayerNorm's weight and bias lie well inside it.
MAX_GAP_NUMEL = 1 << 14


@dataclass(eq=False)
class SlotPlan:
    """Where one group's gradients go: ``runs`` of ``(buffer span, pieces)``, each piece a member's index or
    ``-n`` for ``n`` zeros over a gap, in buffer order."""

    slots: GradSlots
    members: tuple[torch.Tensor, ...]
    views: tuple[torch.Tensor, ...]  # each member's ``.grad`` as the optimizer attached it
    runs: tuple[tuple[torch.Tensor, tuple[int, ...]], ...]
    #: several runs in one flat buffer (a block's LayerNorm weights, spread between its Linear weights): the
    #: buffer's span from the first slot to the last and every member's element indices in it, in member order,
    #: for one ``index_add_`` of them all
    scattered: tuple[torch.Tensor, torch.Tensor] | None = None
    accumulator: object = None  # the first member's AccumulateGrad node

    def __post_init__(self) -> None:
        with torch.enable_grad():
            self.accumulator = self.members[0].view_as(self.members[0]).grad_fn.next_functions[0][0]

    def _into_grad(self) -> bool:
        """Whether this backward accumulates into ``.grad`` (not ``torch.autograd.grad``, which must leave it as
        it is, nor ``backward(inputs=...)`` leaving this group out)."""
        try:
            return torch._C._will_engine_execute_node(self.accumulator)
        except RuntimeError:  # asked inside torch.autograd.grad: the gradients go to its caller
            return False

    def write(self, grads: Sequence[torch.Tensor]) -> bool:
        """Add ``grads`` (the members', in member order) into their slots; False (nothing written) where the
        group must take autograd's accumulation instead."""
        for p, view in zip(self.members, self.views):
            if p.grad is not view or p._backward_hooks:
                return False
        if not self._into_grad():
            return False
        with torch.no_grad():
            if self.scattered is not None and grads[0].dtype == self.scattered[0].dtype:
                buffer, index = self.scattered  # each element once: the same one rounding as add_
                buffer.index_add_(0, index, torch.cat([g.reshape(-1) for g in grads]))
                return True
            for span, pieces in self.runs:
                parts = [grads[k].reshape(-1) if k >= 0 else self.slots.zeros(grads[0], -k) for k in pieces]
                span.add_(parts[0] if len(parts) == 1 else torch.cat(parts))
        return True


class GradSlots:
    """Every gradient holder's slot in ``opt``'s flat gradient buffers, and the plans of the groups asking for
    them (built once per group)."""

    def __init__(self, opt: object) -> None:
        holders = opt._grad_holders()
        self.names = {id(holders[i]): opt.names[i] for i in range(len(holders))}
        self._slot: dict[int, tuple[int, int, int]] = {}  # id -> (flat group, offset, numel)
        self._views: dict[int, torch.Tensor] = {}
        self._buffers = [group.grad for group in opt.groups]
        for g, group in enumerate(opt.groups):
            for i, offset in zip(group.indices, group.offsets):
                self._slot[id(holders[i])] = (g, offset, holders[i].numel())
                self._views[id(holders[i])] = holders[i].grad
        self._plans: dict[tuple[int, ...], SlotPlan | None] = {}
        self._zeros: dict[tuple, torch.Tensor] = {}
        self.fallbacks: list[str] = []  # groups found outside the buffer (names of their first member)

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient has a slot here."""
        return id(p) in self._slot

    def plan(self, members: Sequence[torch.Tensor]) -> SlotPlan | None:
        """The plan of the group ``members`` (one autograd node's parameters), or None where one of them has no
        slot (the group then takes autograd's accumulation)."""
        key = tuple(id(p) for p in members)
        if key in self._plans:
            return self._plans[key]
        plan = None
        if all(id(p) in self._slot and p.requires_grad for p in members):
            runs = self._runs(members)
            plan = SlotPlan(self, tuple(members), tuple(self._views[id(p)] for p in members), runs,
                            self._scattered(members) if len(runs) > 1 else None)  # fmt: skip
        else:
            missing = next(p for p in members if id(p) not in self._slot or not p.requires_grad)
            self.fallbacks.append(self.names.get(id(missing), f"a {tuple(missing.shape)} parameter outside the optimizer"))
        self._plans[key] = plan
        return plan

    def _runs(self, members: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, tuple[int, ...]], ...]:
        order = sorted(range(len(members)), key=lambda k: self._slot[id(members[k])][:2])
        runs: list[list] = []  # [flat group, start, end, pieces]
        for k in order:
            g, offset, numel = self._slot[id(members[k])]
            if runs and runs[-1][0] == g and 0 <= offset - runs[-1][2] <= MAX_GAP_NUMEL:
                if offset > runs[-1][2]:
                    runs[-1][3].append(runs[-1][2] - offset)  # zeros over the gap
                runs[-1][2] = offset + numel
                runs[-1][3].append(k)
            else:
                runs.append([g, offset, offset + numel, [k]])
        return tuple((self._buffers[g][start:end], tuple(pieces)) for g, start, end, pieces in runs)

    def _scattered(self, members: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(span, index) of ``members`` in one flat buffer, or None where they lie in several. The index is made
        once, from host memory (no kernel in the step that first asks for it)."""
        slots = [self._slot[id(p)] for p in members]
        if len({g for g, _, _ in slots}) != 1:
            return None
        start, stop = min(o for _, o, _ in slots), max(o + n for _, o, n in slots)
        span = self._buffers[slots[0][0]][start:stop]
        index = np.concatenate([np.arange(o - start, o - start + n, dtype=np.int64) for _, o, n in slots])
        return span, torch.from_numpy(index).to(span.device)

    def zeros(self, like: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` (<= :data:`MAX_GAP_NUMEL`) zeros of ``like``'s dtype and device: one buffer per dtype and device,
        made once (no fill per gap)."""
        key = (like.dtype, like.device, type(like))
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = torch.zeros(MAX_GAP_NUMEL, dtype=like.dtype, device=like.device)
        return z[:n]


def weight_cast_sets(model: nn.Module) -> list[object]:
    """The distinct :class:`~scalefold.model.primitives.WeightCasts` of ``model``'s ``Linear`` layers."""
    found: dict[int, object] = {}
    for m in model.modules():
        casts = getattr(m, "weight_casts", None)
        if casts is not None:
            found[id(casts)] = casts
    return list(found.values())


def attach_grad_slots(model: nn.Module, opt: object, report: Callable[[str], None] | None = None) -> GradSlots | None:
    """Make ``model``'s weight groups write their gradients into ``opt``'s flat buffer (see the module's
    docstring); ``report``: called with one line saying how many parameters take the slow path. Returns the
    slots, or None where the model has no weight groups (every gradient then takes autograd's accumulation)."""
    sets = weight_cast_sets(model)
    slots = GradSlots(opt)
    for casts in sets:
        casts.slots = slots
    grouped = {id(p) for casts in sets for p in casts.grouped_parameters()}
    holders = opt._grad_holders()
    slow = [opt.names[i] for i, h in enumerate(holders) if h.requires_grad and id(h) not in grouped]
    if report is not None:
        total = sum(1 for h in holders if h.requires_grad)
        line = (f"gradients: {total - len(slow):,} of {total:,} parameters written into the flat buffer by their "
                f"block's backward")  # fmt: skip
        if slow:
            line += (f"; {len(slow):,} take{'s' if len(slow) == 1 else ''} autograd's accumulation (the slow path: one add_ each), e.g. "
                     f"{', '.join(slow[:3])}")  # fmt: skip
        report(line)
    return slots if sets else None


__all__ = ["MAX_GAP_NUMEL", "GradSlots", "SlotPlan", "attach_grad_slots", "weight_cast_sets"]
