"""FLOPs and memory traffic of one training step, counted on the fake-tensor step of the memory model
(``scalefold estimate-step``; :func:`count_step`, :func:`step_flops`).

The step is the one :func:`scalefold.perf.memory.estimate_memory` runs on fake tensors (the real
:class:`~scalefold.train.step.TrainingStep`: no-grad recycling passes, the grad pass with activation
checkpointing as configured, loss, backward, clipping, Adam + SWA; DAP as rank 0 of a fake group; CUDA's
autocast rules): :func:`count_step` calls it with an :class:`OpCounter` observing every operator, so
one fake run gives the peak memory and the arithmetic together. Per operator, eager, one kernel each:

* **matrix FLOPs** (``flops``, what MFU is quoted on): ``mm``, ``addmm``, ``bmm``, ``baddbmm`` -- every
  ``Linear``, ``matmul`` and ``einsum`` lowers to these --, convolutions and SDPA, by
  ``torch.utils.flop_counter``'s formulas (2 per multiply-add; addmm's bias add not counted); and
  ScaleFold's Triton attention (``scalefold::attention_fwd``: QK^T and PV, ``4 Z H Q K D``;
  ``attention_bwd``: the 7 products its two kernels run, ``14 Z H Q K D``: dV, dP, dK, dQ -- the 4 of
  the PyTorch path's backward -- plus the scores recomputed in each kernel and dP again, 3 products
  counted as ``recompute``, so that ``model_flops`` is the same on both kernel paths). Split by the
  products' input dtype (bf16 / fp32 / fp64).
* **elementwise FLOPs** (``flops_elementwise``, not part of MFU): 1 per output element of each pointwise
  operator (torch's ``pointwise`` tag: add, mul, sigmoid, relu, dropout masks, ...) and 1 per input
  element of reductions, softmax, log-softmax and layer norm (and their backward operators, the
  Triton layer norm and Adam kernels). A coarse count: on a GPU these are bound by memory traffic.
  Data movement (copies, casts, ``cat``, indexing, fills) counts no FLOPs.
* **bytes** (``bytes``): each operator's distinct input tensors read (a broadcast, stride-0 dimension
  counted once) and its outputs written; in-place operators write their target; views (view,
  reshape without copy, transpose, expand, slice, select, detach) and allocations move nothing. This
  is the traffic of running the step one kernel per operator: fusion removes much of it.
* **launches** (``launches``): the kernels the chosen path launches: one per operator that is not a view or
  an allocation; a ScaleFold Triton operator its kernels (:data:`TRITON_LAUNCHES`); where the run compiles the
  elementwise chains (``--compile``: :func:`compiled_chains`), each chain call one kernel reading its distinct
  inputs and writing its output, and its backward one kernel reading the output's gradient and the inputs and
  writing the inputs' gradients -- its inner operators add their FLOPs but neither launches nor bytes (the
  chain's operators and its backward's are told apart by the autograd sequence numbers the call created).
  Every launch is also kept with its matrix FLOPs and bytes (:attr:`StepCount.profile`), which
  :mod:`scalefold.perf.step_time` prices one by one.
* Not counted: collectives (DAP's all-gather / all-to-all: interconnect traffic), host reads.

**Attribution.** An operator goes to the innermost ``nn.Module`` whose forward runs it, also when
activation checkpointing re-runs a block's forward in backward (category ``recompute``). A backward
operator goes to the module whose forward created the autograd node the engine is running: each node
carries the sequence number it was created with, and the counter records which module was innermost
while each range of sequence numbers was created (AccumulateGrad: the parameter's module). So the
per-module counts add up to the total, recomputation included. ``torch.utils.flop_counter.FlopCounterMode``
attributes the backward by gradient hooks on module inputs and outputs: under checkpointing it leaves
the backward and recomputation out of the parents' totals (``tests/perf/test_flops.py`` shows it on a
small model). Operators outside any module: ``<step>`` (the step's glue) and ``<optimizer>``.

**Recycling.** Categories: ``recycling`` (the no-grad passes), ``forward`` (the grad pass and the heads),
``loss``, ``recompute``, ``backward``, ``optimizer``. The fake step runs one no-grad pass (they are
identical: same shapes, same operators); a step with ``n`` passes counts everything else plus ``n``
times that pass (checked against a run of ``n = 2`` on ``tiny``: FLOPs equal, bytes within 0.2 %, the
loss reading all ``n + 1`` batch slices; ``tests/perf/test_flops.py``). ``flops_mean`` is the
mean over the uniform recycling counts the training samples (:func:`scalefold.train.step.recycling_count`).

Results are cached per (configuration, target, kernels) for the process, so the training loop pays one
fake step per shape class and nothing per step (:func:`step_flops`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scalefold.config.training import TrainConfig
from scalefold.model.primitives import WeightCasts

#: Fields of a count: matrix FLOPs by dtype, elementwise FLOPs, bytes read, bytes written, kernel launches.
FIELDS = ("mm_bf16", "mm_fp32", "mm_fp64", "elementwise", "read", "written", "launches")
LAUNCHES = 6
#: Kernels ScaleFold's Triton operators launch per call (the attention backward: its preprocess, dK/dV and
#: dQ/dbias kernels plus dQ's scale, which writes the cast result into q's layout; the layer-norm backward:
#: dx and the dw/db reduction; the fused triangle multiplication's forward: the input kernel, the product's batched matmul and the output kernel;
#: its backward: the output kernel, the product's two matmuls, the gates kernel, the bias concatenation, the
#: input projections' gradient matmul, the LayerNorm backward's two kernels, the two weight-gradient matmuls
#: and the two bias casts -- ``kernels.triton_ops.trimul_fwd`` / ``trimul_bwd``). An operator not named here
#: is one launch. Bytes stay at the operator's boundary: the fused triangle multiplication's ``a``, ``b`` and
#: ``x`` are its outputs (saved for backward), so their writes count; the product's and the output
#: kernel's reads of them inside the operator do not (an undercount of about 3 planes per call). The fused outer
#: product mean (``opm_fwd`` / ``opm_bwd``): one kernel forward; backward the input-gradient kernel twice, the
#: weight-gradient kernel, the two partial-sum reductions and their two casts to the weight's dtype.
TRITON_LAUNCHES = {"attention_bwd": 4, "layer_norm_bwd": 2, "trimul_fwd": 3, "trimul_bwd": 12, "opm_bwd": 7}
MM = (0, 1, 2)
_MM_FIELD = {torch.bfloat16: 0, torch.float16: 0, torch.float32: 1, torch.float64: 2}
CATEGORIES = ("recycling", "forward", "loss", "recompute", "backward", "optimizer")
STEP, OPTIMIZER = "<step>", "<optimizer>"
_UNCOUNTED_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor", "profiler", "prim")
_NO_TRAFFIC = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense", "lift_fresh",
    "_unsafe_view", "set_", "resize_", "record_stream",
})  # fmt: skip
#: torch's ``reduction`` operator tag (torch >= 2.7); before it, the reductions the model runs by name
_REDUCTION_TAG = getattr(torch.Tag, "reduction", None)
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "linalg_vector_norm", "var", "std", "var_mean",
    "std_mean", "logsumexp", "all", "any", "argmax", "argmin",
})  # fmt: skip
_MOVES = frozenset({"clone", "_to_copy", "copy_", "copy", "fill_", "fill", "zero_", "zeros_like", "lift_fresh_copy"})
_NORMS = frozenset({
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm",
    "native_layer_norm_backward", "layer_norm_fwd", "layer_norm_bwd", "adam_swa_",
})  # fmt: skip


def _numel(t: torch.Tensor) -> int:
    """Elements an operator touches in ``t``: a stride-0 (broadcast) dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n


