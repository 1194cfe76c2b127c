"""What a CUDA-graph capture refuses, as rules any device can check (``../shared/docs/kernels.md``).

A stream capture records kernels and replays them without running Python. It refuses whatever makes the
host wait for the device (a read of a device value, a synchronisation: ``cudaMemcpy`` to pageable memory,
``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` / ``Query`` fail with
``cudaErrorStreamCaptureUnsupported`` and invalidate the capture) or copies host data to the device, and it
cannot replay what the host decides while capturing. Each :class:`Rule` of :data:`RULES` names such an
operation, why a capture refuses it and where PyTorch says so (its documentation, which says "synchronizes
with the CPU" / "causes host-device synchronization", or its CUDA sources), and how it is seen:

* ``ops`` -- ATen operators, seen by a ``TorchDispatchMode`` (with a ``when`` condition on the arguments
  where only some calls sync: a boolean index, ``check_errors=True``, no ``output_size``);
* ``functions`` -- Python-level calls that dispatch no operator of their own (``Tensor.tolist``, ``.cpu()`` on
  the emulated device, ``F.one_hot`` without ``num_classes``, whose CPU kernel reads on the CPU either way),
  seen by a ``TorchFunctionMode``;
* ``calls`` -- module functions that touch no tensor (the generator-state calls, the synchronisations, a
  barrier), replaced for the duration of a capture.

Reads that only a CPU makes are not the step's own (PyTorch skips them on CUDA): ``F.one_hot``'s class-range
check with ``num_classes`` given (``min()`` / ``max()`` read back on the CPU only; CUDA relies on the
scatter's device assert). :mod:`scalefold.perf.host_syncs` counts the host reads of these rules (category
``read``); :mod:`scalefold.compilation.emulated_capture` refuses every rule while it captures a step on the
CPU. ``tests/compilation/test_capture_rules.py`` plants each rule's operation in a captured function and
shows that the planted call escapes once the rule is removed (:func:`without`): no rule is dead.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_aten = torch.ops.aten
_DOCS = "https://pytorch.org/docs/stable/"
_SRC = "pytorch aten/src/ATen/native/"


@dataclass(frozen=True)
class Rule:
    """One thing a capture refuses: ``what`` (the refusal's words), ``why`` a CUDA capture refuses it, the
    ``source`` that says so, the ``category`` (``read`` device-to-host, ``write`` host-to-device, ``rng``,
    ``sync``) and how it is seen (``ops`` / ``functions`` / ``calls``, with ``when`` on the arguments)."""

    name: str
    what: str
    why: str
    source: str
    category: str
    ops: tuple[Any, ...] = ()
    functions: tuple[str, ...] = ()
    calls: tuple[tuple[str, str], ...] = ()
    when: Callable[[Any, tuple, dict], bool] | None = None

    def applies(self, func: Any, args: tuple, kwargs: dict) -> bool:
        return self.when is None or self.when(func, args, kwargs)


def _arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The argument ``name`` of the operator call ``func(*args, **kwargs)`` (by its schema), or ``default``."""
    if name in kwargs:
        return kwargs[name]
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[i] if i < len(args) else default
    return default


def _bool_index(func: Any, args: tuple, kwargs: dict) -> bool:
    """An index list holding a boolean (or byte) mask: ``t[mask]``, ``t[mask] = x``, ``index_put_((mask,), x)``."""
    indices = _arg(func, args, kwargs, "indices") or ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _no_output_size(func: Any, args: tuple, kwargs: dict) -> bool:
    return _arg(func, args, kwargs, "output_size") is None


def _check_errors(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is _aten._linalg_check_errors.default:
        return True
    return bool(_arg(func, args, kwargs, "check_errors", False))


def _histc_reads_range(func: Any, args: tuple, kwargs: dict) -> bool:
    return _arg(func, args, kwargs, "min", 0) == _arg(func, args, kwargs, "max", 0)


_LINALG_EX = (_aten.linalg_cholesky_ex.default, _aten.linalg_inv_ex.default, _aten.linalg_lu_factor_ex.default,
              _aten.linalg_ldl_factor_ex.default, _aten._linalg_solve_ex.default)  # fmt: skip
_SCALAR = "the host reads the value back: a device-to-host copy and a wait for the stream"
_SHAPE = "its output's size is the data's, so the host reads it back before it can allocate the output"

#: every rule, by name (read by the capture each time it starts: :func:`without` removes one for a test)
RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("item", "a device-to-host read (.item() / float() / bool() / int() of a tensor)", _SCALAR,
         f"{_SRC}cuda/CUDAScalar.cu _local_scalar_dense_cuda (cudaMemcpyAsync + stream synchronize); "
         f"{_DOCS}generated/torch.cuda.set_sync_debug_mode.html", "read", ops=(_aten._local_scalar_dense.default,)),
    Rule("nonzero", "a device-to-host read (nonzero / argwhere / where(cond): its output shape depends on the data)",
         _SHAPE, f"{_DOCS}generated/torch.nonzero.html, torch.argwhere.html (\"causes host-device synchronization\")",
         "read", ops=(_aten.nonzero.default,)),
    Rule("masked_select", "a device-to-host read (masked_select: its output shape depends on the data)", _SHAPE,
         f"{_SRC}TensorAdvancedIndexing.cpp masked_select (a boolean index: nonzero)", "read",
         ops=(_aten.masked_select.default,)),
    Rule("equal", "a device-to-host read (torch.equal)", "the answer is a host bool: all() of the comparison read back",
         f"{_SRC}cuda/Equal.cpp cuda_equal (eq(...).all().item())", "read", ops=(_aten.equal.default,)),
    Rule("unique", "a device-to-host read (unique: its output shape depends on the data)", _SHAPE,
         f"{_SRC}cuda/Unique.cu (the number of unique values copied to the host)", "read",
         ops=(_aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default)),
    Rule("mask_index", "a device-to-host read (boolean-mask indexing: its output shape depends on the data)", _SHAPE,
         f"{_SRC}TensorAdvancedIndexing.cpp / IndexingUtils.h expandTensors (a boolean index becomes nonzero())",
         "read", ops=(_aten.index.Tensor,), when=_bool_index),
    Rule("mask_index_put", "a device-to-host read (boolean-mask assignment t[mask] = x / index_put_ with a mask)",
         "the mask becomes indices first (nonzero): their number is read back",
         f"{_SRC}TensorAdvancedIndexing.cpp index_put_ / IndexingUtils.h expandTensors (nonzero of the mask)",
         "read", ops=(_aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default),
         when=_bool_index),
    Rule("repeat_interleave", "a device-to-host read (repeat_interleave without output_size)",
         "the output length is the sum of the repeats, read back unless output_size is given",
         f"{_DOCS}generated/torch.repeat_interleave.html (output_size \"will avoid stream synchronization\")", "read",
         ops=(_aten.repeat_interleave.Tensor,), when=_no_output_size),
    Rule("bincount", "a device-to-host read (bincount: its length is the data's maximum)",
         "the number of bins is max() + 1 (and the sign check min()), read back", f"{_SRC}cuda/SummaryOps.cu "
         "_bincount_cuda_template (self.max().item(), self.min().item())", "read", ops=(_aten.bincount.default,)),
    Rule("histc", "a device-to-host read (histc with min == max: the range is the data's)",
         "with min == max the range is the data's min() and max(), read back",
         f"{_SRC}cuda/SummaryOps.cu _histc_cuda_template (self.min().cpu() / self.max().cpu())", "read",
         ops=(_aten.histc.default,), when=_histc_reads_range),
    Rule("normal_std_tensor", "a device-to-host read (torch.normal with a tensor std: its sign check)",
         "the check std >= 0 is read back", f"{_DOCS}generated/torch.normal.html (\"When std is a CUDA tensor, this "
         "function synchronizes its device with the CPU\")", "read",
         ops=(_aten.normal.float_Tensor, _aten.normal.Tensor_Tensor)),
    Rule("linalg_info", "a device-to-host read (torch.linalg's error check: cholesky, inv, solve, lu_factor, ...)",
         "the LAPACK info code is read back to raise an error (the *_ex variants with check_errors=False do not)",
         f"{_DOCS}linalg.html cholesky / inv / solve / lu_factor / ldl_factor (\"synchronizes that device with the "
         f"CPU\"), *_ex (\"only when check_errors=True\"); {_SRC}BatchLinearAlgebra.cpp _linalg_check_errors", "read",
         ops=(_aten._linalg_check_errors.default, *_LINALG_EX), when=_check_errors),
    Rule("linalg_decomposition", "a device-to-host read (torch.linalg's eigh / eigvalsh / svd / svdvals / eig / pinv "
         "/ matrix_rank)", "the solver's convergence info is read back (eig runs on the host: MAGMA / LAPACK)",
         f"{_DOCS}linalg.html eigh, eigvalsh, svdvals, matrix_rank, pinv, eig, eigvals (\"synchronizes that device "
         "with the CPU\")", "read", ops=(_aten._linalg_eigh.default, _aten._linalg_svd.default,
                                          _aten.linalg_eig.default, _aten.linalg_pinv.atol_rtol_tensor)),
    Rule("storage_read", "a device-to-host read (Tensor.tolist / numpy / __array__)",
         "the host reads the storage: a device-to-host copy", f"{_DOCS}tensors.html Tensor.tolist / Tensor.numpy",
         "read", functions=("tolist", "numpy", "__array__")),
    Rule("to_host", "a device-to-host copy (.cpu() / .to(\"cpu\"): the CPU stands for the device here)",
         "a copy into pageable host memory waits for the stream (cudaMemcpy D2H)",
         f"{_SRC}cuda/Copy.cu copy_kernel_cuda (non-pinned destination: cudaStreamSynchronize)", "read",
         functions=("cpu", "to")),
    Rule("one_hot_unsized", "a device-to-host read (F.one_hot without num_classes: the class count is the data's max)",
         "num_classes = max() + 1, read back", f"{_SRC}Onehot.cpp one_hot (num_classes == -1: self.max().item())",
         "read", functions=("one_hot",)),
    Rule("host_to_device", "a host-to-device copy of Python data (torch.tensor / new_tensor / as_tensor of host data)",
         "a copy from pageable host memory (cudaMemcpy H2D), which a capture refuses; a replay would not copy anew",
         "torch/csrc/utils/tensor_new.cpp internal_new_from_data (a CPU tensor of the data, lift_fresh, copied to the device)",
         "write", ops=(_aten.lift_fresh.default,)),  # torch.from_numpy too: a tensor from host memory is lifted
    Rule("rng_state", "a random-number-generator state read or set",
         "torch.cuda.get_rng_state / set_rng_state / manual_seed raise while capturing (the generator's offset is "
         "the graph's); torch.utils.checkpoint calls them when it preserves the RNG state",
         "torch/cuda/random.py, torch/cuda/graphs.py; ../shared/docs/kernels.md", "rng", calls=(
             ("torch", "get_rng_state"), ("torch", "set_rng_state"), ("torch", "manual_seed"), ("torch", "seed"),
             ("torch.random", "get_rng_state"), ("torch.random", "set_rng_state"), ("torch.random", "manual_seed"),
             ("torch.random", "seed"), ("torch.cuda", "get_rng_state"), ("torch.cuda", "set_rng_state"),
             ("torch.cuda", "get_rng_state_all"), ("torch.cuda", "set_rng_state_all"), ("torch.cuda", "manual_seed"),
             ("torch.cuda", "manual_seed_all"))),
    Rule("synchronize", "a host synchronisation", "cudaDeviceSynchronize / cudaStreamSynchronize are illegal "
         "while a stream captures (cudaErrorStreamCaptureUnsupported)", "CUDA Runtime API, stream capture "
         "(cudaStreamBeginCapture: synchronous calls are prohibited); torch.cuda.synchronize", "sync", calls=(
             ("torch.cuda", "synchronize"), ("torch.cpu", "synchronize"), ("torch.accelerator", "synchronize"))),
    Rule("barrier", "a host synchronisation (torch.distributed.barrier)", "NCCL's barrier waits for its all-reduce "
         "on the host (a stream synchronisation)", "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp barrier "
         "(work->synchronize / blocking wait)", "sync", calls=(("torch.distributed", "barrier"),)),
)}  # fmt: skip


