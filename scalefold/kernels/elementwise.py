"""The model's memory-bound elementwise chains: the plain PyTorch reference, or each compiled alone.

Between its matmuls the model runs short chains of elementwise ops over its largest tensors: the
attention logits' glue (``softmax(a + (mask - 1) * inf + bias)``), the sigmoid gates
(``x * sigmoid(g)``, ``sigmoid(g) * mask * p``) and the dropout + residual adds (``x + u * mask``). Eager PyTorch reads and writes the whole tensor
once per op; one compiled function per chain reads its inputs once and writes once. The structure module's
geometry (:data:`GEOMETRY_CHAINS`, :mod:`scalefold.kernels.geometry`: frames composed, side chains placed, IPA's
points and logits) is the other kind: tiny ``[N_res]`` tensors in fp32, hundreds of kernels per iteration eagerly,
so bound by launches, not bytes; compiled, each chain is one kernel (two or three where inductor splits its
reductions: IPA's logits, the attended points) each way. On a GPU these
chains are bound by memory bandwidth (and by the host launching one kernel per op), so fusing them is
where ``torch.compile`` pays -- and, being small graphs of a few ops, they compile in seconds, unlike
the whole block stacks and the loss (NVIDIA's MLPerf code compiles such small functions too).

:func:`enable` (what ``compile_blocks(..., regions=("elementwise",))`` calls) switches the calls of
:mod:`scalefold.kernels` (``dropout_add``, ``sigmoid_gate``, ``gated_projection``, the softmax glue and
output gate of the PyTorch attention) to ``torch.compile`` of the very reference functions in
:mod:`scalefold.kernels.reference` (``fullgraph``: a graph break is an error, not a silent fallback;
``dynamic``: one graph serves every size, so the Evoformer, extra-MSA and template stacks and every
recycling count share it; a new graph only per rank, dtype, broadcast pattern and grad mode).
:func:`disable` returns to the references; :func:`mode` is a context manager for both. The Triton
kernels (attention, LayerNorm) fuse their own glue and are left alone; so is LayerNorm on the PyTorch
path (one kernel already in fp32; as a compiled chain it needed a graph per rank, width and view layout:
more compile time than it saves on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from scalefold.kernels import reference

#: The structure module's geometry (:mod:`scalefold.kernels.geometry`): its frames and points written element
#: by element in fp32, hundreds of tiny kernels per block iteration eagerly, each chain one compiled kernel
GEOMETRY_CHAINS = ("backbone_update", "sidechain_frames", "structure_outputs", "ipa_points", "ipa_logits",
                   "ipa_attended_points")  # fmt: skip
#: The chains compiled: the functions of these names in :mod:`scalefold.kernels.reference` themselves.
CHAINS = ("masked_softmax", "sigmoid_gate", "gated_projection", "dropout_add") + GEOMETRY_CHAINS
#: The chains ``--compile`` compiles by default, per device type: on a GPU all of them; on the CPU only
#: those that were not slower than eager there (demo preset, 1 thread, bench step, alternating: the triangle
#: gated projection 1.08x alone; softmax glue 0.96x, output gate 0.99x, dropout + residual 0.92x, all four
#: 0.82x -- ATen's CPU kernels are vectorised already and the tensors are cache-sized, so fusing saves little
#: while each call pays dynamo's guards). ``compile_blocks(regions=("elementwise:all",))`` compiles all.
DEFAULT_CHAINS = {"cuda": CHAINS, "cpu": ("gated_projection",)}
#: Graphs one chain may hold (dynamo's per-function recompile limit is 8; the model has more dtype /
#: broadcast / grad-mode variants than that, each compiled once)
RECOMPILE_LIMIT = 64

_RECORDING = "(recording)"  # the pseudo-backend of recording(): the references, each call reported
_state: dict[str, Any] = {"backend": None, "chains": CHAINS}
_compiled: dict[str, dict[str, Callable[..., torch.Tensor]]] = {}  # backend -> chain -> compiled function


def enable(backend: str = "inductor", chains: Sequence[str] | None = None) -> dict[str, object]:
    """Route the chains (``chains``: those of :data:`CHAINS` named, default all) through ``torch.compile``
    (``backend``); returns ``{name: code object}`` (what dynamo caches each chain's graphs under, for
    :class:`~scalefold.compilation.regions.CompileReport`)."""
    chains = tuple(CHAINS if chains is None else chains)
    unknown = [c for c in chains if c not in CHAINS]
    if unknown:
        raise ValueError(f"unknown elementwise chain(s) {unknown}; expected some of {CHAINS}")
    _state["chains"] = chains
    if backend not in _compiled:
        _compiled[backend] = {
            name: collector_off(torch.compile(getattr(reference, name), dynamic=True, fullgraph=True, backend=backend))
            for name in CHAINS
        }
    _state["backend"] = backend
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7's name
    setattr(config, limit, max(getattr(config, limit), RECOMPILE_LIMIT))
    # no graph per coincidence of sizes (two dims that happened to be equal at the first call)
    torch.fx.experimental._config.use_duck_shape = False
    return {name: getattr(reference, name).__code__ for name in chains}


def collector_off(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a compiled function or region) called with Python's cyclic garbage collector off, and back on after
    where it was on: a first call compiles, and dynamo's and AOTAutograd's tracing make many objects that the
    collector would scan again and again (~7 % of a compile's CPU on the tiny model); the step loop runs with it
    off anyway (``Trainer.fit``). A call costs two flag switches."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()

    return call


def default_chains(device_type: str) -> tuple[str, ...]:
    """The chains compiled by default on ``device_type`` (:data:`DEFAULT_CHAINS`; another device: all)."""
    return tuple(DEFAULT_CHAINS.get(device_type, CHAINS))


def disable() -> None:
    """Back to the plain references (the compiled functions are kept for a later :func:`enable`)."""
    _state["backend"] = None


def enabled() -> bool:
    return _state["backend"] is not None


@contextlib.contextmanager
def mode(backend: str | None) -> Iterator[None]:
    """Within the block, the chains run compiled with ``backend`` (None: the references)."""
    before, chains = _state["backend"], _state["chains"]
    enable(backend, chains) if backend is not None else disable()
    try:
        yield
    finally:
        enable(before, chains) if before is not None else disable()


@contextlib.contextmanager
def recording(
    observe: Callable[[str, tuple], None], finished: Callable[[str, tuple, Any], None] | None = None,
    chains: Sequence[str] | None = None,
) -> Iterator[None]:  # fmt: skip
    """Within the block every chain (``chains``: those named, default all) runs as its reference, but routed
    and shaped as compiled chains are (the dispatch point merges the operands' leading dimensions), and each
    call is first reported to ``observe(name, args)``: the calls a compiled run compiles for
    (:mod:`scalefold.perf.compile_sites`); ``finished(name, args, out)`` (``out``: a tensor or a tuple of them), when given, is called when the
    chain returns (the counter of :mod:`scalefold.perf.flops` counts the operators in between as one
    compiled kernel)."""

    def observed(name: str) -> Callable[..., torch.Tensor]:
        fn = getattr(reference, name)

        def call(*args: Any) -> torch.Tensor:
            observe(name, args)
            out = fn(*args)
            if finished is not None:
                finished(name, args, out)
            return out

        return call

    before = dict(_state)
    _compiled[_RECORDING] = {name: observed(name) for name in CHAINS}
    _state.update(backend=_RECORDING, chains=tuple(CHAINS if chains is None else chains))
    try:
        yield
    finally:
        _state.update(before)
        _compiled.pop(_RECORDING, None)


def chain(name: str) -> Callable[..., torch.Tensor]:
    """The function that computes chain ``name`` now: compiled when enabled, else the reference."""
    backend = _state["backend"]
    return getattr(reference, name) if backend is None or name not in _state["chains"] else _compiled[backend][name]


__all__ = [
    "CHAINS",
    "DEFAULT_CHAINS",
    "GEOMETRY_CHAINS",
    "RECOMPILE_LIMIT",
    "chain",
    "default_chains",
    "disable",
    "enable",
    "enabled",
    "mode",
    "recording",
]