def _nbytes(t: torch.Tensor) -> int:
    return _numel(t) * t.element_size()


#: Products of ScaleFold's Triton attention kernels: (those the PyTorch path runs too, recomputations).
_ATTENTION_PRODUCTS = {"attention_fwd": (2, 0), "attention_bwd": (4, 3)}


def _triton_attention_flops(name: str, args: tuple, recomputed: bool = False) -> int:
    """``scalefold::attention_fwd`` (q, k, ...): QK^T and PV; ``attention_bwd`` (do, q, k, ...): dV, dP,
    dK, dQ, and (``recomputed``) the scores in both kernels and dP in the second."""
    q, k = (args[0], args[1]) if name == "attention_fwd" else (args[1], args[2])
    z, h, nq, d = q.shape
    products = _ATTENTION_PRODUCTS[name][1 if recomputed else 0]
    return products * 2 * z * h * nq * k.shape[-2] * d


@dataclass(frozen=True)
class _OpInfo:
    """What the counter needs of an operator, derived once from its schema and tags."""

    skip: bool  # not counted at all (collectives, host reads)
    view: bool  # no traffic (views, allocations)
    matrix: Callable[..., int] | None  # FLOP formula of a matrix product
    recomputed: Callable[..., int] | None  # ... of the products a kernel recomputes (Triton attention backward)
    pointwise: bool
    reduction: bool
    written_args: tuple[str, ...]  # arguments the operator writes
    write_only: tuple[str, ...]  # ... and of those, the ones it does not read (``out=``)


