"""A cache of captured CUDA graphs, one per recycling situation (ScaleFold).

CPU launch overhead dominates AlphaFold2 steps at small per-GPU problem sizes, so ScaleFold captures
the training forward/backward in CUDA graphs. A graph is only valid for fixed shapes, dtypes and
control flow, so one graph is kept per key

    (tag -- e.g. the recycling count, input shapes/dtypes (and non-tensor literals), grad mode)

and graphs are captured only while the cache is in its *warm-up* phase (synthetic steps before
``run_start``): a key first seen afterwards runs eagerly instead of paying a capture inside the timed
region (counted in :attr:`GraphCacheStats.eager_uncaptured`). When CUDA graphs are unavailable (CPU,
or disabled) every call runs eagerly through the same code path.

The training loop uses it through :mod:`scalefold.compilation.graphed_step` (``--cuda-graphs``), which keys
the graphs of a step's no-grad recycling passes by recycling count and captures them before
``run_start``.

The CUDA calls sit behind a small :class:`GraphBackend` so the cache logic (keys, hits/misses,
capture-once, warm-up-only policy, static-input copying) is unit-tested on CPU with a fake backend.

* No-grad calls: the inputs are cloned into static buffers, the function is captured with
  ``torch.cuda.graph``; a replay copies the live inputs into the static buffers and returns the static
  outputs (overwritten by the next replay of the same key -- and, as all graphs of a backend share
  one memory pool, possibly by the replay of another key: consume or clone them first).
* Before each capture the backend runs the function eagerly on a side stream (the first iteration
  fills lazy caches, the others run with CUDA's sync check on: a host sync raises
  :class:`HostSyncInCapturedRegion` before capture starts), under autocast with its weight-cast cache
  off, and restores the caller's stream even when a capture fails.
* Grad-mode calls: ``torch.cuda.make_graphed_callables`` (forward and backward graphs); the function
  must be an ``nn.Module`` so its parameters receive gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from scalefold.compilation import capture_compiles

#: Eager iterations on a side stream before each capture (the CUDA-graph notes' warm-up). The first
#: fills lazy caches (cuBLAS handles, ``functools.cache`` constant tables, ``--compile`` guards); the
#: others run with CUDA sync checks on (:func:`_no_host_syncs`). (Capturing a DDP-wrapped backward would
#: need >= 11; the cache captures no DDP work.)
DEFAULT_WARMUP_ITERS = 3


# ----------------------------------------------------------------------------------------------
# Flattening nested inputs (dict / list / tuple of tensors and literals)
# ----------------------------------------------------------------------------------------------


def flatten(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """(tensors in order, structure); literals stay in the structure (and so in the key)."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return ("T",)
        if isinstance(x, dict):
            return ("D", tuple((k, walk(v)) for k, v in x.items()))
        if isinstance(x, (list, tuple)):
            return ("L" if isinstance(x, list) else "U", tuple(walk(v) for v in x))
        if x is None or isinstance(x, (bool, int, float, str)):
            return ("V", x)
        raise TypeError(f"unsupported input type for CUDA-graph capture: {type(x).__name__}")

    return tensors, walk(obj)


def unflatten(tensors: list[torch.Tensor], structure: Any) -> Any:
    it = iter(tensors)

    def build(node: Any) -> Any:
        kind = node[0]
        if kind == "T":
            return next(it)
        if kind == "D":
            return {k: build(v) for k, v in node[1]}
        if kind in ("L", "U"):
            items = [build(v) for v in node[1]]
            return items if kind == "L" else tuple(items)
        return node[1]

    return build(structure)


@dataclass(frozen=True)
class GraphKey:
    tag: Hashable
    signature: tuple  # per tensor: (shape, dtype, device type, requires_grad)
    structure: Any  # nesting and literal values
    grad_enabled: bool