def _index() -> tuple[dict[Any, list[Rule]], dict[str, list[Rule]]]:
    ops: dict[Any, list[Rule]] = {}
    functions: dict[str, list[Rule]] = {}
    for rule in RULES.values():
        for op in rule.ops:
            ops.setdefault(op, []).append(rule)
        for name in rule.functions:
            functions.setdefault(name, []).append(rule)
    return ops, functions


_OPS, _FUNCTIONS = _index()


@contextmanager
def without(name: str) -> Iterator[Rule]:
    """The rules less ``name`` for the block (a test's proof that the rule is what refuses its operation)."""
    global _OPS, _FUNCTIONS
    rule = RULES.pop(name)
    _OPS, _FUNCTIONS = _index()
    try:
        yield rule
    finally:
        RULES[name] = rule
        _OPS, _FUNCTIONS = _index()


def op_rule(func: Any, args: tuple, kwargs: dict) -> Rule | None:
    """The rule refusing the operator call ``func(*args, **kwargs)``, or ``None``."""
    for rule in _OPS.get(func, ()):
        if rule.applies(func, args, kwargs):
            return rule
    return None


def _to_host(args: tuple, kwargs: dict) -> bool:
    """``.to("cpu")`` / ``.to(device="cpu")``: a device written as the string ``"cpu"`` (a ``torch.device``
    object is the run's own device, passed through the code: CUDA on a GPU)."""
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def function_rule(name: str, args: tuple, kwargs: dict) -> Rule | None:
    """The rule refusing the Python-level call ``name(*args, **kwargs)`` (a ``TorchFunctionMode``'s view), or
    ``None``."""
    for rule in _FUNCTIONS.get(name, ()):
        if not args or not isinstance(args[0], torch.Tensor):
            continue
        if name == "to" and not _to_host(args, kwargs):
            continue
        if name == "one_hot" and kwargs.get("num_classes", args[1] if len(args) > 1 else -1) >= 0:
            continue
        return rule
    return None


