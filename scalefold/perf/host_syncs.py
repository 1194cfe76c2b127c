"""Host synchronisations inside a region (the training step), counted on any device.

A host read -- ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``, a device-to-host copy,
``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``, ... -- makes the host wait for the
device (on CUDA: the queue of launched kernels drains) and cannot be captured in a CUDA graph. On a CPU
nothing waits, but the same calls are made, so they can be counted here and kept out of the step by a
test on any machine. The rules are :mod:`scalefold.compilation.capture_rules`' (the emulated capture
refuses the same reads).

:class:`HostSyncCounter` runs the region under a ``TorchDispatchMode`` (which sees
``aten._local_scalar_dense`` -- what ``.item()``, ``float()``, ``bool()`` and ``int()`` of a tensor
reduce to --, the data-dependent-shape operators, and copies whose source is on a device and whose
destination is the host) and a ``TorchFunctionMode`` (which sees ``Tensor.tolist`` / ``Tensor.numpy`` /
``__array__``: they read the storage without dispatching an operator). Each event is recorded with the
innermost ``scalefold`` source line that made it, so a count of 1 says where to look.

Reads that only the CPU makes are reported apart (:attr:`HostSyncReport.cpu_only`), not counted: what
PyTorch or ScaleFold does on a CPU tensor and skips on a device -- ``F.one_hot``'s class-range check
(``min()`` / ``max()`` read back on CPU only; CUDA relies on the scatter's device assert), and any site
listed in :data:`CPU_ONLY_SITES` (none now: the CPU reference Adam's step size stays a tensor, bit for bit
``torch.optim.Adam``'s host-float update). A read of a device tensor there counts.

Modes are thread-local: work the autograd engine runs on its own device threads (CUDA backward) is not
seen; on the CPU, backward runs on the calling thread and is counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from scalefold.compilation.capture_rules import CPU_ONLY_FUNCTIONS, HOST_READ_METHODS, SYNC_OPS, format_site, host_read
from scalefold.compilation.capture_rules import on_cpu as _on_cpu
from scalefold.compilation.capture_rules import site as _rules_site

#: (module path, function) whose reads of CPU tensors happen on the CPU only, and why (none left: the CPU
#: reference Adam keeps its step size in a tensor, bit-identical to torch.optim.Adam's host float)
CPU_ONLY_SITES: dict[tuple[str, str], str] = {}
_HERE = frozenset({Path(__file__).resolve()})


@dataclass
class HostSyncEvent:
    kind: str  # item, nonzero, device_to_host, tolist, mask_index, ...
    where: str  # innermost scalefold source line outside this module, or ""


@dataclass
class HostSyncReport:
    events: list[HostSyncEvent] = field(default_factory=list)  # host reads a device would make too
    cpu_only: list[HostSyncEvent] = field(default_factory=list)  # reads made on the CPU only (not counted)
    _cpu_only_depth: int = 0

    @property
    def count(self) -> int:
        return len(self.events)

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(e.kind for e in self.events))

    def by_place(self) -> dict[str, int]:
        return dict(Counter(f"{e.kind} at {e.where or '?'}" for e in self.events))


def _record(report: HostSyncReport, kind: str, on_cpu: bool) -> None:
    site = _rules_site(_HERE)
    event = HostSyncEvent(kind, format_site(site))
    cpu_only = on_cpu and (report._cpu_only_depth > 0 or (site is not None and (site[0], site[2]) in CPU_ONLY_SITES))
    (report.cpu_only if cpu_only else report.events).append(event)


class _Dispatch(TorchDispatchMode):
    def __init__(self, report: HostSyncReport) -> None:
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = host_read(func, args, kwargs, out)
        if kind is not None:
            _record(self.report, kind, kind != "device_to_host" and _on_cpu(args))
        return out


class _Function(TorchFunctionMode):
    def __init__(self, report: HostSyncReport) -> None:
        super().__init__()
        self.report = report

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor):
            _record(self.report, name, False)  # tolist / numpy of a CPU tensor in the step is a read all the same
        if name in CPU_ONLY_FUNCTIONS and _on_cpu(args[:1]):
            self.report._cpu_only_depth += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.report._cpu_only_depth -= 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter() as c: step()`` -- then ``c.report.count`` host reads, ``c.report.by_place()``."""

    def __init__(self) -> None:
        self.report = HostSyncReport()
        self._modes: list[Any] = []

    def __enter__(self) -> HostSyncCounter:
        self._modes = [_Function(self.report), _Dispatch(self.report)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    @property
    def count(self) -> int:
        return self.report.count


def count_host_syncs(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, HostSyncReport]:
    """``(fn(*args, **kwargs), report)``: the host reads ``fn`` made."""
    with HostSyncCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter.report


__all__ = ["HostSyncCounter", "HostSyncEvent", "HostSyncReport", "SYNC_OPS", "count_host_syncs"]
