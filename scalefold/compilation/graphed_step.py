"""CUDA graphs of the training step (``--cuda-graphs``): the recycling passes, or the whole step.

Two levels. ``--cuda-graphs recycling`` (``on``, its old name): :class:`GraphedStep`, the no-grad
recycling passes of each recycling count as one graph (below). ``--cuda-graphs step``:
:class:`WholeStepGraphs`, the whole training step of each recycling count as **one graph** -- no-grad
passes, grad pass, loss, backward, clipping, the cross-rank agreement and the Adam + SWA update applied
or skipped on the device (:meth:`scalefold.train.step.TrainingStep.compute`, which reads nothing back to
the host) -- from static batch buffers the loader's slices are copied into, all graphs in one memory
pool, captured at warm-up before ``run_start``, each replay compared with an eager step from the same
state and seed, every warm-up step undone (optimizer snapshot, model buffers, RNG). At every layout: DAP's
and BP's collectives and the flat gradient all-reduce (``--grad-reduce flat``) are tensor collectives inside
the graph, every rank of the training group capturing the same sequence and agreeing on each verdict; the
Parallel Evoformer's branches draw from generators of their own, seeded before the step and registered with
the capture. Not captured: runs whose gradients DDP's host-side reducer averages (:data:`WHOLE_STEP_DDP`;
``step`` is refused there, ``auto`` falls back), steps before SWA's first update (a host-decided copy;
eager). ``auto`` takes the widest that works: the whole step where it may be captured and its capture
holds, else the recycling passes, else eager. On a CPU ``step`` runs the emulated capture
(:mod:`scalefold.compilation.emulated_capture`); on a GPU the warm-up check against eager decides (a failure
turns the graphs off on every rank with one line, and ``auto`` falls back).

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
  MSA clusters, extra MSA, templates: :func:`synthetic_step_batch`; the training pipeline pads every
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

Modes (:func:`resolve_mode`, :func:`resolve_step_mode`): ``auto`` -- the whole step on CUDA where it may be
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
  (:class:`WholeStepGraphs`) with several data-parallel ranks takes the flat gradient all-reduce instead
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

import random
import sys
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scalefold.compilation.cuda_graphs import CudaGraphBackend, CudaGraphCache, GraphBackend
from scalefold.config.training import CUDA_GRAPHS_MODES, ConfigError
from scalefold.errors import exception_summary

MODES = CUDA_GRAPHS_MODES  # one list: the config validates it too
#: Relative L2 error between a warm-up replay and the eager passes above which graphs are refused
#: (catches a graph reading the wrong buffers -- O(1) errors --, not bf16 rounding).
VALIDATION_TOLERANCE = 5e-2
#: The whole step's warm-up check (relative L2 of the gradient buffer, weights, moments, loss, norm between
#: replays and eager steps from the same state): a wrong gradient scale or a Python value baked into the
#: graph (a learning rate, a counter) is an O(1) error; a replay of the same kernels is bit-identical or
#: differs by the order of atomics (bf16 gradients: ~1e-3). The emulated capture on the CPU checks bit
#: for bit (tolerance 0).
WHOLE_STEP_TOLERANCE = 2e-2
#: The whole step's warm-up check: consecutive replays compared with as many eager steps, per recycling count
#: captured (each after the backend's ``warmup_iters`` eager iterations and the recording itself). The window's
#: plan (``bench/headline_plan.py``) reads it from here: the capture's cost in eager steps.
WHOLE_STEP_CHECKED_STEPS = 2
_VALIDATION_SEED = 20240613
#: the learning rates of the warm-up check's consecutive steps (different, so a baked rate shows)
_VALIDATION_LRS = (1e-3, 4e-4)


STRICT_MODES = ("on", "recycling", "step")  # refused where graphs cannot be used


class CudaGraphsUnavailable(ConfigError):
    """``--cuda-graphs on|recycling|step`` where graphs cannot be used (not CUDA, DAP/BP > 1): refused before
    training."""


def resolve_mode(mode: str, device_type: str, model_parallel: int = 1, backend_available: bool = True,
                 graph_device_type: str = "cuda", unsupported: str | None = None) -> tuple[bool, str]:  # fmt: skip
    """``(graphs on, why)`` for ``--cuda-graphs mode`` on ``device_type`` with DAP x BP = ``model_parallel``;
    ``unsupported``: why the model's recycling passes cannot be captured (:func:`uncapturable_reason`).

    ``on`` raises :class:`CudaGraphsUnavailable` where graphs cannot be used; ``auto`` quietly resolves to off there.
    """
    if mode not in MODES:
        raise ValueError(f"--cuda-graphs must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return False, "--cuda-graphs off"
    if emulated_capture(mode, device_type):  # the whole step's capture, emulated (its graphs are the CPU's)
        graph_device_type, backend_available = "cpu", True
    if mode in STRICT_MODES and mode != "on":  # recycling / step: refused where graphs cannot be used, as on
        try:
            enabled, why = resolve_mode("on", device_type, model_parallel, backend_available, graph_device_type,
                                        unsupported)  # fmt: skip
        except CudaGraphsUnavailable as exc:
            raise CudaGraphsUnavailable(str(exc).replace("--cuda-graphs on", f"--cuda-graphs {mode}")) from None
        return enabled, why.replace("--cuda-graphs on", f"--cuda-graphs {mode}")
    if device_type != graph_device_type or not backend_available:
        if mode == "on":
            raise CudaGraphsUnavailable(f"--cuda-graphs on needs a CUDA device (this run computes on {device_type}); "
                             "use --cuda-graphs auto or off")  # fmt: skip
        return False, f"the device is {device_type}, not CUDA"
    if model_parallel > 1:
        why = "DAP/BP collectives run inside the recycling passes and are not captured"
        if mode == "on":
            raise CudaGraphsUnavailable(
                f"--cuda-graphs on is not supported with --dap/--bp > 1 ({why}); use auto or off"
            )
        return False, why
    if unsupported:
        if mode == "on":
            raise CudaGraphsUnavailable(f"--cuda-graphs on is not supported here: {unsupported}; use auto or off")
        return False, unsupported
    return True, f"--cuda-graphs {mode}: CUDA device, no DAP/BP"


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
                        problem = f"capture failed: {exception_summary(exc)}{_where(exc)}"
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
        torch.manual_seed(_VALIDATION_SEED)
        graphed = [t.clone() for t in self.cache(inputs, tag=tag)]
        rng_graphed = _rng_states(device)
        torch.manual_seed(_VALIDATION_SEED)
        eager = self._nograd_passes(inputs)
        rng_eager = _rng_states(device)
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
            if not _same_state(g, e):
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


def _rng_states(device: torch.device) -> list[tuple[str, Any]]:
    """The generators a captured region must leave as eager code would: torch's CPU and (CUDA) device
    generators, Python's ``random`` and NumPy's global state."""
    states: list[tuple[str, Any]] = [("torch CPU", torch.get_rng_state())]
    if device.type == "cuda":
        states.append(("CUDA", torch.cuda.get_rng_state(device)))
    states += [("Python", random.getstate()), ("NumPy", np.random.get_state())]
    return states


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


def _where(exc: BaseException) -> str:
    """`` at path:line (function)`` of the innermost frame of the ``scalefold`` package, outside this
    machinery, that raised ``exc`` (e.g. the model line doing a host sync), or ``""``."""
    package = Path(__file__).resolve().parents[1]  # .../scalefold
    ours = {Path(__file__).resolve(), package / "compilation" / "cuda_graphs.py",
            package / "compilation" / "emulated_capture.py"}
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(package) and path not in ours:
            return f" at {path.relative_to(package.parent)}:{frame.lineno} ({frame.name})"
    return ""


def synthetic_step_batch(features: Any, model: torch.nn.Module, device: torch.device,
                         dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """A random batch with the training shapes (crop, MSA clusters, extra MSA, templates, all ``R``
    recycling slices) -- what the pipeline pads every training sample to -- on ``device`` (``seed``: its
    own generator's)."""
    from scalefold.data.batch import move_batch
    from scalefold.model.features import make_synthetic_batch

    embedder = model.config.input_embedder_config
    batch = make_synthetic_batch(
        features.train_sequence_crop_size, features.max_msa_clusters, features.max_extra_msa,
        features.max_templates, num_recycling_iters=features.num_ensembles - 1, tf_dim=embedder.tf_dim,
        msa_dim=embedder.msa_dim, seed=seed,
    )  # fmt: skip
    return move_batch(batch, device, dtype)


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


# ----------------------------------------------------------------------------------------------------
# Whole-step graphs (--cuda-graphs step)
# ----------------------------------------------------------------------------------------------------

#: why whole-step capture is not offered with several data-parallel ranks
WHOLE_STEP_DDP = ("DDP's bucket all-reduce runs through its reducer's host-side hooks and the clipping hook's "
                  "future callback, which a CUDA graph cannot hold")  # fmt: skip


def resolve_step_mode(mode: str, device_type: str, model_parallel: int = 1, world_size: int = 1,
                      backend_available: bool = True, graph_device_type: str = "cuda",
                      unsupported: str | None = None, bp: int = 1, flat_reduce: bool = False) -> tuple[bool, str]:  # fmt: skip
    """``(whole-step graphs wanted, why)`` for ``--cuda-graphs mode``: ``step`` and ``auto`` want them on CUDA
    (``step`` also on a CPU, emulated), at every layout: DAP and BP (``model_parallel`` = DAP x ``bp``), whose
    all-to-all / all-gather / reduce-scatter / broadcast are tensor collectives on preallocated buffers captured
    inside the graph (NCCL; gloo under the CPU emulation), every rank of a group capturing the same sequence
    and agreeing on the verdict, the Parallel Evoformer's branches drawing from generators the capture registers
    (:class:`~scalefold.distributed.branch_parallel.BranchGenerators`). Several training ranks
    (``world_size`` > 1) need ``flat_reduce``: the gradient all-reduce of the optimizer's flat buffers
    (:mod:`scalefold.optim.flat_reduce`, ``--grad-reduce flat|auto``), tensor collectives inside the graph,
    not DDP's host-side reducer (:data:`WHOLE_STEP_DDP`); ``step`` is refused without it
    (:class:`CudaGraphsUnavailable`), ``auto`` then falls back quietly, as it does off CUDA.
    ``unsupported``: why the model's whole step cannot be captured (none today: the recycling graphs'
    :func:`uncapturable_reason` does not apply, the whole step registers the branches' generators)."""
    if mode not in ("step", "auto"):
        return False, f"--cuda-graphs {mode}"
    emulated = emulated_capture(mode, device_type)
    enabled, why = resolve_mode(mode, device_type, 1, backend_available, graph_device_type, unsupported)
    if not enabled:
        return False, why
    if world_size > 1 and not flat_reduce:
        if mode == "step":
            raise CudaGraphsUnavailable(f"--cuda-graphs step with {world_size} training ranks needs --grad-reduce flat "
                                        f"or auto ({WHOLE_STEP_DDP}); or use --cuda-graphs recycling or auto")  # fmt: skip
        return False, WHOLE_STEP_DDP
    where = "emulated on the CPU" if emulated else "CUDA"
    dap = model_parallel // max(bp, 1)
    parts = ([f"DAP {dap}"] if dap > 1 else []) + ([f"BP {bp}"] if bp > 1 else [])
    ranks = f"{' x '.join(parts)} (its collectives inside the graph)" if parts else "one rank"
    if world_size > 1:
        ranks = f"{world_size} training ranks, {ranks if parts else 'data parallel'}, the flat gradient all-reduce inside"
    return True, f"--cuda-graphs {mode}: the whole step, {where}, {ranks}"


@dataclass
class WholeStepStats:
    graphed: int = 0  # steps replayed from a whole-step graph
    eager_swa_copy: int = 0  # steps before SWA's first update (a copy, decided on the host: not captured)
    eager_miss: int = 0  # steps whose shapes were not captured
    eager_off: int = 0  # steps while whole-step graphs are off


@dataclass
class _StepGraph:
    static: dict[str, torch.Tensor]  # the batch buffers the graph reads
    replay: Callable[[], Any]


class WholeStepGraphs:
    """``graphs(batch, n)``: the training step's :meth:`~scalefold.train.step.TrainingStep.compute` of
    recycling count ``n`` replayed from one CUDA graph -- no-grad passes, grad pass, loss, backward,
    clipping, agreement and the (device-side skippable) Adam + SWA update -- or ``None`` (run it eagerly).

    ``step`` is the :class:`~scalefold.train.step.TrainingStep` (its ``compute``, ``opt``, ``model``,
    ``set_flags``); its parameters, optimizer buffers, learning-rate tensor and agreement flags keep their
    addresses for the run, so a replay reads this step's values. Per recycling count one graph, from
    static batch buffers (the loader's slices are copied in); all graphs share the backend's one memory
    pool. :meth:`warm_up` (before ``run_start``) captures them on a synthetic batch of the training
    shapes, replays each once and compares it with an eager step from the same state and seed (loss,
    norm, verdict, the weights' update, the generators' states); a capture that fails or disagrees turns
    whole-step graphs off with one line. Every warm-up step is undone (optimizer snapshot, model buffers,
    RNG): the run starts from the same state as without graphs.

    Not captured (eager, counted in :meth:`summary`): steps before SWA's first update (its "copy the
    weights" branch is decided on the host), shapes other than the warm-up's (one line per recycling
    count), every step once graphs are off.
    """

    def __init__(self, step: Any, backend: GraphBackend | None = None, enabled: bool = True, reason: str = "",
                 log: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None, rank: int = 0,
                 tolerance: float | None = None, group: Any = None) -> None:  # fmt: skip
        self.step = step
        self.group = group  # the ranks that decide the capture together (None: this rank alone)
        if enabled and backend is None:
            backend = CudaGraphBackend()
        self.backend = backend
        self.enabled = enabled and backend is not None and backend.is_available()
        if tolerance is None:  # the emulation replays the same CPU operators: bit for bit
            tolerance = 0.0 if getattr(backend, "emulated", False) else WHOLE_STEP_TOLERANCE
        self.reason, self.log, self.rank, self.tolerance = reason, log, rank, tolerance
        self.warn = warn if warn is not None else (lambda line: sys.stderr.write(f"rank {rank}: {line}\n"))
        self.stats = WholeStepStats()
        self._graphs: dict[Hashable, _StepGraph] = {}
        self._missed: set[int] = set()
        self._memory = _MemoryWatch(False)
        #: ``figures()`` -> (graph pool, an eager step's transient peak, what is left beside them) in bytes, or
        #: ``None`` (not measured: the CPU); default: the CUDA allocator's (tests plant their own)
        self.memory_figures: Callable[[], tuple[int, int, int] | None] | None = None

    @property
    def active(self) -> bool:
        return self.enabled

    def captured(self) -> list[int]:
        return sorted(key[0] for key in self._graphs)

    # -- the step ------------------------------------------------------------------------------------

    def __call__(self, batch: Mapping[str, torch.Tensor], n: int) -> Any:
        if not self.enabled:
            self.stats.eager_off += 1
            return None
        if not self.step.opt.capturable:
            self.stats.eager_swa_copy += 1
            return None
        graph = self._graphs.get(self._key(batch, n))
        if graph is None:
            self.stats.eager_miss += 1
            if n not in self._missed:
                self._missed.add(n)
                self.warn(f"cuda graphs: no whole-step graph for recycling count {n} with these shapes (captured "
                          f"{self.captured()}); such steps run eagerly (not logged again; counted in the summary)")  # fmt: skip
            return None
        with torch.no_grad():
            for name, t in batch.items():
                graph.static[name].copy_(t)
        self.stats.graphed += 1
        result = graph.replay().clone()  # the static outputs are overwritten by the next replay
        # a replay runs no Python: the host's side of the captured step(apply=...) is marked here
        self.step.opt.mark_replayed()
        return result

    def summary(self) -> str:
        s = self.stats
        return (f"cuda graphs (whole step): {s.graphed} step(s) graphed, {s.eager_swa_copy} eager before SWA's first "
                f"update, {s.eager_miss} eager (uncaptured shapes), {s.eager_off} eager (off: {self.reason})")  # fmt: skip

    # -- warm-up (before run_start) ---------------------------------------------------------------------

    def warm_up(self, batch: Mapping[str, torch.Tensor], counts: list[int] | None = None,
                second: Mapping[str, torch.Tensor] | None = None) -> list[int]:  # fmt: skip
        """Capture the whole step of every recycling count (default ``0 .. R-1`` of ``batch``, ``[..., R]``)
        and check two consecutive replays against eager steps (the second on ``second``, another batch of
        the same shapes: default ``batch`` with its floating features perturbed); the step's state is
        restored afterwards."""
        if not self.enabled:
            return []
        aatype = batch["aatype"]
        counts = list(range(int(aatype.shape[-1]))) if counts is None else counts
        second = second if second is not None else perturbed_batch(batch)
        rng_devices = [aatype.device] if aatype.device.type == "cuda" else []
        t0 = time.perf_counter()
        state = self._save()
        branch_states = [g.get_state() for g in self._generators()]
        self._memory = _MemoryWatch(self.backend.device_type == "cuda" and torch.cuda.is_available())
        try:
            with torch.random.fork_rng(devices=rng_devices):
                self._seed(_VALIDATION_SEED)  # the branches' generators step-seeded: no host reseeding inside the step
                register = getattr(self.backend, "register_generators", None)
                if register is not None:
                    register(self._generators())
                for n in counts:
                    static = {k: v[..., : n + 1].clone() for k, v in batch.items()}
                    sources = [static, second] + [perturbed_batch(batch, _VALIDATION_SEED + k)
                                                  for k in range(2, WHOLE_STEP_CHECKED_STEPS)]  # fmt: skip
                    batches = tuple({k: v[..., : n + 1].clone() for k, v in src.items()}
                                    for src in sources[:WHOLE_STEP_CHECKED_STEPS])  # fmt: skip
                    try:
                        self._restore(state)
                        replay = self.backend.capture(self._compute, (static,))
                        problem = self._check(static, replay, state, batches)
                    except Exception as exc:  # noqa: BLE001 -- any capture failure: whole-step graphs off
                        problem = f"capture failed: {exception_summary(exc)}{_where(exc)}"
                    if not self._agreed(problem is None) and problem is None:
                        problem = "another rank's capture failed or disagreed (every rank of a group captures or none)"
                    if problem is not None:
                        self._turn_off(f"recycling count {n}: {problem}")
                        break
                    self._graphs[self._key(static, n)] = _StepGraph(static, replay)
                if self.enabled:  # the same on every rank of the group (each count's verdict was agreed)
                    problem = self._memory.problem(self.memory_figures)
                    if not self._agreed(problem is None) and problem is None:
                        problem = "memory: another rank's graphs leave no room for an eager step"
                    if problem is not None:
                        self._turn_off(problem)
        finally:
            self._restore(state, final=True)
            for g, saved in zip(self._generators(), branch_states):
                g.set_state(saved)
        if self.enabled and self.log is not None:
            how = " (emulated on the CPU: recorded once, replayed without the step's Python)" if self.emulated else ""
            self.log(f"cuda graphs: captured the whole step (recycling passes, grad pass, loss, backward, clipping, "
                     f"update) of recycling counts {self.captured()}{how} in {time.perf_counter() - t0:.1f} s; "
                     f"{WHOLE_STEP_CHECKED_STEPS} consecutive replays per count matched eager ({self.reason})")  # fmt: skip
        return self.captured()

    @property
    def emulated(self) -> bool:
        return bool(getattr(self.backend, "emulated", False))

    def _agreed(self, ok: bool) -> bool:
        """Whether every rank of :attr:`group` captured and checked this count (one all-reduce of a flag; NCCL
        needs every rank of a communicator to capture the same graphs, or none): ``ok`` alone without a group."""
        if self.group is None:
            return ok
        import torch.distributed as dist

        device = self.step.device if self.step.device.type == "cuda" else torch.device("cpu")
        flag = torch.tensor([1.0 if ok else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() > 0)

    def _generators(self) -> list[torch.Generator]:
        """The step's generators besides the default ones (the Parallel Evoformer's branches'): registered with
        each capture, their states compared after each warm-up step."""
        generators = getattr(self.step, "generators", None)
        return generators() if generators is not None else []

    def _seed(self, seed: int) -> None:
        seed_forward = getattr(self.step, "seed_forward", None)
        (seed_forward or torch.manual_seed)(seed)

    def _compute(self, batch: Mapping[str, torch.Tensor]) -> Any:
        """The captured function: the step's compute, its verdict left unread (the warm-up is undone)."""
        self.step.opt.forget_pending()
        return self.step.compute(batch)

    def _save(self) -> dict[str, Any]:
        self.step.opt.zero_grad()
        return {"opt": self.step.opt.snapshot(), "buffers": [b.detach().clone() for b in self.step.model.buffers()],
                "autocast_cache": getattr(self.step, "autocast_cache", True)}  # fmt: skip

    def _restore(self, state: dict[str, Any], final: bool = False) -> None:
        """Back to ``state``; while warming up (not ``final``) set for capture: SWA's averaging branch (every
        step after the first; earlier steps run eagerly) and no autocast weight-cast cache inside a graph."""
        opt = self.step.opt
        opt.restore(state["opt"])
        with torch.no_grad():
            for live, saved in zip(self.step.model.buffers(), state["buffers"]):
                live.copy_(saved)
        opt.zero_grad()
        if final:
            self.step.autocast_cache = state["autocast_cache"]
        else:
            opt._n_averaged_host = max(opt._n_averaged_host, 1)
            self.step.autocast_cache = False

    def _check(self, static: Mapping[str, torch.Tensor], replay: Callable[[], Any], state: dict[str, Any],
               batches: tuple[Mapping[str, torch.Tensor], ...]) -> str | None:  # fmt: skip
        """``None`` when consecutive replays from ``state`` -- one per batch of ``batches``, each with its own
        seed and learning rate -- match eager steps from the same state, seeds, rates and batches: the
        verdict, loss, gradient norm, the gradient buffer, the updated weights and moments, the generators'
        states. A wrong gradient (a scale, a stale buffer) or a Python value baked into the graph (the second
        step's rate, a host counter) shows in the second step if not the first."""
        runs = {}
        eager = self._memory.measured(lambda: self._compute(static))
        for name, run in (("replay", replay), ("eager", eager)):
            self._restore(state)
            rows = []
            for i, batch in enumerate(batches):
                with torch.no_grad():
                    for key, t in batch.items():
                        static[key].copy_(t)
                self.step.opt.set_lr(_VALIDATION_LRS[i % len(_VALIDATION_LRS)])
                self._seed(_VALIDATION_SEED + i)
                self.step.set_flags(False, 0)
                out = run().clone()
                self.step.opt.forget_pending()
                opt = self.step.opt
                rows.append((out, [t.detach().clone() for g in opt.groups for t in (g.grad, g.master, g.exp_avg)],
                             _rng_states(static["aatype"].device)
                             + [(f"branch {k}", g.get_state()) for k, g in enumerate(self._generators())]))  # fmt: skip
            runs[name] = rows
        for step, ((g, g_bufs, g_rng), (e, e_bufs, e_rng)) in enumerate(zip(runs["replay"], runs["eager"]), 1):
            problem = self._compare(g, e, g_bufs, e_bufs, g_rng, e_rng)
            if problem is not None:
                return f"warm-up step {step} of {len(batches)}: {problem}"
        return None

    def _compare(self, g: Any, e: Any, g_bufs: list[torch.Tensor], e_bufs: list[torch.Tensor], g_rng: list,
                 e_rng: list) -> str | None:  # fmt: skip
        if bool(g.apply) != bool(e.apply):
            return f"the replay's verdict (apply {bool(g.apply)}) differs from eager's ({bool(e.apply)})"
        names = ("gradient buffer", "weights", "Adam's first moment") * len(self.step.opt.groups)
        pairs = [("loss", g.loss, e.loss), ("grad norm", g.grad_norm, e.grad_norm)] + list(zip(names, g_bufs, e_bufs))
        for name, x, y in pairs:
            x, y = x.double(), y.double()
            if not bool(torch.isfinite(y).all()):
                continue
            if self.tolerance == 0:
                if not torch.equal(x, y):
                    return f"replay differs from eager ({name}: not bit-identical, max difference {float((x - y).abs().max()):.3e})"
                continue
            rel = float((x - y).norm() / y.norm().clamp_min(1e-30))
            if not rel <= self.tolerance:
                return f"replay differs from eager ({name}: relative error {rel:.2e} > {self.tolerance:.0e})"
        for (which, a), (_, b) in zip(g_rng, e_rng):
            if not _same_state(a, b):
                return f"the replay leaves the {which} random number generator in another state than eager"
        return None

    def _key(self, batch: Mapping[str, torch.Tensor], n: int) -> Hashable:
        return (n, tuple((k, tuple(t.shape), t.dtype) for k, t in sorted(batch.items())))

    def _turn_off(self, why: str) -> None:
        self.reason = f"turned off: {why}"
        self.enabled = False
        self._graphs.clear()
        if self.backend is not None and self.backend.device_type == "cuda" and torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 -- a broken capture may have left an error behind
                pass
        self.warn(f"cuda graphs: whole step {why}; whole-step graphs are off for this run")


def perturbed_batch(batch: Mapping[str, torch.Tensor], seed: int = _VALIDATION_SEED) -> dict[str, torch.Tensor]:
    """Another batch of ``batch``'s shapes for the warm-up check: floating features that are not 0/1 masks
    moved by a few per cent of their spread (a replay still reading the first batch shows), the rest as is."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in batch.items():
        if t.is_floating_point() and t.numel() and not bool(((t == 0) | (t == 1)).all()):
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype)
            t = t + 0.05 * t.float().std().to(t.dtype) * noise
        out[name] = t.clone()
    return out


def emulated_capture(mode: str, device_type: str) -> bool:
    """Whether ``--cuda-graphs mode`` on ``device_type`` runs the CPU emulation of a capture: ``step`` on a
    CPU (:mod:`scalefold.compilation.emulated_capture`; ``auto`` keeps eager there)."""
    return mode == "step" and device_type == "cpu"


def step_graph_backend(mode: str, device_type: str, backend: GraphBackend | None = None) -> tuple[GraphBackend | None, bool, str]:
    """``(backend, available, its device type)`` for whole-step graphs: the given one, the CPU emulation
    (:func:`emulated_capture`), else CUDA's."""
    if backend is None and emulated_capture(mode, device_type):
        from scalefold.compilation.emulated_capture import EmulatedGraphBackend

        backend = EmulatedGraphBackend()
    if backend is not None:
        return backend, backend.is_available(), backend.device_type
    return None, torch.cuda.is_available(), "cuda"


class _MemoryWatch:
    """The memory whole-step graphs hold on a GPU: the pool the captures reserved (held for the run) and the
    transient peak of an eager step (SWA's first update, a shape not captured, which run beside the pool),
    against the card's memory. Graphs that leave no room for an eager step are turned off at warm-up."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.reserved_before = torch.cuda.memory_reserved() if cuda else 0
        self.eager_transient = 0

    def measured(self, run: Callable[[], Any]) -> Callable[[], Any]:
        """``run`` with its transient peak above the memory it started from recorded (the largest seen)."""
        if not self.cuda:
            return run

        def timed() -> Any:
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = run()
            self.eager_transient = max(self.eager_transient, torch.cuda.max_memory_allocated() - start)
            return out

        return timed

    def figures(self) -> tuple[int, int, int] | None:
        if not self.cuda:
            return None
        free, _ = torch.cuda.mem_get_info()
        pool = torch.cuda.memory_reserved() - self.reserved_before
        unused_reserved = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return pool, self.eager_transient, free + unused_reserved

    def problem(self, planted: Callable[[], tuple[int, int, int] | None] | None = None) -> str | None:
        figures = planted() if planted is not None else self.figures()
        if figures is None:
            return None
        pool, eager, left = figures
        if eager <= left:
            return None
        gib = 2**30
        return (f"memory: the graphs' pool holds {pool / gib:.2f} GiB for the run and an eager step (SWA's first "
                f"update, an uncaptured shape) needs {eager / gib:.2f} GiB beside it, {left / gib:.2f} GiB is left on "
                "the card (use --activation-checkpointing on / auto, a larger --dap, or --cuda-graphs recycling)")  # fmt: skip


def setup_step_graphs(
    mode: str,
    step: Any,
    model: torch.nn.Module,
    features: Any,
    device: torch.device,
    dtype: torch.dtype,
    world_size: int = 1,
    model_parallel: int = 1,
    rank: int = 0,
    verbose: bool = True,
    backend: GraphBackend | None = None,
    bp: int = 1,
    group: Any = None,
    flat_reduce: bool = False,
    before_capture: Callable[[], None] | None = None,
) -> WholeStepGraphs:
    """Whole-step graphs for ``--cuda-graphs mode`` over ``step`` (a
    :class:`~scalefold.train.step.TrainingStep`), captured and checked on a synthetic batch of the training
    shapes (before ``run_start``). Off where :func:`resolve_step_mode` says so (``step`` is refused there)."""
    backend, available, graph_device = step_graph_backend(mode, device.type, backend)
    enabled, reason = resolve_step_mode(mode, device.type, model_parallel, world_size, available, graph_device,
                                        bp=bp, flat_reduce=flat_reduce)  # fmt: skip
    log = (lambda line: print(line, flush=True)) if verbose else None
    graphs = WholeStepGraphs(step, backend=backend, enabled=enabled, reason=reason, log=log, rank=rank, group=group)
    if graphs.active:
        if log is not None and graphs.emulated:
            log("cuda graphs: --cuda-graphs step on a CPU runs the emulated capture (each recycling count's step "
                "recorded once and replayed without its Python, refusing what a CUDA capture refuses)")  # fmt: skip
        if before_capture is not None:
            before_capture()
        second = synthetic_step_batch(features, model, device, dtype, seed=1)
        graphs.warm_up(synthetic_step_batch(features, model, device, dtype), second=second)
    return graphs


__all__ = [
    "MODES",
    "PARALLEL_EVOFORMER_UNCAPTURABLE",
    "CudaGraphsUnavailable",
    "GraphedStep",
    "GraphedStepStats",
    "resolve_mode",
    "WHOLE_STEP_CHECKED_STEPS",
    "WHOLE_STEP_TOLERANCE",
    "WholeStepGraphs",
    "WholeStepStats",
    "emulated_capture",
    "perturbed_batch",
    "step_graph_backend",
    "resolve_step_mode",
    "setup_graphed_step",
    "setup_step_graphs",
    "synthetic_step_batch",
    "uncapturable_reason",
]