def call_rules() -> list[tuple[Rule, str, str]]:
    """``(rule, module, attribute)`` of every module function a capture replaces (refusing it)."""
    return [(rule, module, attr) for rule in RULES.values() for module, attr in rule.calls]


# -- the host-sync counter's view (scalefold.perf.host_syncs) -------------------------------------------------

#: ``Tensor`` methods that read the storage on the host without dispatching an operator
HOST_READ_METHODS = set(RULES["storage_read"].functions)
#: functions whose reads of CPU tensors are CPU-only (PyTorch skips them on CUDA)
CPU_ONLY_FUNCTIONS = {"one_hot"}
#: the scalar read (``.item()``): what a CPU-only function's range check dispatches
SYNC_OPS = {op: "item" for op in RULES["item"].ops}
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}
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
    """A copy from a non-CPU tensor into host memory (a real device's copy: the counter's, on a GPU)."""
    if func not in _COPY_OPS or not args or not isinstance(args[0], torch.Tensor):
        return False
    if func is _aten.copy_.default:  # copy_(dst, src)
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    else:
        dst, src = out, args[0]
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type not in ("cpu", "meta")
            and dst.device.type == "cpu")  # fmt: skip


def host_read(func: Any, args: tuple, kwargs: dict, out: Any = None) -> str | None:
    """The kind (rule name) of device-to-host read ``func(*args, **kwargs)`` makes, or ``None``."""
    rule = op_rule(func, args, kwargs)
    if rule is not None and rule.category == "read":
        return rule.name
    if out is not None and device_to_host(func, args, kwargs, out):
        return "device_to_host"
    return None


__all__ = [
    "CPU_ONLY_FUNCTIONS", "HOST_READ_METHODS", "RULES", "SYNC_OPS", "Rule", "call_rules", "device_to_host",
    "format_site", "function_rule", "host_read", "on_cpu", "op_rule", "site", "without",
]  # fmt: skip