def _op_info(func: Any) -> _OpInfo:
    from torch.utils.flop_counter import flop_registry

    namespace, name = func.namespace, func.overloadpacket.__name__
    schema = func._schema
    written = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    write_only = tuple(a.name for a in schema.arguments if a.name in written and a.kwarg_only and a.name.startswith("out"))
    aliasing = bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    metadata = not written and not any("Tensor" in str(r.type) for r in schema.returns)  # t.device, sizes, ...
    matrix, recomputed = flop_registry.get(func.overloadpacket), None
    if namespace == "aten" and name == "_addmm_activation":  # addmm with cuBLASLt's activation epilogue
        matrix = flop_registry[torch.ops.aten.addmm]
    if namespace == "scalefold" and name in _ATTENTION_PRODUCTS:
        matrix, recomputed = _attention_formula(name), _attention_formula(name, recomputed=True)
    tags = set(func.tags)
    return _OpInfo(
        skip=namespace in _UNCOUNTED_NAMESPACES, view=aliasing or metadata or name in _NO_TRAFFIC, matrix=matrix,
        recomputed=recomputed if recomputed is not None and _ATTENTION_PRODUCTS[name][1] else None,
        pointwise=torch.Tag.pointwise in tags and name not in _MOVES,
        reduction=(_REDUCTION_TAG in tags if _REDUCTION_TAG is not None else name in _REDUCTIONS) or name in _NORMS,
        written_args=written, write_only=write_only,
    )  # fmt: skip


