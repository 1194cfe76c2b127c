"""Host synchronisations inside a region (the training step), counted on any device.

A host read -- ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``, a device-to-host copy,
``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``, ... -- makes the host wait for the
device (on CUDA: the queue of launched kernels drains) and cannot be captured in a CUDA graph. On a CPU
nothing waits, but the same calls are made, so they can be counted here and kept out of the step by a
test on any machine.

:class:`HostSyncCounter` runs the region under a ``TorchDispatchMode`` (which sees
``aten._local_scalar_dense`` -- what ``.item()``, ``float()``, ``bool()`` and ``int()`` of a tensor
reduce to --, the data-dependent-shape operators, and copies whose source is on a device and whose
destination is the host) and a ``TorchFunctionMode`` (which sees ``Tensor.tolist`` / ``Tensor.numpy`` /
``__array__``: they read the storage without dispatching an operator). Each event is recorded with the
innermost ``scalefold`` source line that made it, so a count of 1 says where to look.

Reads that only the CPU makes are reported apart (:attr:`HostSyncReport.cpu_only`), not counted: what
PyTorch or ScaleFold does on a CPU tensor and skips on a device -- ``F.one_hot``'s class-range check
(``min()`` / ``max()`` read back on CPU only; CUDA relies on the scatter's device assert), and the CPU
reference Adam's Python-float step size (:data:`CPU_ONLY_SITES`, kept for bit-identity with
``torch.optim.Adam`` on CPU; on a device it stays a tensor). A read of a device tensor there counts.

Modes are thread-local: work the autograd engine runs on its own device threads (CUDA backward) is not
seen; on the CPU, backward runs on the calling thread and is counted.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
#: operators whose result the host must read (a scalar) or whose output shape depends on the data
SYNC_OPS = {
    _aten._local_scalar_dense.default: "item",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.is_nonzero.default: "is_nonzero",
    _aten.equal.default: "equal",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
}
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}
_HOST_READ_METHODS = {"tolist", "numpy", "__array__"}
#: (module path, function) whose reads of CPU tensors happen on the CPU only, and why
CPU_ONLY_SITES = {
    ("scalefold/kernels/reference.py", "adam_swa_"): "the CPU reference Adam passes its step size as a Python float "
    "(bit-identity with torch.optim.Adam on CPU); on a device it stays a tensor",
}
#: functions whose reads of CPU tensors are CPU-only (PyTorch skips them on CUDA)
_CPU_ONLY_FUNCTIONS = {"one_hot"}
_PACKAGE = Path(__file__).resolve().parents[1]


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


def _site() -> tuple[str, int, str] | None:
    """(path relative to the repository, line, function) of the innermost ``scalefold`` frame outside this module."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path != here and path.is_relative_to(_PACKAGE):
            return path.relative_to(_PACKAGE.parent).as_posix(), frame.lineno or 0, frame.name
    return None


def _record(report: HostSyncReport, kind: str, on_cpu: bool) -> None:
    site = _site()
    event = HostSyncEvent(kind, f"{site[0]}:{site[1]} ({site[2]})" if site else "")
    cpu_only = on_cpu and (report._cpu_only_depth > 0 or (site is not None and (site[0], site[2]) in CPU_ONLY_SITES))
    (report.cpu_only if cpu_only else report.events).append(event)


def _on_cpu(args: tuple) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _device_to_host(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """A copy from a non-CPU tensor into host memory."""
    if func not in _COPY_OPS or not args or not isinstance(args[0], torch.Tensor):
        return False
    if func is _aten.copy_.default:  # copy_(dst, src)
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    else:
        dst, src = out, args[0]
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type not in ("cpu", "meta")
            and dst.device.type == "cpu")  # fmt: skip


def _mask_index(func: Any, args: tuple) -> bool:
    """``t[mask]`` with a boolean mask (its output shape is the mask's count)."""
    if func is not _aten.index.Tensor or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


class _Dispatch(TorchDispatchMode):
    def __init__(self, report: HostSyncReport) -> None:
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = SYNC_OPS.get(func)
        if kind is None and _mask_index(func, args):
            kind = "mask_index"
        if kind is None and _device_to_host(func, args, kwargs, out):
            kind = "device_to_host"
        if kind is not None:
            _record(self.report, kind, kind != "device_to_host" and _on_cpu(args))
        return out


class _Function(TorchFunctionMode):
    def __init__(self, report: HostSyncReport) -> None:
        super().__init__()
        self.report = report

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        if name in _HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor):
            _record(self.report, name, False)  # tolist / numpy of a CPU tensor in the step is a read all the same
        if name in _CPU_ONLY_FUNCTIONS and _on_cpu(args[:1]):
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