def make_key(tag: Hashable, args: tuple, grad_enabled: bool) -> tuple[GraphKey, list[torch.Tensor]]:
    tensors, structure = flatten(args)
    signature = tuple((tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for t in tensors)
    return GraphKey(tag=tag, signature=signature, structure=structure, grad_enabled=grad_enabled), tensors


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------


class GraphBackend(Protocol):
    """What the cache needs from CUDA."""

    device_type: str  # the device whose work the graphs capture ("cuda"; a CPU fake in tests says "cpu")

    def is_available(self) -> bool: ...

    def capture(self, fn: Callable[..., Any], static_args: tuple) -> Callable[[], Any]:
        """Capture ``fn(*static_args)`` (no grad); return a replay that re-runs it on the static args."""
        ...

    def capture_with_grad(self, module: torch.nn.Module, example_args: tuple) -> Callable[..., Any]:
        """Forward+backward graphs of ``module`` (``make_graphed_callables``); return the graphed callable."""
        ...


class HostSyncInCapturedRegion(RuntimeError):
    """The function to capture synchronises with the host (``.item()``, a pageable host-to-device copy
    such as ``torch.tensor(..., device="cuda")``, ``nonzero``, boolean-mask indexing, ...): it cannot be
    captured. Raised by the eager warm-up, before any capture starts."""


@contextmanager
def _no_host_syncs() -> Iterator[None]:
    """CUDA's synchronising operations raise inside (``torch.cuda.set_sync_debug_mode("error")``)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _first_device(obj: Any) -> torch.device | None:
    tensors, _ = flatten(obj)
    return next((t.device for t in tensors if t.device.type == "cuda"), None)


class CudaGraphBackend:
    """The real thing: ``torch.cuda.graph`` / ``torch.cuda.make_graphed_callables``.

    All graphs of one backend share one memory pool (``pool``): safe as long as they are never replayed
    concurrently and each replay's outputs are consumed (cloned) before another graph of the pool
    replays -- a later capture may reuse, for its outputs, memory an earlier graph uses as scratch.
    """

    device_type = "cuda"

    def __init__(
        self, warmup_iters: int = DEFAULT_WARMUP_ITERS, pool: Any = None, capture_error_mode: str = "thread_local"
    ) -> None:
        if warmup_iters < 2:
            raise ValueError("warmup_iters must be >= 2 (one to fill lazy caches, then sync-checked ones)")
        self.warmup_iters = warmup_iters
        # "thread_local": CUDA calls of *other* threads during a capture (the NCCL watchdog polling its
        # events under DDP, a pin-memory thread) do not invalidate it; "global" would forbid them
        self.capture_error_mode = capture_error_mode
        self.pool = pool if pool is not None else (torch.cuda.graph_pool_handle() if self.is_available() else None)
        self.generators: list[torch.Generator] = []

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def register_generators(self, generators: list[torch.Generator]) -> None:
        """Generators besides the default one that captured kernels draw from (the Parallel Evoformer's
        branches'): each capture registers its CUDA ones, so every replay advances their offsets as eager does."""
        self.generators = [g for g in generators if g.device.type == "cuda"]

    def capture(self, fn: Callable[..., Any], static_args: tuple) -> Callable[[], Any]:
        device = _first_device(static_args) or torch.device("cuda", torch.cuda.current_device())
        with ExitStack() as stack:
            stack.enter_context(torch.cuda.device(device))
            if torch.is_autocast_enabled("cuda"):
                # the autocast weight-cast cache must be off while capturing: a cast cached before the
                # capture would be read by every replay (stale weights), one cached inside it would
                # hand graph-pool memory to later eager code
                dtype = torch.get_autocast_dtype("cuda")
                stack.enter_context(torch.autocast("cuda", dtype=dtype, cache_enabled=False))
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in range(self.warmup_iters):
                    if i == 0:  # fills lazy caches (their one-off host-to-device copies are fine here)
                        fn(*static_args)
                        continue
                    try:
                        with _no_host_syncs():
                            fn(*static_args)
                    except RuntimeError as exc:
                        if "synchronizing CUDA operation" not in str(exc):
                            raise
                        raise HostSyncInCapturedRegion(
                            f"the function synchronises with the host, so it cannot be captured ({exc})"
                        ).with_traceback(exc.__traceback__) from None
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.generators and not hasattr(graph, "register_generator_state"):
                raise RuntimeError(f"torch {torch.__version__} cannot register a generator with a CUDA graph "
                                   "(CUDAGraph.register_generator_state): the branches' dropout would be frozen")  # fmt: skip
            for generator in self.generators:
                graph.register_generator_state(generator)
            previous = torch.cuda.current_stream()
            compiled: list[capture_compiles.Compilation] = []
            try:
                with capture_compiles.watching(compiled), \
                        torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):  # fmt: skip
                    static_out = fn(*static_args)
            except Exception as exc:
                if compiled:  # the compile broke the capture: name it, not CUDA's invalidated-capture error
                    raise capture_compiles.CompiledInCapture(f"{compiled[0].describe()} inside the captured region") from exc
                raise
            finally:
                # torch.cuda.graph.__exit__ skips restoring the stream when capture_end raises (an
                # invalidated capture): every later kernel would run on the capture side stream
                if torch.cuda.current_stream() != previous:
                    torch.cuda.set_stream(previous)
            if compiled:  # a capture that held despite a compile inside: not trusted either
                raise capture_compiles.CompiledInCapture(f"{compiled[0].describe()} inside the captured region")

        def replay() -> Any:
            graph.replay()
            return static_out

        return replay

    def capture_with_grad(self, module: torch.nn.Module, example_args: tuple) -> Callable[..., Any]:
        if not all(isinstance(a, torch.Tensor) for a in example_args):
            raise TypeError("grad-mode capture (make_graphed_callables) takes a flat tuple of tensors")
        return torch.cuda.make_graphed_callables(
            module, example_args, num_warmup_iters=self.warmup_iters, allow_unused_input=True
        )


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------


@dataclass
class GraphCacheStats:
    hits: int = 0  # replays of an existing graph
    captures: int = 0  # misses that captured a graph (warm-up phase)
    eager_uncaptured: int = 0  # misses after warm-up: ran eagerly, no capture
    eager_disabled: int = 0  # calls while graphs are unavailable/disabled

    @property
    def misses(self) -> int:
        return self.captures + self.eager_uncaptured


@dataclass
class _Entry:
    static_inputs: list[torch.Tensor] | None  # no-grad graphs: buffers the replay reads
    replay: Callable[..., Any]


class CudaGraphCache:
    """Calls ``fn(*args)`` through a per-key captured graph.

    Args:
        fn: the function (or ``nn.Module``) to capture; must be capturable (no host syncs, static
            control flow for a given key).
        backend: CUDA calls; defaults to :class:`CudaGraphBackend`.
        enabled: ``False`` forces eager execution.
        capture_during_warmup_only: capture new keys only between :meth:`start_warmup` (the initial
            state) and :meth:`end_warmup`; later misses run eagerly.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        backend: GraphBackend | None = None,
        enabled: bool = True,
        capture_during_warmup_only: bool = True,
    ) -> None:
        self.fn = fn
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.enabled = enabled and self.backend.is_available()
        self.capture_during_warmup_only = capture_during_warmup_only
        self.in_warmup = True
        self.stats = GraphCacheStats()
        self._entries: dict[GraphKey, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[GraphKey]:
        return list(self._entries)

    def start_warmup(self) -> None:
        self.in_warmup = True

    def end_warmup(self) -> None:
        """Called at ``run_start``: from now on unseen keys run eagerly."""
        self.in_warmup = False

    def clear(self) -> None:
        self._entries.clear()

    def key(self, *args: Any, tag: Hashable = None) -> GraphKey:
        """The key a call ``cache(*args, tag=tag)`` would use now (in the current grad mode)."""
        return make_key(tag, args, torch.is_grad_enabled())[0]

    def has(self, *args: Any, tag: Hashable = None) -> bool:
        """Whether ``cache(*args, tag=tag)`` would replay a captured graph (not capture, not run eagerly)."""
        return self.enabled and self.key(*args, tag=tag) in self._entries

    def __call__(self, *args: Any, tag: Hashable = None) -> Any:
        if not self.enabled:
            self.stats.eager_disabled += 1
            return self.fn(*args)
        grad = torch.is_grad_enabled()
        key, tensors = make_key(tag, args, grad)
        entry = self._entries.get(key)
        if entry is None:
            if self.capture_during_warmup_only and not self.in_warmup:
                self.stats.eager_uncaptured += 1
                return self.fn(*args)
            entry = self._capture(key, args, tensors)
            self._entries[key] = entry
            self.stats.captures += 1
        else:
            self.stats.hits += 1
        if entry.static_inputs is None:
            return entry.replay(*args)
        with torch.no_grad():
            for static, live in zip(entry.static_inputs, tensors):
                if static.data_ptr() != live.data_ptr():
                    static.copy_(live)
        return entry.replay()

    def _capture(self, key: GraphKey, args: tuple, tensors: list[torch.Tensor]) -> _Entry:
        if key.grad_enabled:
            if not isinstance(self.fn, torch.nn.Module):
                raise TypeError("grad-mode CUDA-graph capture needs an nn.Module (its parameters get gradients)")
            return _Entry(static_inputs=None, replay=self.backend.capture_with_grad(self.fn, args))
        static = [t.detach().clone() for t in tensors]
        static_args = unflatten(static, key.structure)
        return _Entry(static_inputs=static, replay=self.backend.capture(self.fn, static_args))