def _attention_formula(name: str, recomputed: bool = False) -> Callable[..., int]:
    def flops(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return _triton_attention_flops(name, args, recomputed)

    return flops


def _default_category() -> str:
    if torch._C._current_autograd_node() is not None:
        return "backward"
    return "forward" if torch.is_grad_enabled() else "recycling"


class OpCounter(TorchDispatchMode):
    """Matrix and elementwise FLOPs and bytes moved of every operator, by (category, module).

    ``modules``: ``{prefix: root module}`` whose submodules are named ``prefix.qualified.name`` (the
    model with prefix ``""``, the loss with ``"loss"``). ``category()``: the step's phase for each
    operator (default: ``backward`` inside the autograd engine, else ``forward`` / ``recycling`` by grad
    mode); a backward operator issued while a module forward runs is a recomputation. ``counts``:
    ``{(category, module): [mm_bf16, mm_fp32, mm_fp64, elementwise, read, written]}``.
    """

    def __init__(self, modules: Mapping[str, torch.nn.Module], category: Callable[[], str] | None = None) -> None:
        super().__init__()
        self.names: dict[int, str] = {}
        self.owners: dict[int, str] = {}  # parameter id -> its module's name
        for prefix, root in modules.items():
            for name, module in root.named_modules():
                full = ".".join(p for p in (prefix, name) if p) or type(root).__name__
                self.names[id(module)] = full
                for p in module.parameters(recurse=False):
                    self.owners[id(p)] = full
        self.category = category or _default_category
        self.counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * len(FIELDS))
        self.stack: list[str] = []
        self._starts: list[int] = []  # runs of autograd sequence numbers and the module that created them
        self._ends: list[int] = []
        self._run_owners: list[str] = []
        self._last = 0
        self._info: dict[Any, _OpInfo] = {}
        self._handles: list[Any] = []
        # launches: ``{(category, module): {(mm_bf16, mm_fp32, mm_fp64, bytes, launches): calls}}`` (what the
        # step-time model prices launch by launch) and ``{(category, operator): launches}``
        self.profile: dict[tuple[str, str], dict[tuple[int, ...], int]] = defaultdict(lambda: defaultdict(int))
        self.ops: dict[tuple[str, str], int] = defaultdict(int)
        # compiled elementwise chains: the calls running now (sequence number at their start) and, per call
        # made with grad, its run of sequence numbers and its backward kernel's bytes (read, written)
        self._chain_stack: list[int] = []
        self._chain_starts: list[int] = []
        self._chain_ends: list[int] = []
        self._chain_backward: list[tuple[str, int, int]] = []
        self._charged: set[int] = set()

    # -- module stack and the sequence-number runs ---------------------------------------------------

    def _mark(self) -> None:
        now = torch._C._autograd._get_sequence_nr()
        if now > self._last:
            self._starts.append(self._last)
            self._ends.append(now)
            self._run_owners.append(self.stack[-1] if self.stack else "")
        self._last = now

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self._mark()
        name = self.names.get(id(module))
        self.stack.append(name if name is not None else (self.stack[-1] if self.stack else ""))

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._mark()  # always_call: also when a checkpoint's recomputation stops early by an exception
        if self.stack:
            self.stack.pop()

    def _node_module(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            return self.owners.get(id(variable), "")
        seq = node._sequence_nr()
        if seq >= self._last:
            self._mark()
        i = bisect_right(self._starts, seq) - 1
        return self._run_owners[i] if i >= 0 and seq < self._ends[i] else ""

    def __enter__(self) -> OpCounter:
        from scalefold.perf.memory import hook_every_module

        self._last = torch._C._autograd._get_sequence_nr()
        self._handles = hook_every_module(self._enter_module, self._exit_module)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        from scalefold.perf.memory import remove_hooks

        super().__exit__(*exc)
        remove_hooks(self._handles)

    # -- counting ------------------------------------------------------------------------------------

    def where(self) -> tuple[str, str]:
        """(category, module) of an operator issued now. A weight cast shared by the step's passes
        (:class:`scalefold.model.primitives.WeightCasts`) is made once per step whatever the number of
        no-grad passes: counted as the grad pass's, also where the first no-grad pass makes it."""
        category = self.category()
        if category == "recycling" and WeightCasts.casting:
            category = "forward"
        if category == "backward":
            if self.stack:
                return "recompute", self.stack[-1]
            return category, self._node_module() or STEP
        if self.stack:
            return category, self.stack[-1]
        return category, OPTIMIZER if category == "optimizer" else STEP

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        info = self._info.get(func)
        if info is None:
            info = self._info[func] = _op_info(func)
        if not info.skip:
            category, module = self.where()
            fused = bool(self._chain_stack) or (category == "backward" and self._chain_backward_op(category, module))
            delta = _count(info, func, args, kwargs, out, fused)
            _add(self.counts[category, module], delta)
            extra = 0
            if info.recomputed is not None:  # a kernel's own recomputation (flash-style attention backward)
                extra = info.recomputed(*args)
                self.counts["recompute", module][_MM_FIELD.get(args[1].dtype, 1)] += extra
            if delta[LAUNCHES]:
                mm = [delta[i] for i in MM]
                mm[_MM_FIELD.get(args[1].dtype, 1) if extra else 0] += extra
                self._launch(category, module, func.overloadpacket.__name__, (*mm, delta[4] + delta[5], delta[LAUNCHES]))
        return out

    def _launch(self, category: str, module: str, op: str, signature: tuple[int, ...]) -> None:
        """Record a launch (or a kernel's several): ``signature`` (mm_bf16, mm_fp32, mm_fp64, bytes, launches)."""
        self.profile[category, module][signature] += 1
        self.ops[category, op] += signature[-1]

    # -- compiled elementwise chains: one kernel forward, one backward, the bytes at their boundary ---

    def chain_started(self, name: str, args: tuple) -> None:
        """A compiled chain begins (:func:`scalefold.kernels.elementwise.recording`): its operators add their
        FLOPs but no launches and no bytes."""
        self._chain_stack.append(torch._C._autograd._get_sequence_nr())

    def chain_finished(self, name: str, args: tuple, out: Any) -> None:
        """The chain returned (``out``: a tensor, or a tuple / pytree of them): one launch reading its distinct
        inputs and writing all its outputs; where it ran with grad (any output requires grad), its backward
        is one launch too, reading the gradients of the outputs that require grad and the inputs, writing
        the gradients of the inputs that need one."""
        start = self._chain_stack.pop()
        if self._chain_stack:
            return
        inputs = list({id(t): t for t in args if isinstance(t, torch.Tensor)}.values())
        outputs = list({id(t): t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}.values())
        read, written = sum(_nbytes(t) for t in inputs), sum(_nbytes(t) for t in outputs)
        category, module = self.where()
        counts = self.counts[category, module]
        counts[4], counts[5], counts[LAUNCHES] = counts[4] + read, counts[5] + written, counts[LAUNCHES] + 1
        self._launch(category, module, f"chain:{name}", (0, 0, 0, read + written, 1))
        end = torch._C._autograd._get_sequence_nr()
        out_grads = sum(_nbytes(t) for t in outputs if t.requires_grad)
        if end > start and any(t.requires_grad for t in outputs):
            grads = sum(_nbytes(t) for t in inputs if t.requires_grad)
            self._chain_starts.append(start)
            self._chain_ends.append(end)
            self._chain_backward.append((name, out_grads + read, grads))

    def _chain_backward_op(self, category: str, module: str) -> bool:
        """Whether the backward operator issued now belongs to a compiled chain's backward (charging that
        backward's one launch and its bytes the first time one of its operators runs)."""
        node = torch._C._current_autograd_node()
        if node is None or not self._chain_starts or getattr(node, "variable", None) is not None:
            return False
        seq = node._sequence_nr()
        i = bisect_right(self._chain_starts, seq) - 1
        if i < 0 or seq >= self._chain_ends[i]:
            return False
        if i not in self._charged:
            self._charged.add(i)
            name, read, written = self._chain_backward[i]
            counts = self.counts[category, module]
            counts[4], counts[5], counts[LAUNCHES] = counts[4] + read, counts[5] + written, counts[LAUNCHES] + 1
            self._launch(category, module, f"chain:{name}_backward", (0, 0, 0, read + written, 1))
        return True


def _count(info: _OpInfo, func: Any, args: tuple, kwargs: dict, out: Any, fused: bool = False) -> list[int]:
    """One operator's FLOPs, bytes and launches (:data:`FIELDS`); ``fused``: an operator inside a compiled
    chain, its FLOPs alone (the chain's kernel moves the bytes and is the launch)."""
    counts = [0] * len(FIELDS)
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if info.matrix is not None:
        first = next(t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.dim() >= 2)
        counts[_MM_FIELD.get(first.dtype, 1)] += int(info.matrix(*args, **kwargs, out_val=out))
    elif info.pointwise:
        counts[3] += sum(t.numel() for t in outputs)
    elif info.reduction:
        counts[3] += max((t.numel() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), default=0)
    if info.view or fused:
        return counts
    counts[LAUNCHES] = TRITON_LAUNCHES.get(func.overloadpacket.__name__, 1) if func.namespace == "scalefold" else 1
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    seen: set[int] = set()
    for name, value in named.items():
        for t in tree_flatten(value)[0]:
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            seen.add(id(t))
            if name not in info.write_only:
                counts[4] += _nbytes(t)
            if name in info.written_args:
                counts[5] += _nbytes(t)
    if not info.written_args:
        counts[5] += sum(_nbytes(t) for t in outputs)
    return counts


# ---------------------------------------------------------------------------------------------
# The step's counts
# ---------------------------------------------------------------------------------------------


def _add(a: list[int], b: list[int]) -> None:
    for i, v in enumerate(b):
        a[i] += v


@dataclass
class StepCount:
    """FLOPs and bytes of one training step of a configuration, for every recycling count ``n``.

    ``parts``: ``{category: {module: counts}}`` of the fake step that ran ``recycling_run`` no-grad
    passes (``counts``: :data:`FIELDS`); :meth:`totals` and friends give any ``n`` in ``0 .. R-1``.
    """

    parts: dict[str, dict[str, list[int]]]
    recycling_run: int
    num_ensembles: int  # R: a step takes 0 .. R-1 no-grad passes
    memory: Any  # the MemoryEstimate of the same fake step
    settings: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    #: ``{category: {module: {(mm_bf16, mm_fp32, mm_fp64, bytes, launches): calls}}}``: the launches one by one
    profile: dict[str, dict[str, dict[tuple[int, ...], int]]] = field(default_factory=dict)
    #: ``{category: {operator: launches}}`` (a compiled chain: ``chain:<name>``, its backward ``chain:<name>_backward``)
    ops: dict[str, dict[str, int]] = field(default_factory=dict)

    def _scaled(self, category: str, n: int, value: int) -> int:
        """``value`` counted in the fake step's ``category``, in a step of ``n`` no-grad passes (the
        recycling passes' counts times ``n / recycling_run``; the other categories as counted)."""
        return value * n // self.recycling_run if category == "recycling" and n else (0 if category == "recycling" else value)

    @property
    def peak_bytes(self) -> int:
        """The predicted peak memory per rank of the same fake step."""
        return self.memory.peak_bytes

    @property
    def breakdown(self) -> dict[str, int]:
        return self.memory.breakdown

    def _check(self, n: int) -> None:
        if not 0 <= n < self.num_ensembles:
            raise ValueError(f"recycling count {n} outside 0 .. {self.num_ensembles - 1}")
        if n and not self.recycling_run:
            raise ValueError("the counted step ran no recycling pass: count it with recycling=1 for n > 0")

    def by_module(self, n: int, categories: tuple[str, ...] = CATEGORIES) -> dict[str, list[int]]:
        """``{module: counts}`` of a step with ``n`` no-grad passes, over ``categories``."""
        self._check(n)
        out: dict[str, list[int]] = defaultdict(lambda: [0] * len(FIELDS))
        for category in categories:
            for module, counts in self.parts.get(category, {}).items():
                if category == "recycling":
                    _add(out[module], [c * n // self.recycling_run for c in counts] if n else [0] * len(FIELDS))
                else:
                    _add(out[module], counts)
        return dict(out)

    def totals(self, n: int, categories: tuple[str, ...] = CATEGORIES) -> list[int]:
        total = [0] * len(FIELDS)
        for counts in self.by_module(n, categories).values():
            _add(total, counts)
        return total

    def flops(self, n: int) -> int:
        """Matrix FLOPs of a step with ``n`` no-grad passes, recomputation included (hardware FLOPs)."""
        return sum(self.totals(n)[i] for i in MM)

    def model_flops(self, n: int) -> int:
        """Matrix FLOPs without recomputation -- activation checkpointing's and the Triton attention
        backward's -- the MFU convention; the same on both kernel paths."""
        return sum(self.totals(n, tuple(c for c in CATEGORIES if c != "recompute"))[i] for i in MM)

    def flops_by_dtype(self, n: int) -> dict[str, int]:
        t = self.totals(n)
        return {"bf16": t[0], "fp32": t[1], "fp64": t[2]}

    def elementwise_flops(self, n: int) -> int:
        return self.totals(n)[3]

    def bytes(self, n: int) -> int:
        """Bytes the step's kernels read and write (kernel by kernel; a compiled chain at its boundary)."""
        t = self.totals(n)
        return t[4] + t[5]

    def launches(self, n: int) -> int:
        """Kernels a step of ``n`` no-grad passes launches (a Triton operator: its kernels; a compiled
        chain: one forward, one backward; views and allocations: none)."""
        return self.totals(n)[LAUNCHES]

    def launches_by_op(self, n: int, top: int = 40) -> dict[str, int]:
        """The ``top`` operators by launches in a step of ``n`` no-grad passes."""
        self._check(n)
        out: dict[str, int] = defaultdict(int)
        for category, ops in self.ops.items():
            for op, k in ops.items():
                out[op] += self._scaled(category, n, k)
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top])

    def launch_profile(self, n: int, modules: Callable[[str], bool] | None = None) -> dict[tuple[int, ...], int]:
        """``{(mm_bf16, mm_fp32, mm_fp64, bytes, launches): calls}`` of a step of ``n`` no-grad passes (of the
        modules ``modules(name)`` accepts; default all): what :mod:`scalefold.perf.step_time` prices."""
        self._check(n)
        out: dict[tuple[int, ...], int] = defaultdict(int)
        for category, by_module in self.profile.items():
            for module, signatures in by_module.items():
                if modules is not None and not modules(module):
                    continue
                for signature, calls in signatures.items():
                    out[signature] += self._scaled(category, n, calls)
        return dict(out)

    def mean(self, fn: Callable[[int], float]) -> float:
        """Mean of ``fn(n)`` over the recycling counts the training samples (uniform on 0 .. R-1)."""
        return sum(fn(n) for n in range(self.num_ensembles)) / self.num_ensembles

    @property
    def flops_mean(self) -> float:
        return self.mean(self.flops)

    def recycling_counts(self) -> range:
        return range(self.num_ensembles)

    def floors(self) -> dict[str, dict[str, dict[str, float]]]:
        """The roofline floor of each recycling count on the cards of
        :data:`~scalefold.perf.devices.FLOOR_DEVICES`: :func:`floor_table` of the step's totals."""
        return floor_table(self.totals, self.recycling_counts(), self.settings["precision"])


def floor_table(totals: Callable[[int], list[int]], counts: Iterable[int], precision: str) -> dict[str, dict[str, Any]]:
    """``{card: {"floor_s" | "compute_s" | "memory_s": {"0": s, ..., "mean": s}}}`` for counts ``totals(n)``
    (:data:`FIELDS`) on the cards of :data:`~scalefold.perf.devices.FLOOR_DEVICES`
    (:func:`~scalefold.perf.devices.floor_seconds`: matrix FLOPs over the dense peak of their dtype, bytes
    over the bandwidth, the larger)."""
    from scalefold.perf.devices import DEVICES, FLOOR_DEVICES, floor_seconds

    out = {}
    for key in FLOOR_DEVICES:
        card: dict[str, dict[str, float]] = {"floor_s": {}, "compute_s": {}, "memory_s": {}}
        for n in counts:
            t = totals(n)
            seconds = floor_seconds({"bf16": t[0], "fp32": t[1], "fp64": t[2]}, t[4] + t[5], DEVICES[key], precision)
            for name, per_n in card.items():
                per_n[str(n)] = seconds[name]
        for per_n in card.values():
            per_n["mean"] = sum(per_n.values()) / len(per_n)
        out[key] = card
    return out


def group(module: str, depth: int) -> str:
    """A module's name at ``depth`` named levels, block indices as ``*`` (``blocks``, ``core`` and the
    indices do not count as levels): ``evoformer_stack.blocks.3.core.tri_mul_out.linear_p`` at depth 2 is
    ``evoformer_stack.blocks.*.core.tri_mul_out``."""
    out, levels = [], 0
    for part in module.split("."):
        if levels == depth:
            break
        if part.isdigit():
            out.append("*")
            continue
        out.append(part)
        if part not in ("blocks", "core"):
            levels += 1
    return ".".join(out)


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------

_CACHE: dict[tuple, StepCount] = {}
_CATEGORY_OF_TRACKER = {"activations": "forward", "optimizer_temp": "optimizer", "setup": "forward"}
#: The options that shape a step (what the cache is keyed on).
SHAPE_OPTIONS = (
    "model_preset", "crop_size", "max_msa_clusters", "max_extra_msa", "num_recycling_iters",
    "structure_module_iterations", "activation_checkpointing", "precision", "dap", "bp", "parallel_evoformer",
    "cuda_graphs", "clip_grad_max_norm", "swa_decay", "compile", "compile_regions",
)  # fmt: skip


def cache_key(cfg: TrainConfig, target: str, kernels: str | None, recycling: int | None = None) -> tuple:
    from scalefold.perf.memory import policy_name

    values = tuple(getattr(cfg, name) for name in SHAPE_OPTIONS if name != "activation_checkpointing")
    return values + (policy_name(cfg.activation_checkpointing), target, kernels, recycling)


def count_step(
    cfg: TrainConfig, target: str = "cuda", kernels: str | None = None, recycling: int | None = None, cache: bool = True
) -> StepCount:
    """FLOPs, bytes and the predicted peak memory of one training step of ``cfg`` (one fake step,
    :func:`scalefold.perf.memory.estimate_memory` with an :class:`OpCounter`; cached per configuration,
    ``target`` and ``kernels`` unless ``cache`` is False). ``target`` / ``kernels`` as for the memory
    model (``cuda``: Triton kernels by default; ``cpu``: the PyTorch references). ``recycling``: the
    no-grad passes the fake step runs (default one where the run recycles; the counts of any other
    number follow from it)."""
    from scalefold.perf.memory import estimate_memory

    key = cache_key(cfg, target, kernels, recycling)
    if cache and key in _CACHE:
        return _CACHE[key]
    t0 = time.perf_counter()
    box: dict[str, Any] = {}

    @contextlib.contextmanager
    def observe(step: Any, tracker: Any) -> Iterator[None]:
        def category() -> str:
            name = tracker.category()
            return _CATEGORY_OF_TRACKER.get(name, name)

        box["counter"] = counter = OpCounter({"": step.model, "loss": step.loss_fn}, category)
        box["num_ensembles"] = step.num_ensembles
        with counter:
            yield

    fused = compiled_chains(cfg, target)
    chains = contextlib.nullcontext()
    if fused:
        from scalefold.kernels import elementwise

        chains = elementwise.recording(lambda name, args: box["counter"].chain_started(name, args),
                                       lambda name, args, out: box["counter"].chain_finished(name, args, out), fused)  # fmt: skip
    with chains:
        memory = estimate_memory(cfg, target=target, kernels=kernels, recycling=recycling, observe=observe)
    counter = box["counter"]
    parts: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for (category, module), counts in counter.counts.items():
        parts[category][module] = counts
    profile: dict[str, dict[str, dict[tuple[int, ...], int]]] = defaultdict(dict)
    for (category, module), signatures in counter.profile.items():
        profile[category][module] = dict(signatures)
    ops: dict[str, dict[str, int]] = defaultdict(dict)
    for (category, op), k in counter.ops.items():
        ops[category][op] = k
    result = StepCount(
        parts=dict(parts), recycling_run=memory.settings["recycling_passes"], num_ensembles=box["num_ensembles"],
        memory=memory, settings={**memory.settings, "compiled_chains": list(fused)}, seconds=time.perf_counter() - t0,
        profile=dict(profile), ops=dict(ops),
    )  # fmt: skip
    if cache:
        _CACHE[key] = result
    return result


def compiled_chains(cfg: TrainConfig, target: str) -> tuple[str, ...]:
    """The elementwise chains a run of ``cfg`` on ``target`` runs compiled (``--compile`` with the
    ``elementwise`` region: the device's default chains, :func:`scalefold.compilation.regions.elementwise_chains`),
    which the counter counts as one kernel each; none without ``--compile``."""
    if not getattr(cfg, "compile", False):
        return ()
    from scalefold.compilation.regions import elementwise_chains

    regions = [r.strip() for r in cfg.compile_regions.split(",") if r.strip()]
    return tuple(c for r in regions if r.split(":")[0] == "elementwise" for c in elementwise_chains(r, target))


def step_flops(cfg: TrainConfig, n: int, target: str | None = None, kernels: str | None = None) -> int:
    """Matrix FLOPs (per rank, recomputation included) of a training step of ``cfg`` with ``n`` no-grad
    recycling passes. The first call per configuration runs one fake step (seconds for the small presets,
    minutes for MLPerf shapes); later calls are a look-up. ``target``: default ``cuda`` when CUDA is
    available, else ``cpu``. For MFU divide by the step's seconds and :func:`scalefold.perf.devices.mfu`."""
    if target is None:
        target = "cuda" if torch.cuda.is_available() else "cpu"
    return count_step(cfg, target=target, kernels=kernels).flops(n)


def step_throughput(
    cfg: TrainConfig, n: int, seconds: float, device_name: str | None = None, target: str | None = None,
    kernels: str | None = None,
) -> dict[str, float]:  # fmt: skip
    """What the training loop logs for a step with ``n`` no-grad passes that took ``seconds``: ``tflops``
    (the matrix FLOPs the step executed, recomputation included, per second / 10^12) and, where the GPU's
    dense peak is known (``device_name``: ``torch.cuda.get_device_name()``; see
    :mod:`scalefold.perf.devices`), ``mfu`` (model FLOPs -- without recomputation -- per second over the
    peak at ``cfg.precision``) and ``hfu`` (the same with recomputation). An unknown or absent GPU gives
    ``tflops`` alone. Per rank (a DAP rank's own share). Cached: no fake step after the first per shape."""
    from scalefold.perf.devices import device_spec, mfu

    if not seconds > 0:
        raise ValueError(f"step time must be > 0 seconds, got {seconds}")
    if target is None:
        target = "cuda" if torch.cuda.is_available() else "cpu"
    count = count_step(cfg, target=target, kernels=kernels)
    out = {"tflops": count.flops(n) / seconds / 1e12}
    spec = device_spec(device_name)
    if spec is not None:
        out["mfu"] = mfu(count.model_flops(n), seconds, spec, cfg.precision)
        out["hfu"] = mfu(count.flops(n), seconds, spec, cfg.precision)
    return out


# ---------------------------------------------------------------------------------------------
# What a training run logs: a small table per configuration, cached on disk
# ---------------------------------------------------------------------------------------------

FLOPS_CACHE_ENV = "SCALEFOLD_FLOPS_CACHE"  # a directory; "off": no disk cache


def _code_digest() -> str:
    """A digest of the code a count depends on (the model, the losses, the kernels' references, this
    counter): a change there gives a new cache entry."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("model", "losses", "kernels", "perf"):
        for path in sorted((root / folder).glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _flops_cache_file(cfg: TrainConfig, target: str, kernels: str | None) -> Any:
    import hashlib
    from pathlib import Path

    where = os.environ.get(FLOPS_CACHE_ENV, "")
    if where.strip().lower() == "off":
        return None
    root = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scalefold" / "flops"
    key = repr((cache_key(cfg, target, kernels), torch.__version__, _code_digest()))
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def run_flops_table(cfg: TrainConfig, target: str | None = None, kernels: str | None = None) -> dict[int, tuple[int, int]]:
    """``{n: (executed FLOPs, model FLOPs)}`` per rank of a training step of ``cfg`` with ``n`` no-grad
    recycling passes, for every ``n`` the run samples: what ``scalefold train`` logs as ``tflops`` / ``mfu``.

    One fake step (:func:`count_step`) the first time a configuration is seen on a machine; the table is
    kept in ``~/.cache/scalefold/flops`` (``$SCALEFOLD_FLOPS_CACHE``; ``off``: not kept), keyed on the step's
    shape options, the torch version and a digest of the model / loss / kernel / counter code, so a run of
    the same configuration costs a file read. An unreadable entry is counted again and rewritten.
    """
    if target is None:
        target = "cuda" if torch.cuda.is_available() else "cpu"
    path = _flops_cache_file(cfg, target, kernels)
    if path is not None and path.is_file():
        try:
            return {int(n): (int(f), int(m)) for n, (f, m) in json.loads(path.read_text()).items()}
        except (OSError, ValueError, TypeError):
            pass  # counted again below
    count = count_step(cfg, target=target, kernels=kernels)  # shared with the memory check (cached per process)
    table = {n: (count.flops(n), count.model_flops(n)) for n in range(count.num_ensembles)}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({str(n): list(v) for n, v in table.items()}))
            tmp.replace(path)
        except OSError:
            pass  # a cache that cannot be written costs the next run a count, nothing else
    return table


__all__ = [
    "CATEGORIES", "FIELDS", "LAUNCHES", "TRITON_LAUNCHES", "OpCounter", "compiled_chains", "SHAPE_OPTIONS", "StepCount", "cache_key", "count_step", "group",
    "run_flops_table", "step_flops", "step_throughput",
]  # fmt: skip
