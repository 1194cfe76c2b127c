"""Collectives in the emulated capture as a GPU runs them: an output is valid only after its ``wait()``.

On NCCL a collective runs on the communicator's stream; ``Work.wait()`` makes the current stream wait for
it. A consumer that reads the output before the wait reads whatever the buffer held (a race the CPU never
shows: gloo on a CPU finishes most collectives at issue), and a collective never waited inside a capture
leaves its stream unjoined, so the capture fails (``cudaErrorStreamCaptureUnjoined``). The emulated capture
(:mod:`scalefold.compilation.emulated_capture`) keeps both rules:

* **recording**: each c10d operator's ``Work`` is noted with the line that issued it; its ``wait()`` becomes a
  node of the graph (:class:`WaitFor`) at the place the step waited. A collective still unwaited when the
  captured function returns is refused (:data:`NEVER_WAITED`), naming the line that issued it;
* **replay**: a collective runs on private copies of its buffers (:func:`issue`) and its outputs are
  **poisoned** (NaN, or the integer maximum) at issue; the results are written into the outputs at the
  ``WaitFor`` node. A consumer placed before the wait reads the poison, and the replay differs from eager.

By the c10d operators' schemas, the first argument holds the outputs (in place for ``allreduce_`` and
``broadcast_``) and the rest are inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: what a collective issued inside the region and not waited there is refused as
NEVER_WAITED = "a collective never waited inside the captured region (its stream never joins the capture)"


@dataclass
class WaitFor:
    """The node of a graph where the step waited for the collective of node ``issued``."""

    issued: int

    def complete(self, pending: dict[int, Pending]) -> None:
        pending.pop(self.issued).complete()


@dataclass
class Pending:
    """A collective in flight in a replay: its ``Work`` objects and ``(output, private copy)`` pairs."""

    works: list[Any] = field(default_factory=list)
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def complete(self) -> None:
        for work in self.works:
            work.wait()
        for real, private in self.outputs:
            real.copy_(private)


def work_of(out: Any) -> Any | None:
    """The ``torch.distributed.Work`` a c10d operator returned (as the step's Python sees it), or ``None``."""
    import torch.distributed as dist

    for x in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(x, torch.ScriptObject):
            return dist.Work.unbox(x)
    return None


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)


def _private(x: Any, outputs: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
    """``x`` with every tensor replaced by a copy of it (an output's pair noted in ``outputs``)."""
    if isinstance(x, torch.Tensor):
        copy = x.clone()
        if outputs is not None:
            outputs.append((x, copy))
        return copy
    if isinstance(x, (list, tuple)):
        return type(x)(_private(y, outputs) for y in x)
    return x


def _as_real(out: Any, real_of: dict[int, torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return real_of.get(id(out), out)
    if isinstance(out, (list, tuple)):
        return type(out)(_as_real(y, real_of) for y in out)
    return out


def issue(func: Any, args: list | tuple, kwargs: dict) -> tuple[Any, Pending]:
    """Run the collective ``func`` on private copies of its buffers, poison its outputs: ``(what it returns,
    with the real outputs in place of the copies; the pending completion)``."""
    pending = Pending()
    call = [_private(a, pending.outputs if i == 0 else None) for i, a in enumerate(args)]
    out = func(*call, **kwargs)
    for real, _ in pending.outputs:
        _poison(real)
    pending.works = [x for x in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(x, torch.ScriptObject)]
    return _as_real(out, {id(copy): real for real, copy in pending.outputs}), pending


__all__ = ["NEVER_WAITED", "Pending", "WaitFor", "issue", "work_of"]
