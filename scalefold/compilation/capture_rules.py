"""What a CUDA-graph capture refuses, as rules any device can check (``../shared/docs/kernels.md``).

A stream capture records kernels and replays them without running Python. It refuses what would make
the host wait for the device or copy host data to it, and it cannot replay what the host decides while
capturing. The rules the training step must keep, each with the operators (or Python calls) that
break it:

* **no device-to-host read** -- ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``,
  ``int(t)``), ``equal`` / ``is_nonzero``, the data-dependent-shape operators (``nonzero``,
  ``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``),
  copies from a device into host memory, and ``Tensor.tolist`` / ``numpy`` / ``__array__`` (which read
  the storage without dispatching an operator: seen by a ``TorchFunctionMode``);
* **no host-to-device copy of Python data** -- ``aten.lift_fresh`` / ``lift_fresh_copy``: what
  ``torch.tensor(list)``, ``x.new_tensor(list)`` and ``torch.as_tensor(list)`` dispatch (a pageable copy
  on CUDA); build such tables once per device and dtype, outside the step;
* **no random-number-generator state read or set** -- ``torch.get_rng_state`` / ``set_rng_state`` /
  ``manual_seed`` / ``seed`` and their ``torch.cuda`` twins (``torch.utils.checkpoint`` calls them when it
  preserves the RNG state); a draw from the default generator is fine (a replay advances it).

Reads that only a CPU makes are not the step's own (PyTorch skips them on CUDA): ``F.one_hot``'s
class-range check (``min()`` / ``max()`` read back on the CPU only; CUDA relies on the scatter's device
assert). :mod:`scalefold.perf.host_syncs` counts host reads with these rules;
:mod:`scalefold.compilation.emulated_capture` refuses them while it captures a step on the CPU.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

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
#: operators that copy Python (host) data into a new tensor: a pageable host-to-device copy on CUDA
HOST_TO_DEVICE_OPS = {
    _aten.lift_fresh.default: "host_to_device",
    _aten.lift_fresh_copy.default: "host_to_device",
}
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}
#: ``Tensor`` methods that read the storage on the host without dispatching an operator
HOST_READ_METHODS = {"tolist", "numpy", "__array__"}
#: functions whose reads of CPU tensors are CPU-only (PyTorch skips them on CUDA)
CPU_ONLY_FUNCTIONS = {"one_hot"}
#: the generator-state calls a capture refuses: ``(module, attribute)``
RNG_STATE_CALLS = (
    ("torch", "get_rng_state"), ("torch", "set_rng_state"), ("torch", "manual_seed"), ("torch", "seed"),
    ("torch.random", "get_rng_state"), ("torch.random", "set_rng_state"), ("torch.random", "manual_seed"),
    ("torch.random", "seed"),
    ("torch.cuda", "get_rng_state"), ("torch.cuda", "set_rng_state"), ("torch.cuda", "get_rng_state_all"),
    ("torch.cuda", "set_rng_state_all"), ("torch.cuda", "manual_seed"), ("torch.cuda", "manual_seed_all"),
    ("torch.cuda", "synchronize"),
)  # fmt: skip
_PACKAGE = Path(__file__).resolve().parents[1]


def site(skip: frozenset[Path] = frozenset()) -> tuple[str, int, str] | None:
    """(path relative to the repository, line, function) of the innermost ``scalefold`` frame of the
    current stack outside this module and ``skip``, or ``None``."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path != here and path not in skip and path.is_relative_to(_PACKAGE):
            return path.relative_to(_PACKAGE.parent).as_posix(), frame.lineno or 0, frame.name
    return None


def format_site(where: tuple[str, int, str] | None) -> str:
    return f"{where[0]}:{where[1]} ({where[2]})" if where else ""


def on_cpu(args: tuple) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def device_to_host(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """A copy from a non-CPU tensor into host memory."""
    if func not in _COPY_OPS or not args or not isinstance(args[0], torch.Tensor):
        return False
    if func is _aten.copy_.default:  # copy_(dst, src)
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    else:
        dst, src = out, args[0]
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type not in ("cpu", "meta")
            and dst.device.type == "cpu")  # fmt: skip


def mask_index(func: Any, args: tuple) -> bool:
    """``t[mask]`` with a boolean mask (its output shape is the mask's count)."""
    if func is not _aten.index.Tensor or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


def unsized_repeat_interleave(func: Any, kwargs: dict, args: tuple) -> bool:
    """``repeat_interleave(repeats_tensor)`` without ``output_size``: its length is read from the data."""
    if func is not _aten.repeat_interleave.Tensor:
        return False
    return (kwargs.get("output_size") if "output_size" in kwargs else (args[1] if len(args) > 1 else None)) is None


def host_read(func: Any, args: tuple, kwargs: dict, out: Any = None) -> str | None:
    """The kind of device-to-host read ``func(*args, **kwargs)`` makes, or ``None``."""
    kind = SYNC_OPS.get(func)
    if kind is None and mask_index(func, args):
        kind = "mask_index"
    if kind is None and unsized_repeat_interleave(func, kwargs, args):
        kind = "repeat_interleave"
    if kind is None and out is not None and device_to_host(func, args, kwargs, out):
        kind = "device_to_host"
    return kind


__all__ = [
    "CPU_ONLY_FUNCTIONS", "HOST_READ_METHODS", "HOST_TO_DEVICE_OPS", "RNG_STATE_CALLS", "SYNC_OPS", "device_to_host",
    "format_site", "host_read", "mask_index", "on_cpu", "site", "unsized_repeat_interleave",
]  # fmt: skip
