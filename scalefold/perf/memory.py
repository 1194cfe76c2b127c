"""Peak memory per rank of one training step, predicted without a GPU (``scalefold estimate-memory``).

Method: the real training step (:class:`scalefold.train.step.TrainingStep`: every no-grad recycling
pass, the grad pass with activation checkpointing as configured, the fp32 loss, backward, clipping,
Adam + SWA) runs on **fake tensors** (``torch._subclasses.FakeTensorMode``: shapes, dtypes and
storages, no data, no compute), under a dispatch-level tracker that sees every storage the step
creates and when it dies. The peak of the live bytes is the prediction; what was live at that moment,
by category (parameters, gradients, optimizer state, batch, activations, ...) and by top-level module,
is the breakdown. Large-model trainers plan memory the same way; we do not use
``torch.distributed._tools.mem_tracker.MemTracker`` itself (it exists in torch 2.13 and counts the same
storages) because it updates the peak of every module it has seen at every operator -- quadratic at
AlphaFold's ~5,000 modules and ~10^5 operators per step -- and has no notion of the target device's
allocator or autocast rules, which the tracker here adds:

* **CUDA target** (``target="cuda"``): fake CUDA tensors cannot be made with a CPU-only torch, so the
  step runs on fake CPU tensors with CUDA's rules applied: every storage is rounded up to the caching
  allocator's 512-byte block, and under bf16 autocast the operators CUDA autocasts to fp32 (softmax,
  layer_norm, sum, exp, ...) get fp32 inputs, as ``torch.autocast("cuda")`` would give them (CPU
  autocast leaves them in bf16, which would halve the attention probabilities). ``--kernels triton``
  runs the Triton custom ops through their registered fake implementations (their real output and
  saved-tensor sizes); ``torch`` the PyTorch references.
* **DAP N**: the step runs as rank 0 of a DAP-N group on torch's ``fake`` process group (collectives
  do nothing; their output buffers are real allocations), through the same
  :func:`~scalefold.distributed.setup_model_parallel` and stacks the training uses, so the per-rank
  shards, the gathered pair biases and projections and the all_to_all buffers are the ones DAP
  allocates -- rather than an analytic division of the activations that would miss them.
* **CUDA graphs** (``--cuda-graphs auto`` on CUDA without DAP/BP): the graphs of the no-grad recycling
  passes share one pool of about the peak of those passes, held while the grad pass runs; the
  prediction adds it (``cuda_graph_pool_bytes``).

Not included (say so where the figure is used): the CUDA context and library workspaces (cuBLAS, NCCL:
~0.5-1 GiB outside ``max_memory_allocated``), allocator fragmentation (``max_memory_reserved`` is
typically 5-15 % above the allocated peak), the evaluation model's activations (evaluation runs between
steps) and DDP's gradient buckets (about one more gradient copy in ``bucket_cap_mb`` pieces; data
parallelism is not modelled). :func:`check_fits` keeps a margin for these.

Validated against the CPU allocator's real peak on small presets (``bench/RESULTS.md``, "Memory model").
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scalefold.config.environment import scoped_env
from scalefold.config.training import TrainConfig
from scalefold.kernels import device_path
from scalefold.perf.memory_sites import SiteLog, format_sites

GiB = 2**30
CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block up to a multiple of this
#: What start-up leaves out of a device's memory for what the model does not predict (CUDA context,
#: cuBLAS/NCCL workspaces: ~1 GiB) and fragmentation (~10 % of the peak); see :func:`check_fits`.
CONTEXT_RESERVE_BYTES = 1 * GiB
FRAGMENTATION_MARGIN = 0.10
DAP_SIZES = (1, 2, 4, 8)
SITES_KEPT = 1000  # sites=True: the largest sites kept, the rest folded into one row

# Operators CUDA autocast runs in fp32 (autocast_mode.cpp: its fp32 list and fp32_set_opt_dtype list), as
# the aten operators the dispatcher sees below autocast; CPU autocast leaves them in the input dtype.
_CUDA_FP32_OPS = frozenset({
    "_softmax", "_log_softmax", "native_layer_norm", "native_group_norm", "sum", "prod", "cumsum", "cumprod",
    "linalg_vector_norm", "norm", "exp", "expm1", "log", "log10", "log1p", "log2", "pow", "reciprocal", "rsqrt",
    "softplus", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "logsumexp", "cdist", "dist", "_pdist_forward",
    "renorm", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss_forward", "kl_div",
    "binary_cross_entropy_with_logits",
})  # fmt: skip
_REDUCED = (torch.bfloat16, torch.float16)
# The same rule at the level CUDA autocast applies it: the Python-visible functions whose aten operators CUDA
# autocast casts to fp32 *above autograd* (autocast's dispatch key sits above it), so the cast is part of the
# graph: the fp32 copy is what the operator saves for backward, and backward runs the operator's gradient in
# fp32 and then the cast's (fp32 -> bf16). Cast at the dispatch level alone (below autograd), backward would
# run the gradient straight into bf16 and never hold the fp32 one (2 GiB transient in the extra-MSA row
# attention's softmax backward at MLPerf shapes). ``softmax``/``log_softmax`` are autocast's
# ``fp32_set_opt_dtype`` ops, which for bf16 inputs copy the input to fp32 as well; ``sum``/``prod``/``cumsum``
# (also ``fp32_set_opt_dtype``) accumulate in fp32 without a copy and stay with the dispatch-level rule.
_CUDA_FP32_FUNCTIONS = frozenset({
    "softmax", "log_softmax", "layer_norm", "group_norm", "exp", "expm1", "log", "log10", "log1p", "log2", "pow",
    "__pow__", "__rpow__", "reciprocal", "rsqrt", "softplus", "acos", "asin", "cosh", "sinh", "tan", "erfinv",
    "logsumexp", "cdist", "dist", "renorm", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss",
    "kl_div", "binary_cross_entropy_with_logits",
})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Result
# ---------------------------------------------------------------------------------------------


@dataclass
class MemoryEstimate:
    """Predicted peak memory of one training step on one rank (bytes)."""

    peak_bytes: int  # the prediction (CUDA graph pool included where it applies)
    step_peak_bytes: int  # the eager step's peak, without the CUDA graph pool
    cuda_graph_pool_bytes: int  # 0 where graphs do not apply
    breakdown: dict[str, int]  # live bytes at the peak by category (parameters, gradients, ...)
    modules: dict[str, int]  # live activation / backward bytes at the peak by top-level module
    phase_peaks: dict[str, int]  # peak live bytes in each phase of the step
    settings: dict[str, Any] = field(default_factory=dict)  # what was estimated (preset, crop, dap, ...)
    seconds: float = 0.0  # how long the estimate took
    origins: dict[str, int] = field(default_factory=dict)  # origins=True: live at the peak by kind/module/op
    #: sites=True: live at the eager step's peak by allocating line, ``{site: {"bytes", "count"}}``, largest first
    #: (:mod:`scalefold.perf.memory_sites`; they add up to ``step_peak_bytes``)
    sites: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "peak_gib": round(self.peak_gib, 3)}


# ---------------------------------------------------------------------------------------------
# Tracking live storages
# ---------------------------------------------------------------------------------------------


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _REDUCED else x


def hook_every_module(enter: Callable[..., None], leave: Callable[..., None]) -> list[Any]:
    """Global forward hooks: ``enter(module, args)`` before every module's forward, ``leave(module, args,
    output)`` after it, also when it raises (activation checkpointing stops a recomputation early by an
    exception). Returns the handles for :func:`remove_hooks`."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    return [register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]


def remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class AutocastProbe(TorchFunctionMode):
    """Whether CPU autocast is on where the torch function that issued an operator was called (``on``),
    for the dispatch-level modes below it: there autocast's dispatch key is always excluded, so
    ``torch.is_autocast_enabled()`` reads False inside ``__torch_dispatch__`` even under autocast (the
    CUDA fp32 rule of :class:`StorageTracker` never fired before this probe: softmax outputs were
    predicted in bf16, not fp32). Nested calls keep the outermost call's state. ``loss.backward()`` is
    itself such a call, so the whole backward reads the state at that call (off); activation
    checkpointing's recomputation inside it is told apart by the module forwards running there
    (``recomputing``: module forward hooks, counted while active). ``cuda_fp32``: where autocast is on,
    the functions CUDA autocast runs in fp32 get their reduced-precision tensor arguments cast to fp32
    here, above autograd, as CUDA autocast casts them (:data:`_CUDA_FP32_FUNCTIONS`)."""

    def __init__(self, cuda_fp32: bool = False) -> None:
        super().__init__()
        self.cuda_fp32 = cuda_fp32  # apply CUDA autocast's fp32 casts here, above autograd
        self.on = False
        self.modules_running = 0  # module forwards now running (in backward: a recomputation)
        self._handles: list[Any] = []

    def __enter__(self) -> AutocastProbe:
        self._handles = hook_every_module(self._enter_module, self._exit_module)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        remove_hooks(self._handles)

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self.modules_running += 1

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.modules_running -= 1  # always_call: also when a recomputation stops early by an exception

    def __torch_function__(self, func, types, args=(), kwargs=None):
        before, self.on = self.on, torch.is_autocast_enabled("cpu")
        kwargs = kwargs or {}
        try:
            if self.cuda_fp32 and self.on and getattr(func, "__name__", None) in _CUDA_FP32_FUNCTIONS:
                args, kwargs = tuple(_up(a) for a in args), {k: _up(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)
        finally:
            self.on = before


class StorageTracker(TorchDispatchMode):
    """Live bytes of every storage an operator creates (and of the ones :meth:`register` names), the
    peak of their sum, and what was live at the peak by ``category`` and top-level module.

    Categories of new storages follow the step's phase (:meth:`phase`): ``activations`` (grad pass),
    ``recycling`` (no-grad passes), ``loss``, ``backward``, ``optimizer_temp``. A forward pass is a
    recycling pass by the grad mode it *starts* in (:meth:`passes`: each call of the model's one-pass
    method), not by the grad mode of each operator: inside a custom ``autograd.Function``'s forward
    grad mode is off, and the grad pass's DAP collectives (scatter, gather, all_to_all) and Triton
    kernels allocate there -- counted by the operator's grad mode they looked like recycling storages
    live at the grad pass's peak (1 GiB at MLPerf crop 256 DAP 2) and raised the recycling phase's
    peak, hence the CUDA-graph pool, to the grad pass's. Without :meth:`passes` the operator's grad
    mode decides. ``origins``: also keep the live bytes by creating operator (debugging). ``block``
    rounds every storage up (512 on CUDA). ``cuda_autocast``: the operators CUDA autocasts to fp32 get fp32 inputs
    where CUDA bf16 autocast would be on (the casts counted), at the dispatch level, so that activation
    checkpointing's recomputation in backward sees the same rule as the forward; where autocast is on
    is read by an :class:`AutocastProbe` above the dispatcher. Works on real and on fake tensors alike.
    """

    def __init__(self, block: int = 1, cuda_autocast: bool = False, origins: bool = False, sites: bool = False) -> None:
        super().__init__()
        self.block = block
        self.cuda_autocast = cuda_autocast
        self.origins = origins
        self.sites = SiteLog() if sites else None  # each storage's allocating line (scalefold.perf.memory_sites)
        self.grad_pass: bool | None = None  # the grad mode the current forward pass started in (passes())
        self.current = 0
        self.peak = 0
        self.live: dict[tuple[str, ...], int] = defaultdict(int)  # (category, module[, op]) -> bytes
        self.peak_live: dict[tuple[str, ...], int] = {}
        self.phase_name = "setup"
        self.phase_peaks: dict[str, int] = defaultdict(int)
        self.phase_start: dict[str, int] = {}  # live bytes when each phase was first entered
        self._refs: dict[int, tuple[weakref.ref, int, tuple[str, ...]]] = {}
        self._stack: list[str] = []  # the attributed modules whose forward is running
        self._hooks: list[Any] = []
        self._undo: list[Any] = []
        self._probe = AutocastProbe(cuda_fp32=True) if cuda_autocast else None

    # -- bookkeeping --------------------------------------------------------------------------------

    def _add(self, storage: torch.UntypedStorage, tag: tuple[str, ...], site: str | None = None) -> None:
        key = id(storage)
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        if nbytes <= 0:
            return
        nbytes = -(-nbytes // self.block) * self.block
        self._refs[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)), nbytes, tag)
        self.current += nbytes
        self.live[tag] += nbytes
        if self.sites is not None:
            self.sites.alloc(key, nbytes, site)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_live = dict(self.live)
            if self.sites is not None:
                self.sites.mark_peak()
        phase = "recycling" if self._recycling() else self.phase_name
        if self.current > self.phase_peaks[phase]:
            self.phase_peaks[phase] = self.current

    def _free(self, key: int) -> None:
        entry = self._refs.pop(key, None)
        if entry is not None:
            _, nbytes, tag = entry
            self.current -= nbytes
            self.live[tag] -= nbytes
            if self.sites is not None:
                self.sites.free(key)

    def register(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count storages that exist before tracking starts (parameters, optimizer buffers, batch)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), (category, ""), f"({category})")

    def phase(self, name: str) -> None:
        self.phase_name = name
        self.phase_start.setdefault(name, self.current)
        self.phase_peaks[name] = max(self.phase_peaks[name], self.current)

    def passes(self, model: torch.nn.Module, method: str = "iteration") -> None:
        """Tell the forward passes apart by the grad mode each call of ``model.<method>`` (AlphaFold's
        one recycling iteration) starts in: no grad, a recycling pass; else the grad pass. Holds
        until the next call (the auxiliary heads after the last iteration belong to the grad pass).
        Undone at exit."""
        inner = getattr(model, method)

        def one_pass(*args: Any, **kwargs: Any) -> Any:
            self.grad_pass = torch.is_grad_enabled()
            return inner(*args, **kwargs)

        setattr(model, method, one_pass)
        self._undo.append(lambda: delattr(model, method) if method in vars(model) else None)

    def _recycling(self) -> bool:
        if self.phase_name != "forward":
            return False
        grad = torch.is_grad_enabled() if self.grad_pass is None else self.grad_pass
        return not grad

    def attribute(self, modules: dict[str, torch.nn.Module]) -> None:
        """Attribute new storages to these (top-level) modules while their forward runs -- in the grad
        pass, and again when activation checkpointing recomputes them in backward.

        Plain forward pre/post hooks, deliberately: ``torch.utils.module_tracker.ModuleTracker`` keeps
        a handle on every module call's autograd nodes, which keeps the checkpoint recomputation's
        saved tensors alive after backward (an over-prediction found against the real CPU peak)."""
        for name, module in modules.items():
            self._hooks.append(module.register_forward_pre_hook(partial(self._enter_module, name)))
            self._hooks.append(module.register_forward_hook(self._exit_module))

    def _enter_module(self, name: str, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(name)

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def _autocast_region(self) -> bool:
        """Whether CUDA autocast would be on here (:class:`AutocastProbe`): in the forward where the
        torch function that issued the operator ran under autocast (not in the fp32 regions); in
        backward inside activation checkpointing's recomputation (a module forward running: only blocks
        of the autocast stacks are checkpointed, and the recomputation re-enters autocast), not the
        backward's own operators (autocast does not apply to them)."""
        if self._probe is None:
            return False
        if self.phase_name == "backward":
            return self._probe.modules_running > 0
        return self._probe.on

    def _module(self) -> str:
        return self._stack[-1] if self._stack else ""

    def category(self) -> str:
        """What a storage created now counts as: ``recycling``, ``activations`` (grad pass), ``loss``,
        ``backward``, ``optimizer_temp`` (or the phase's name, e.g. ``setup``)."""
        if self.phase_name == "forward":
            return "recycling" if self._recycling() else "activations"
        return {"optimizer": "optimizer_temp"}.get(self.phase_name, self.phase_name)

    # -- modes -------------------------------------------------------------------------------------

    def __enter__(self) -> StorageTracker:
        if self._probe is not None:
            self._probe.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._probe is not None:
            self._probe.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for undo in self._undo:
            undo()
        self._undo.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):
            # a host read of fake data (e.g. the loss's ``isfinite(...).all()`` check): answer "finite"
            return _FAKE_SCALARS.get(args[0].dtype, 1)
        kwargs = kwargs or {}
        casts: list[torch.Tensor] = []
        if self.cuda_autocast and func.overloadpacket.__name__ in _CUDA_FP32_OPS and self._autocast_region():
            ups = tuple(_up(a) for a in args)
            casts = [u for a, u in zip(args, ups) if u is not a]  # the copies made here, not the inputs passed
            args = ups
        out = func(*args, **kwargs)
        tensors = casts + [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if tensors:
            tag = (self.category(), self._module()) + ((func.overloadpacket.__name__,) if self.origins else ())
            for t in tensors:
                self._add(t.untyped_storage(), tag)
        return out

    # -- results -----------------------------------------------------------------------------------

    def breakdown(self) -> tuple[dict[str, int], dict[str, int]]:
        """(bytes live at the peak by category, activation/backward bytes by top-level module)."""
        by_cat: dict[str, int] = defaultdict(int)
        by_mod: dict[str, int] = defaultdict(int)
        for (cat, mod, *_), n in self.peak_live.items():
            by_cat[cat] += n
            if mod and n:
                by_mod[mod] += n
        return _nonzero(by_cat), _nonzero(by_mod)

    def origins_at_peak(self, top: int = 40) -> dict[str, int]:
        """``origins=True``: the ``top`` largest live groups at the peak, ``"category/module/op"`` ->
        bytes (op: the operator that created the storage; module empty outside the attributed ones)."""
        by_origin: dict[str, int] = defaultdict(int)
        for tag, n in self.peak_live.items():
            by_origin["/".join(tag)] += n
        return dict(list(_nonzero(by_origin).items())[:top])


_FAKE_SCALARS = {torch.bool: True, torch.float32: 1.0, torch.float64: 1.0, torch.bfloat16: 1.0, torch.float16: 1.0}


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _nonzero(d: dict[str, int]) -> dict[str, int]:
    return dict(sorted(((k, v) for k, v in d.items() if v), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------------------------
# Fake step
# ---------------------------------------------------------------------------------------------


def _fake_module_(module: torch.nn.Module, mode: Any) -> None:
    """Replace ``module``'s parameters and buffers by fake tensors of the same shape, dtype, device."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                fake = mode.from_tensor(p.data)
                with mode:
                    sub._parameters[name] = torch.nn.Parameter(fake.clone(), requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = mode.from_tensor(b)




@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a ``world_size``-rank ``fake`` process group (collectives are no-ops
    with real output buffers); nothing when ``world_size`` is 1."""
    import torch.distributed as dist

    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("estimate-memory with DAP > 1 needs a process without torch.distributed initialised")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def estimate_memory(
    cfg: TrainConfig,
    target: str = "cuda",
    kernels: str | None = None,
    recycling: int | None = None,
    cuda_graphs: bool | None = None,
    origins: bool = False,
    sites: bool = False,
    observe: Callable[[Any, StorageTracker], contextlib.AbstractContextManager] | None = None,
) -> MemoryEstimate:
    """Predicted peak memory per rank of one training step of ``cfg`` (DAP size ``cfg.dap``).

    ``target``: ``cuda`` (512-byte blocks, CUDA autocast rules; ``kernels`` default ``triton``) or
    ``cpu`` (exact storage sizes, CPU autocast; default ``torch``). ``recycling``: no-grad passes
    (default 1 where the run recycles: the no-grad passes are identical and free everything but the
    recycled outputs, so one stands for all; ``tests/perf/test_memory.py`` checks that two give the same
    peak within 1 %: 0.14 % on ``tiny``, the batch slices copied differ by one recycling slice). ``cuda_graphs``: add the graph pool (default: as
    ``--cuda-graphs`` resolves on the target: CUDA, at DAP 1 or with ``step``, unless ``cfg.cuda_graphs`` is off).
    ``origins``: also report what was live at the peak by category, module and creating operator
    (``MemoryEstimate.origins``; debugging). ``sites``: also by allocating line, as a CUDA trace names them
    (:mod:`scalefold.perf.memory_sites`). ``observe(step, tracker)``: a context entered around the step
    outside the tracker, so a dispatch mode there sees its casts too (:mod:`scalefold.perf.flops`).
    Checkpointing policy: on, off or N (``auto``: :func:`scalefold.perf.recompute.resolve_policy` first).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scalefold.model.factory import build_model_config
    from scalefold.train.step import TrainingStep, synthetic_batch, training_model

    if target not in ("cuda", "cpu"):
        raise ValueError(f"target must be cuda or cpu, got {target!r}")
    kernels = kernels or ("triton" if target == "cuda" else "torch")
    if kernels not in ("triton", "torch"):
        raise ValueError(f"kernels must be triton or torch, got {kernels!r}")
    if cfg.bp != 1:
        raise ValueError("estimate-memory models DAP; branch parallelism (--bp 2) is not modelled")
    if cuda_graphs is None:  # the whole step's graphs at any DAP; the recycling graphs (and auto's count) at DAP 1
        cuda_graphs = target == "cuda" and cfg.cuda_graphs != "off" and (cfg.dap == 1 or cfg.cuda_graphs == "step")
    t0 = time.perf_counter()
    model_cfg = build_model_config(cfg)
    model = training_model(cfg, model_cfg, "cpu")  # real (small) initialisation; then swapped for fakes
    real_batch = synthetic_batch(cfg, model, "cpu")
    n = recycling
    _build_constant_tables()
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # cached constant tables (residue geometry) are real
    _fake_module_(model, mode)
    batch = {k: mode.from_tensor(v) for k, v in real_batch.items()}
    tracker = StorageTracker(block=CUDA_BLOCK_BYTES if target == "cuda" else 1,
                             cuda_autocast=target == "cuda" and cfg.precision == "bf16", origins=origins,
                             sites=sites)  # fmt: skip
    with fake_process_group(cfg.dap), scoped_env("SCALEFOLD_KERNELS", kernels), _code_paths(target), warnings.catch_warnings(), mode:
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")  # the optimizer's view check
        _wrap_parallel(cfg, model, model_cfg)
        step = TrainingStep.build(cfg, "cpu", model=model, batch=batch)
        n = min(1, step.num_ensembles - 1) if n is None else n
        tracker.register(model.parameters(), "parameters")
        tracker.register(model.buffers(), "buffers")
        for g in step.opt.groups:
            tracker.register([g.grad], "gradients")
            tracker.register([t for t in (g.exp_avg, g.exp_avg_sq, g.swa, g.compute) if t is not None], "optimizer_state")
        tracker.register(batch.values(), "batch")
        tracker.attribute({**dict(model.named_children()), "loss": step.loss_fn})
        tracker.passes(model)  # recycling vs grad pass by the pass's grad mode, not the operator's
        with observe(step, tracker) if observe else contextlib.nullcontext(), tracker:
            step.run(n, phase=tracker.phase)
    by_cat, by_mod = tracker.breakdown()
    step_peak = tracker.peak
    peak, pool, graphs = _graph_peak(cfg, target, bool(cuda_graphs), tracker, batch.values(), n)
    settings = {
        "preset": cfg.model_preset, "precision": cfg.precision, "crop": crop_size(model_cfg), "dap": cfg.dap,
        "target": target, "kernels": kernels,
        "recycling_passes": n, "activation_checkpointing": policy_name(cfg.activation_checkpointing),
        "checkpointed_blocks": model.checkpointed_blocks(), "cuda_graphs": graphs,
    }  # fmt: skip
    return MemoryEstimate(
        peak_bytes=int(peak), step_peak_bytes=int(step_peak), cuda_graph_pool_bytes=int(pool), breakdown=by_cat,
        modules=by_mod, phase_peaks=dict(tracker.phase_peaks), origins=tracker.origins_at_peak() if origins else {},
        sites=tracker.sites.at_peak(SITES_KEPT) if tracker.sites is not None else {}, settings=settings,
        seconds=time.perf_counter() - t0,
    )  # fmt: skip


def _code_paths(target: str) -> contextlib.AbstractContextManager:
    """For a CUDA target, the places that choose their code by device (dropout, the optimizer's chunks, the gradient
    norm) take the GPU's path on the fake step's CPU tensors (:mod:`scalefold.kernels.device_path`)."""
    return device_path.as_cuda() if target == "cuda" else contextlib.nullcontext()


def _build_constant_tables() -> None:
    """Build the model's cached constant tables (real tensors) before a fake step: built first inside the
    fake mode, the cache would keep fake tensors, and a later real step of the process would fail on them."""
    from scalefold.model.all_atom import rigid_group_constants

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        rigid_group_constants(dtype, torch.device("cpu"))


def _graph_peak(cfg: TrainConfig, target: str, cuda_graphs: bool, tracker: StorageTracker, batch: Any,
                n: int) -> tuple[int, int, str | bool]:  # fmt: skip
    """(peak, graph pool, which graphs: ``step`` / ``recycling`` / ``False``) of the tracked step: whole-step
    graphs where the run asks for them (``--cuda-graphs step`` on CUDA, at any DAP: its collectives are inside),
    else the recycling passes' graphs where they apply."""
    if cuda_graphs and target == "cuda" and cfg.cuda_graphs == "step":
        return (*_with_whole_step_pool(tracker, batch), "step")
    peak, pool = _with_graph_pool(tracker, bool(cuda_graphs and n > 0))
    return peak, pool, "recycling" if cuda_graphs else False


def _with_whole_step_pool(tracker: StorageTracker, batch: Any) -> tuple[int, int]:
    """(peak, pool) with whole-step CUDA graphs (``--cuda-graphs step``, ``auto`` where it captures): the graphs'
    one pool holds the step's whole transient peak (everything above the state at the forward's start) for the
    run, the static batch buffers beside it, and an eager step -- SWA's first update, a shape not captured,
    the evaluation's forward (no grad: less) -- needs its own transient peak outside the pool: the state, the
    pool, the static batch and one more transient peak."""
    base = tracker.phase_start["forward"]
    transient = max(tracker.peak - base, 0)
    static_batch = sum(_block(t.untyped_storage().nbytes(), tracker.block) for t in batch)
    return tracker.peak + transient + static_batch, transient + static_batch


def _block(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block if block > 1 else nbytes


def _with_graph_pool(tracker: StorageTracker, graphed: bool) -> tuple[int, int]:
    """(peak, CUDA-graph pool) of the tracked step: with graphed recycling passes the pool (what the
    recycling pass held above the forward's start) stays allocated under the grad pass."""
    if not graphed:
        return tracker.peak, 0
    base = tracker.phase_start["forward"]
    pool = max(tracker.phase_peaks.get("recycling", 0) - base, 0)
    grad_part = max(v for k, v in tracker.phase_peaks.items() if k != "recycling")
    return max(grad_part + pool, tracker.phase_peaks.get("recycling", 0)), pool


def policy_name(policy: object) -> str:
    """An activation-checkpointing policy as the command line writes it: ``on``, ``off``, ``N``, ``auto``."""
    from scalefold.config.recompute import parse_checkpointing

    parsed = parse_checkpointing(policy)
    if isinstance(parsed, bool):
        return "on" if parsed else "off"
    return str(parsed)


def crop_size(model_cfg: Any) -> int:
    """The training crop of a model config (its features' ``train_sequence_crop_size``)."""
    from scalefold.data.pipeline import FeatureConfig

    return FeatureConfig.from_reference_config(model_cfg.to_dict()).train_sequence_crop_size


def _wrap_parallel(cfg: TrainConfig, model: torch.nn.Module, model_cfg: Any) -> None:
    """DAP: the model's stacks joined to this rank's DAP group, as the training loop wraps them."""
    if cfg.dap == 1:
        return
    from scalefold.data.pipeline import FeatureConfig
    from scalefold.distributed import setup_model_parallel

    features = FeatureConfig.from_reference_config(model_cfg.to_dict())
    ctx = setup_model_parallel(cfg.dap, 1, 0, cfg.parallel_evoformer, crop_size=features.train_sequence_crop_size)
    ctx.wrap(model)


def format_estimate(est: MemoryEstimate) -> str:
    """Human-readable summary: the peak, what is live at it, the largest modules."""
    s = est.settings
    lines = [f"{s['preset']} crop {s['crop']} {s['precision']} DAP {s['dap']} on {s['target']} "
             f"(kernels {s['kernels']}, activation checkpointing {s['activation_checkpointing']}, "
             f"{s['recycling_passes']} recycling pass(es) run): peak {est.peak_bytes / GiB:.2f} GiB per rank"]  # fmt: skip
    if est.cuda_graph_pool_bytes:
        lines.append(f"  incl. CUDA-graph pool {est.cuda_graph_pool_bytes / GiB:.2f} GiB "
                     f"(eager step alone {est.step_peak_bytes / GiB:.2f} GiB)")  # fmt: skip
    lines.append("  live at the peak: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in est.breakdown.items()) + " GiB")
    top = list(est.modules.items())[:6]
    lines.append("  by module (activations/backward): " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in top) + " GiB")
    if est.origins:
        lines.append("  by origin (category/module/op), largest first:")
        lines += [f"    {v / 2**20:10.2f} MiB  {k}" for k, v in list(est.origins.items())[:20]]
    if est.sites:
        lines.append(format_sites(est.sites))
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`estimate_memory` rows (crop x DAP x precision), peak GiB per rank."""
    daps = sorted({r["dap"] for r in rows})
    lines = ["| crop | precision | " + " | ".join(f"DAP {d}" for d in daps) + " |",
             "| --- | --- | " + " | ".join("---" for _ in daps) + " |"]  # fmt: skip
    for crop, prec in dict.fromkeys((r["crop"], r["precision"]) for r in rows):
        cells = []
        for d in daps:
            r = next((r for r in rows if (r["crop"], r["precision"], r["dap"]) == (crop, prec, d)), None)
            cells.append("-" if r is None else ("n/a" if "error" in r else f"{r['peak_bytes'] / GiB:.1f}"))
        lines.append(f"| {crop} | {prec} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "format_estimate", "format_table", "check_fits", "policy_name", "AutocastProbe", "hook_every_module", "remove_hooks", "usable_bytes", "measure_cpu_peak", "MemoryEstimate", "StorageTracker", "estimate_memory", "fake_process_group", "CUDA_BLOCK_BYTES", "DAP_SIZES",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Validation: the real peak of the same step on CPU
# ---------------------------------------------------------------------------------------------


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure_cpu_peak(cfg: TrainConfig, recycling: int | None = None) -> dict[str, int]:
    """The real peak bytes of the first training step of ``cfg`` on CPU, from the CPU allocator itself.

    The step runs under ``torch.profiler`` with ``profile_memory``: every allocation and free of
    PyTorch's CPU allocator is recorded with the allocator's running total, op-internal scratch
    included. Peak = bytes live before the step (parameters, buffers, optimizer buffers, batch: their
    storages) + the highest running total during the step above its start. Same step, same recycling
    passes as :func:`estimate_memory` with ``target="cpu"``.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from scalefold.train.step import TrainingStep

    step = TrainingStep.build(cfg)
    n = min(1, step.num_ensembles - 1) if recycling is None else recycling
    live = list(step.model.parameters()) + list(step.model.buffers()) + list(step.batch.values())
    for g in step.opt.groups:
        live += [t for t in (g.grad, g.exp_avg, g.exp_avg_sq, g.swa, g.compute) if t is not None]
    baseline = _storage_bytes(live)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.run(n)
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
        stack.extend(e.children)
    events.sort()
    start = events[0][2] - events[0][1] if events else 0
    step_peak = max((total for _, _, total in events), default=start) - start
    return {"peak_bytes": baseline + step_peak, "baseline_bytes": baseline, "step_bytes": step_peak,
            "allocations": sum(1 for _, size, _ in events if size > 0)}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Start-up check and the table
# ---------------------------------------------------------------------------------------------


def usable_bytes(capacity_bytes: int) -> int:
    """What a step may use of a device with ``capacity_bytes``: minus the CUDA context / workspaces
    reserve and the fragmentation margin."""
    return int((capacity_bytes - CONTEXT_RESERVE_BYTES) / (1 + FRAGMENTATION_MARGIN))


def check_fits(
    train_cfg: TrainConfig, model_cfg: Any = None, device: torch.device | str | None = None,
    capacity_bytes: int | None = None, estimate: Any = None,
) -> str | None:  # fmt: skip
    """``None`` if one training step of ``train_cfg`` is predicted to fit the device, else a message
    with the prediction, the device's memory and the smallest DAP size that fits (or that none does).

    ``device``: a CUDA device (its total memory is the capacity); CPU devices are not checked (None).
    ``capacity_bytes`` overrides the device's memory (tests, planning for another card). ``model_cfg``
    is accepted for the trainer's convenience (the estimate rebuilds it from ``train_cfg``, the same
    way). ``estimate(cfg) -> MemoryEstimate`` replaces :func:`estimate_memory` (tests; a cached table).
    Each DAP size tried costs one fake-tensor step (seconds for small presets, minutes for MLPerf).
    """
    del model_cfg
    if capacity_bytes is None:
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        capacity_bytes = torch.cuda.get_device_properties(device).total_memory
    run = estimate or (lambda c: estimate_memory(c, target="cuda"))
    limit = usable_bytes(capacity_bytes)
    mine = run(train_cfg)
    if mine.peak_bytes <= limit:
        return None
    head = (f"predicted peak memory per rank {mine.peak_bytes / GiB:.1f} GiB (DAP {train_cfg.dap}, "
            f"{train_cfg.precision}) exceeds the {limit / GiB:.1f} GiB usable of the device's "
            f"{capacity_bytes / GiB:.1f} GiB")  # fmt: skip
    for dap in (d for d in DAP_SIZES if d > train_cfg.dap):
        try:
            other = run(replace(train_cfg, dap=dap))
        except ValueError:  # e.g. the crop is not divisible by this DAP size
            continue
        if other.peak_bytes <= limit:
            return f"{head}; DAP {dap} fits ({other.peak_bytes / GiB:.1f} GiB per rank): use --dap {dap}"
    return f"{head}; no DAP size up to {DAP_SIZES[-1]} fits: lower --crop-size or enable activation checkpointing"
