"""CUDA graphs of the training step's no-grad recycling passes (``--cuda-graphs recycling``, ``on``).

The whole step's graphs (``--cuda-graphs step``) are :mod:`scalefold.compilation.whole_step_graphs`'; the
mode a run gets is :func:`scalefold.compilation.graph_modes.resolve_mode`'s.

The training loop calls a :class:`GraphedStep` instead of ``net(batch)``. A step with recycling
count ``n`` (the batch keeps ``t[..., :n + 1]``) runs ``n`` passes of the model without autograd and
one pass with it (:meth:`AlphaFold.forward <scalefold.model.alphafold.AlphaFold.forward>`). This
module captures the **no-grad recycling passes** of each recycling count as one CUDA graph, kept in a
:class:`~scalefold.compilation.cuda_graphs.CudaGraphCache` keyed by

    (recycling count ``n`` -- with the training flag and the autocast state --, the shapes and dtypes
    of the ``n`` input slices, grad mode (off))

What is captured, and when:

* **Captured**: the ``n`` no-grad passes of a step (``n`` in ``1 .. R-1``; ``n = 0`` has none), from
  the model-feature slices ``[..., :n]`` to the recycled state ``(m0, z, x)`` they hand to the last
  pass. The differentiated last pass, the auxiliary heads, the loss, backward, gradient clipping and
  the optimizer run **eagerly** (see *Limits*).
* **Warm-up** (:meth:`GraphedStep.warm_up`, called by the loop between ``init_start`` and
  ``init_stop``, i.e. before ``run_start``): on a synthetic batch with the training shapes (crop size,
  MSA clusters, extra MSA, templates: :func:`scalefold.compilation.graph_modes.synthetic_step_batch`; the training pipeline pads every
  sample to them), one graph per recycling count ``1 .. R-1`` is captured (the backend runs a few eager
  iterations on a side stream first, all but the first with CUDA's sync check on, so a host sync in
  the passes is reported with its file and line before any capture starts), replayed once and
  compared with an eager run of the same passes from the same RNG seed: the recycled state, and the
  state every random number generator is left in (torch CPU/CUDA, Python, NumPy). The RNG state is
  restored afterwards, so warm-up does not shift the run's random numbers, and no training data is
  read before ``run_start`` (the batch is synthetic). Afterwards the cache captures nothing more: no
  capture inside the timed region.
* **Step**: the live slices are copied into the graph's static input buffers, the graph is replayed,
  its recycled state cloned (static outputs are overwritten by the next replay, and graphs share one
  memory pool); then ``net(batch)`` runs with the model's first ``n`` passes short-circuited to that
  state (:meth:`GraphedStep._skip_nograd_passes` swaps ``model.iteration`` for the duration of the
  call, so the DDP wrapper and ``AlphaFold.forward`` run unchanged). Dropout stays correct: a replay
  reads the generator's current seed and offset (set per step by the loop) and advances the offset by
  what the captured passes consume, as the eager passes would.

Fallbacks (the same numbers as the plain path, through ``net(batch)``):

* CPU / ``--cuda-graphs off`` / unsupported layouts: :meth:`GraphedStep.__call__` is ``net(batch)``
  (a transparent pass-through: bit-identical losses);
* a step whose key was not captured (other shapes, another autocast state, ...): eager, the reason
  logged once per recycling count and precision (``tag``), not per shape set: every miss is counted
  in :attr:`GraphedStepStats.eager_miss` and the run's summary;
* a capture that raises, or a replay that disagrees with eager at warm-up: graphs are switched off
  for the run, the reason logged once (every later step eager);
* ``n = 0`` (no no-grad pass) and calls under ``torch.no_grad``: eager.

Modes (:func:`scalefold.compilation.graph_modes.resolve_mode`,
:func:`scalefold.compilation.whole_step_graphs.resolve_step_mode`): ``auto`` -- the whole step on CUDA where it may be
captured (any DAP / BP; several data-parallel ranks with ``--grad-reduce flat``), else the recycling graphs
on CUDA without DAP/BP or the Parallel Evoformer, off elsewhere; ``on`` / ``recycling`` -- the recycling
graphs, a run where they cannot be used (not CUDA, DAP/BP > 1, ``--parallel-evoformer``:
:func:`uncapturable_reason`) refused (:class:`CudaGraphsUnavailable`, exit status 3 from the CLI); ``step``
-- the whole step, refused with several data-parallel ranks under DDP; ``off`` -- never.

Limits (by design; validate on a GPU before relying on the speed-up):

* **DDP**: safe. The captured passes run ``model.iteration`` directly under ``no_grad``: no autograd
  graph, no DDP hooks, no collectives; every rank captures its own graphs, independently (capture
  mode ``thread_local``, so the NCCL watchdog thread polling its events cannot invalidate it; the
  loader and evaluation threads start after warm-up). The
  differentiated pass and backward (DDP bucket all-reduce + its clipping comm hook) stay eager, so
  neither ``_set_static_graph`` nor ``find_unused_parameters=False`` is needed. Whole-step capture
  (:class:`scalefold.compilation.whole_step_graphs.WholeStepGraphs`) with several data-parallel ranks takes the flat gradient all-reduce instead
  (DDP's reducer hooks run on the host).
* **DAP / BP**: not captured by the recycling graphs (``auto`` takes the whole step instead, ``on`` refuses):
  their all-to-all / all-gather / broadcast collectives run inside the recycling passes, whose graphs are
  captured per rank, not agreed across a group as the whole step's are.
* The graphed share of a step is the no-grad passes only: with ``R = 4`` (3 recycling iterations),
  ``n`` averages 1.5 no-grad passes against one forward + backward (about 3 forward passes).
* Parameters must stay at their addresses (``FlatAdamSWA`` updates its flat buffers in place; resume
  and ``--init-from`` load before warm-up) -- a graph reads them by address. Not checked per step
  (that would walk every parameter tensor on the hot path): nothing in the loop reallocates them.
  ``--compile`` regions are traced by their own warm-up before capture.
* Memory: the graphs of all recycling counts share one pool (about the peak of the largest no-grad
  pass plus each graph's recycled state), held for the run and not available to the eager grad pass.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from scalefold.compilation.cuda_graphs import CudaGraphBackend, CudaGraphCache, GraphBackend
from scalefold.compilation.graph_modes import (
    VALIDATION_SEED,
    failure_site,
    resolve_mode,
    rng_states,
    same_state,
    synthetic_step_batch,
)
from scalefold.errors import exception_summary

#: Relative L2 error between a warm-up replay and the eager passes above which graphs are refused
#: (catches a graph reading the wrong buffers -- O(1) errors --, not bf16 rounding).
VALIDATION_TOLERANCE = 5e-2


def uncapturable_reason(model: torch.nn.Module) -> str | None:
    """Why ``model``'s no-grad recycling passes cannot be captured by the recycling graphs, or ``None``.

    The Parallel Evoformer's branches draw their dropout from their own generators
    (:class:`~scalefold.distributed.branch_parallel.BranchGenerators`), which only the whole step's capture
    registers and seeds before each step (``--cuda-graphs step``); a recycling graph would freeze their draws.
    """
    return PARALLEL_EVOFORMER_UNCAPTURABLE if getattr(model, "parallel_evoformer", False) else None


PARALLEL_EVOFORMER_UNCAPTURABLE = (
    "the Parallel Evoformer's branches draw from their own generators, which the recycling graphs do not register "
    "(--cuda-graphs step does)"
)


@dataclass
class GraphedStepStats:
    graphed: int = 0  # steps whose no-grad passes replayed a graph
    eager_no_passes: int = 0  # steps with recycling count 0 (nothing to replay)
    eager_miss: int = 0  # steps whose key was never captured
    eager_off: int = 0  # steps while graphs are off (CPU, --cuda-graphs off, a failed capture)


class GraphedStep:
    """``step(batch)`` -- the training forward ``net(batch)`` with CUDA-graphed no-grad recycling passes.

    Args:
        model: the :class:`~scalefold.model.AlphaFold` (unwrapped; its ``iteration`` is what is captured).
        net: what the loop calls (``model`` or its DDP wrapper); default ``model``.
        enabled: ``False`` makes every call ``net(batch)``.
        reason: why graphs are on/off (logged).
        backend: the CUDA calls (default :class:`~scalefold.compilation.cuda_graphs.CudaGraphBackend`; tests pass
            a CPU fake).
        log: info lines (start-up summary, fallbacks); ``None``: silent.
        warn: fallback reasons (default: ``stderr`` of every rank, prefixed with ``rank``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        net: Callable[..., Any] | None = None,
        enabled: bool = True,
        reason: str = "",
        backend: GraphBackend | None = None,
        log: Callable[[str], None] | None = None,
        warn: Callable[[str], None] | None = None,
        rank: int = 0,
        tolerance: float = VALIDATION_TOLERANCE,
    ) -> None:
        self.model = model
        self.net = net if net is not None else model
        self.rank = rank
        self.log = log
        self.warn = warn if warn is not None else self._stderr
        self.tolerance = tolerance
        self.reason = reason
        if enabled and backend is None:
            backend = CudaGraphBackend()
        self.backend = backend
        self.cache = CudaGraphCache(self._nograd_passes, backend=backend, enabled=enabled and backend is not None)
        self.stats = GraphedStepStats()
        self._missed: set = set()
        method = getattr(type(model), "iteration", None)  # the class's method, never a swapped one
        self._iteration = method.__get__(model) if method is not None else None
        if self.active and self._iteration is None:
            raise TypeError(f"cuda graphs: {type(model).__name__} has no iteration() to capture")

    # -- the step ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.cache.enabled

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> Any:
        if not self.active or not torch.is_grad_enabled():
            self.stats.eager_off += 1
            return self.net(batch)
        n = int(batch["aatype"].shape[-1]) - 1
        if n < 1:
            self.stats.eager_no_passes += 1
            return self.net(batch)
        inputs = self._inputs(batch, n)
        tag = self._tag(n, batch["aatype"].device.type)
        with torch.no_grad():  # the key of the no-grad passes; a replay (or, in warm-up, a capture)
            if self.cache.in_warmup or self.cache.has(inputs, tag=tag):
                recycled = tuple(t.clone() for t in self.cache(inputs, tag=tag))  # static outputs get overwritten
            else:
                recycled = None
                self._log_miss(n, inputs, tag)
        if recycled is None:
            self.stats.eager_miss += 1
            return self.net(batch)
        self.stats.graphed += 1
        with self._skip_nograd_passes(n, recycled):
            return self.net(batch)

    # -- warm-up (before run_start) -----------------------------------------------------------------

    def warm_up(self, batch: Mapping[str, torch.Tensor], autocast: bool = False) -> list[int]:
        """Capture the no-grad passes of every recycling count ``1 .. R-1`` of ``batch`` (``[..., R]``,
        the training shapes), check each replay against eager, then close the warm-up phase (later
        unseen keys run eagerly). Returns the recycling counts captured. RNG state is restored."""
        if not self.active:
            self.cache.end_warmup()
            return []
        aatype = batch["aatype"]
        device_type = aatype.device.type
        num_slices = int(aatype.shape[-1])
        rng_devices = [aatype.device] if device_type == "cuda" else []
        was_training = self.model.training
        t0 = time.perf_counter()
        captured: list[int] = []
        self.model.train()
        self.cache.start_warmup()
        try:
            with torch.random.fork_rng(devices=rng_devices), torch.no_grad(), \
                    torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):  # fmt: skip
                for n in range(1, num_slices):
                    inputs = self._inputs(batch, n)
                    tag = self._tag(n, device_type)
                    try:
                        self.cache(inputs, tag=tag)  # capture (+ one replay)
                        problem = self._check_replay(inputs, tag)
                    except Exception as exc:  # noqa: BLE001 -- any capture failure: eager for the run
                        problem = f"capture failed: {exception_summary(exc)}{failure_site(exc)}"
                    if problem is not None:
                        self._turn_off(f"recycling count {n}: {problem}")
                        captured = []
                        break
                    captured.append(n)
        finally:
            self.cache.end_warmup()
            self.model.train(was_training)
        if self.active and self.log is not None:
            self.log(f"cuda graphs: captured the no-grad recycling passes of recycling counts {captured} "
                     f"in {time.perf_counter() - t0:.1f} s ({self.reason}); the grad pass, loss and "
                     "backward run eagerly")  # fmt: skip
        return captured

    def summary(self) -> str:
        s = self.stats
        return (f"cuda graphs: {s.graphed} step(s) graphed, {s.eager_no_passes} with no recycling pass, "
                f"{s.eager_miss} eager (uncaptured shapes), {s.eager_off} eager (graphs off: {self.reason})")  # fmt: skip

    # -- internals ----------------------------------------------------------------------------------

    def _inputs(self, batch: Mapping[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
        """The model features of the ``n`` no-grad passes: ``[..., :n]`` of each."""
        names = getattr(self.model, "_model_features", None) or sorted(batch)
        return {name: batch[name][..., :n] for name in names if name in batch}

    def _tag(self, n: int, device_type: str) -> Hashable:
        autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else None
        return ("recycling", n, self.model.training, autocast, dtype)

    def _nograd_passes(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """What ``AlphaFold.forward`` does for its passes before the last: ``n`` iterations without
        autograd, each fed the previous one's detached recycled state. The captured function."""
        first = next(iter(inputs.values()))
        device_type = first.device.type
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if torch.is_autocast_enabled(device_type):  # no weight-cast cache inside a graph
                dtype = torch.get_autocast_dtype(device_type)
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
            recycled = None
            for it in range(int(first.shape[-1])):
                feats = {name: t[..., it] for name, t in inputs.items()}
                _, recycled = self._iteration(feats, recycled, gradient_checkpointing=False)
                recycled = tuple(t.detach() for t in recycled)
        return recycled

    @contextmanager
    def _skip_nograd_passes(self, n: int, recycled: tuple[torch.Tensor, ...]) -> Iterator[None]:
        """While active, the model's first ``n`` (no-grad) passes return ``recycled`` without computing;
        pass ``n`` (the grad pass) runs the real ``iteration`` on it."""
        model = self.model
        calls = 0
        original = self._iteration

        def iteration(feats: Any, prev: Any, gradient_checkpointing: bool = False) -> Any:
            nonlocal calls
            index, calls = calls, calls + 1
            if index < n:
                if torch.is_grad_enabled():
                    raise RuntimeError(f"cuda graphs: pass {index} of {n + 1} runs with grad; the graphed "
                                       "recycling passes assume AlphaFold.forward's no-grad passes")  # fmt: skip
                return {}, recycled
            return original(feats, prev, gradient_checkpointing=gradient_checkpointing)

        had_own = "iteration" in vars(model)
        saved = vars(model).get("iteration")
        model.iteration = iteration
        try:
            yield
        finally:
            if had_own:
                model.iteration = saved
            else:
                del model.iteration
        if calls != n + 1:
            raise RuntimeError(f"cuda graphs: the model ran {calls} passes, expected {n + 1}")

    def _check_replay(self, inputs: Mapping[str, torch.Tensor], tag: Hashable) -> str | None:
        """``None`` when a replay matches the eager passes from the same seed -- values, and the random
        number generators' states afterwards (the grad pass must draw what it draws after the eager
        passes) --, else the problem."""
        device = next(iter(inputs.values())).device
        torch.manual_seed(VALIDATION_SEED)
        graphed = [t.clone() for t in self.cache(inputs, tag=tag)]
        rng_graphed = rng_states(device)
        torch.manual_seed(VALIDATION_SEED)
        eager = self._nograd_passes(inputs)
        rng_eager = rng_states(device)
        for name, g, e in zip(("m0", "z", "x"), graphed, eager):
            g, e = g.float(), e.float()
            if not bool(torch.isfinite(e).all()):
                continue  # nothing to compare against
            if not bool(torch.isfinite(g).all()):
                return f"replay gives non-finite {name} where eager is finite"
            rel = float((g - e).norm() / e.norm().clamp_min(1e-12))
            if rel > self.tolerance:
                return f"replay differs from eager ({name}: relative error {rel:.2e} > {self.tolerance:.0e})"
        for (which, g), (_, e) in zip(rng_graphed, rng_eager):
            if not same_state(g, e):
                return (f"the replay leaves the {which} random number generator in another state than the eager "
                        "passes (random numbers drawn on the host, a private generator or a reseed inside the "
                        "captured passes?)")  # fmt: skip
        return None

    def _turn_off(self, why: str) -> None:
        self.reason = f"turned off: {why}"
        self.cache.enabled = False
        self.cache.clear()  # the graphs, their static buffers and (once unreferenced) their memory pool
        if self.backend is not None and self.backend.device_type == "cuda" and torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # hand the graphs' pool back to the eager allocator
            except Exception:  # noqa: BLE001 -- a broken capture may have left an error behind
                pass
        self.warn(f"cuda graphs: {why}; every step runs eagerly")

    def _log_miss(self, n: int, inputs: Mapping[str, torch.Tensor], tag: Hashable) -> None:
        if tag in self._missed:  # once per tag: unpadded batches would otherwise log every new shape
            return
        self._missed.add(tag)
        shapes = {name: tuple(t.shape) for name, t in list(inputs.items())[:3]}
        self.warn(f"cuda graphs: no graph for recycling count {n} with tag {tag} and input shapes {shapes}... "
                  f"(captured {len(self.cache)} at warm-up); such steps run eagerly (not logged again for "
                  "this recycling count; counted in the summary)")  # fmt: skip

    def _stderr(self, line: str) -> None:
        sys.stderr.write(f"rank {self.rank}: {line}\n")
        sys.stderr.flush()



def setup_graphed_step(
    mode: str,
    model: torch.nn.Module,
    net: Callable[..., Any],
    features: Any,
    device: torch.device,
    dtype: torch.dtype,
    autocast: bool,
    model_parallel: int = 1,
    rank: int = 0,
    verbose: bool = True,
    backend: GraphBackend | None = None,
) -> GraphedStep:
    """The loop's step forward for ``--cuda-graphs mode``, graphs captured (before ``run_start``).

    ``features`` is the run's :class:`~scalefold.data.pipeline.FeatureConfig` (training shapes and
    ``R``). Off (CPU, ``off``, DAP/BP): a pass-through to ``net``.
    """
    available = backend.is_available() if backend is not None else torch.cuda.is_available()
    graph_device = backend.device_type if backend is not None else "cuda"
    enabled, reason = resolve_mode(mode, device.type, model_parallel, available, graph_device,
                                   unsupported=uncapturable_reason(model))  # fmt: skip
    log = (lambda line: print(line, flush=True)) if verbose else None
    step = GraphedStep(model, net, enabled=enabled, reason=reason, backend=backend, log=log, rank=rank)
    if step.active:
        step.warm_up(synthetic_step_batch(features, model, device, dtype), autocast=autocast)
    elif verbose and mode != "off" and device.type == "cuda":
        print(f"cuda graphs: off ({reason})", flush=True)
    return step



__all__ = ["PARALLEL_EVOFORMER_UNCAPTURABLE", "VALIDATION_TOLERANCE", "GraphedStep", "GraphedStepStats",
           "setup_graphed_step", "uncapturable_reason"]  # fmt: skip
