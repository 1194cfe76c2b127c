"""CUDA graphs of the whole training step (``--cuda-graphs step``): one graph per recycling count.

:class:`WholeStepGraphs`: the whole training step of each recycling count as **one graph** -- no-grad passes, grad pass, loss, backward, clipping, the cross-rank agreement and the Adam + SWA update applied
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

The capture procedure is in one place, :meth:`WholeStepGraphs.warm_up`: per recycling count, restore the
state, capture (the backend's eager warm-up iterations first), check two consecutive replays against eager
steps (:meth:`WholeStepGraphs._check`), agree across the group, keep or turn off. The recycling passes' graphs
are :mod:`scalefold.compilation.recycling_graphs`'; the mode a run gets is
:func:`scalefold.compilation.graph_modes.resolve_mode`'s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from scalefold.compilation.cuda_graphs import CudaGraphBackend, GraphBackend
from scalefold.compilation.graph_modes import (
    VALIDATION_SEED,
    CudaGraphsUnavailable,
    emulated_capture,
    failure_site,
    resolve_mode,
    rng_states,
    same_state,
    synthetic_step_batch,
)
from scalefold.compilation.replay_watch import ReplayWatch
from scalefold.errors import exception_summary

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
#: the learning rates of the warm-up check's consecutive steps (different, so a baked rate shows)
_VALIDATION_LRS = (1e-3, 4e-4)


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
    :func:`scalefold.compilation.recycling_graphs.uncapturable_reason` does not apply, the whole step registers the branches' generators)."""
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
        #: the timer around each replay (:mod:`scalefold.compilation.replay_watch`): off until
        #: :func:`setup_step_graphs` sets the run's ``--stall-timeout``
        self.watch = ReplayWatch(0.0, rank)
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
        with self.watch.replaying(n):  # a replay cannot raise: a stalled one is named by the watch
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
                self._seed(VALIDATION_SEED)  # the branches' generators step-seeded: no host reseeding inside the step
                register = getattr(self.backend, "register_generators", None)
                if register is not None:
                    register(self._generators())
                for n in counts:
                    static = {k: v[..., : n + 1].clone() for k, v in batch.items()}
                    sources = [static, second] + [perturbed_batch(batch, VALIDATION_SEED + k)
                                                  for k in range(2, WHOLE_STEP_CHECKED_STEPS)]  # fmt: skip
                    batches = tuple({k: v[..., : n + 1].clone() for k, v in src.items()}
                                    for src in sources[:WHOLE_STEP_CHECKED_STEPS])  # fmt: skip
                    try:
                        self._restore(state)
                        replay = self.backend.capture(self._compute, (static,))
                        problem = self._check(static, replay, state, batches)
                    except Exception as exc:  # noqa: BLE001 -- any capture failure: whole-step graphs off
                        problem = f"capture failed: {exception_summary(exc)}{failure_site(exc)}"
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
                self._seed(VALIDATION_SEED + i)
                self.step.set_flags(False, 0)
                out = run().clone()
                self.step.opt.forget_pending()
                opt = self.step.opt
                rows.append((out, [t.detach().clone() for g in opt.groups for t in (g.grad, g.master, g.exp_avg)],
                             rng_states(static["aatype"].device)
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
            if not same_state(a, b):
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



def perturbed_batch(batch: Mapping[str, torch.Tensor], seed: int = VALIDATION_SEED) -> dict[str, torch.Tensor]:
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
    stall_timeout_s: float = 0.0,
    on_fatal: list[Callable[[], None]] | None = None,
) -> WholeStepGraphs:
    """Whole-step graphs for ``--cuda-graphs mode`` over ``step`` (a
    :class:`~scalefold.train.step.TrainingStep`), captured and checked on a synthetic batch of the training
    shapes (before ``run_start``). Off where :func:`resolve_step_mode` says so (``step`` is refused there).
    ``stall_timeout_s`` (``--stall-timeout``): a replay not finished after it ends the rank with one line
    (:class:`~scalefold.compilation.replay_watch.ReplayWatch`; ``on_fatal``: the heartbeat's hooks)."""
    backend, available, graph_device = step_graph_backend(mode, device.type, backend)
    enabled, reason = resolve_step_mode(mode, device.type, model_parallel, world_size, available, graph_device,
                                        bp=bp, flat_reduce=flat_reduce)  # fmt: skip
    log = (lambda line: print(line, flush=True)) if verbose else None
    graphs = WholeStepGraphs(step, backend=backend, enabled=enabled, reason=reason, log=log, rank=rank, group=group)
    cuda = graphs.backend is not None and graphs.backend.device_type == "cuda"
    graphs.watch = ReplayWatch(stall_timeout_s, rank, cuda=cuda, on_fatal=on_fatal)
    if graphs.active:
        if log is not None and graphs.emulated:
            log("cuda graphs: --cuda-graphs step on a CPU runs the emulated capture (each recycling count's step "
                "recorded once and replayed without its Python, refusing what a CUDA capture refuses)")  # fmt: skip
        if before_capture is not None:
            before_capture()
        second = synthetic_step_batch(features, model, device, dtype, seed=1)
        graphs.warm_up(synthetic_step_batch(features, model, device, dtype), second=second)
    return graphs


__all__ = ["WHOLE_STEP_CHECKED_STEPS", "WHOLE_STEP_DDP", "WHOLE_STEP_TOLERANCE", "WholeStepGraphs", "WholeStepStats", "perturbed_batch",
           "resolve_step_mode", "setup_step_graphs", "step_graph_backend"]  # fmt: skip
