"""Components of one training step, kept out of :mod:`scalefold.train.loop` so the loop reads top to bottom.

* :func:`sample_pairs` -- the ``(index, seed)`` stream of a data-parallel rank, indexed by position
  (independent of ``--max-steps``, so a resumed run continues the same stream);
* :func:`recycling_count`, :func:`forward_seed` -- per-step randomness as pure functions;
* :func:`setup_precision`, :func:`compile_blocks` -- numerics and ``torch.compile`` of selected regions;
* :func:`allreduce_step_stats` -- one small all-reduce per step over the training group: the mean
  loss and whether any rank was asked to stop (so every rank takes the same decisions).
"""

from __future__ import annotations

import functools
import os
import random
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scalefold.data.loader import Sampler

SEED_MODULUS = 2**63 - 1
STREAM_BLOCK = 1024  # samples per rank and block of the position-indexed stream


# ---------------------------------------------------------------------------------------------
# Per-step randomness
# ---------------------------------------------------------------------------------------------


def sample_pairs(
    weights: Sequence[float] | np.ndarray, seed: int, start: int, stop: int, rank: int = 0, world_size: int = 1
) -> list[tuple[int, int]]:
    """``(chain index, sample seed)`` for positions ``start .. stop-1`` of data-parallel ``rank``.

    The global stream is cut into blocks of ``STREAM_BLOCK * world_size`` draws, each drawn by a
    :class:`~scalefold.data.loader.Sampler` seeded from (seed, block); rank ``r`` takes every
    ``world_size``-th draw of a block starting at ``r`` (strided). Position ``p`` of a rank is thus a
    function of (seed, rank, world size, p) only: neither ``--max-steps`` nor a resume changes it.
    """
    if not 0 <= start <= stop:
        raise ValueError(f"bad position range [{start}, {stop})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    pairs: list[tuple[int, int]] = []
    for block in range(start // STREAM_BLOCK, -(-stop // STREAM_BLOCK)):
        block_seed = random.Random(f"stream:{seed}:{block}").randrange(SEED_MODULUS)
        drawn = Sampler(weights, num_samples=STREAM_BLOCK * world_size, seed=block_seed, rank=rank, world_size=world_size)
        lo = max(start - block * STREAM_BLOCK, 0)
        hi = min(stop - block * STREAM_BLOCK, STREAM_BLOCK)
        pairs.extend(drawn.pairs[lo:hi])
    return pairs


def recycling_count(seed: int, step: int, num_ensembles: int) -> int:
    """Recycling iterations of 1-based ``step``: uniform on ``{0 .. R-1}``, a pure function of (seed, step),
    hence identical on every rank and after a resume."""
    return random.Random(f"recycling:{seed}:{step}").randrange(num_ensembles)


def forward_seed(seed: int, rank: int, step: int) -> int:
    """Per-step seed of the forward pass (dropout) from (seed, data-parallel rank, step)."""
    return random.Random(f"forward:{seed}:{rank}:{step}").randrange(SEED_MODULUS)


def to_device(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Move a batch; floating features take the run's compute dtype."""
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}


def step_batch(batch: dict[str, torch.Tensor], n: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The first ``n + 1`` recycling slices of a loader batch ``[..., R]``, on ``device``."""
    return to_device({k: v[..., : n + 1] for k, v in batch.items()}, device, dtype)


# ---------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------

MASTER_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}
#: cuBLAS workspace configuration that makes its GEMMs deterministic; PyTorch's deterministic mode
#: raises at the first cuBLAS call (CUDA >= 10.2) without it (``:16:8`` works too, with less memory).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def deterministic_environment(env: MutableMapping[str, str] | None = None) -> None:
    """Environment deterministic CUDA needs, set where unset (an explicit value is kept):
    ``CUBLAS_WORKSPACE_CONFIG`` (:data:`CUBLAS_WORKSPACE_CONFIG`). Call it before the first cuBLAS
    handle is created; :func:`scalefold.train.loop.train` calls it before the distributed runtime
    initialises CUDA, :func:`setup_precision` again (idempotent)."""
    env = os.environ if env is None else env
    if not env.get("CUBLAS_WORKSPACE_CONFIG"):
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG


def setup_precision(precision: str, deterministic: bool) -> tuple[torch.dtype, bool]:
    """(master/compute dtype of the model, whether bf16 autocast is on); sets the TF32 switches.

    ``bf16``: fp32 master weights and bf16 autocast (the structure module and the heads run in fp32,
    :func:`keep_fp32_regions`, and so does the loss, :func:`float_outputs`); ``tf32``: fp32 with TF32 tensor-core matmuls/convolutions (CUDA); ``fp64``: CPU reference.
    """
    if precision not in MASTER_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(MASTER_DTYPES)}")
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        deterministic_environment()  # before use_deterministic_algorithms: cuBLAS needs its workspace config
        torch.use_deterministic_algorithms(True)
    return MASTER_DTYPES[precision], precision == "bf16"


def float_outputs(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss runs in fp32 under bf16 autocast."""
    return {k: v.float() if v.is_floating_point() and v.dtype != torch.float64 else v for k, v in outputs.items()}


#: Regions that stay in fp32 under bf16 autocast (ScaleFold / the MLPerf reference): the structure
#: module (frames, IPA geometry) and the output heads (pLDDT, distogram, masked MSA, ...).
FP32_REGIONS = ("structure_module", "auxiliary_heads")
_REDUCED = (torch.bfloat16, torch.float16)


def _to_fp32(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype in _REDUCED else x
    if isinstance(x, Mapping):
        return {k: _to_fp32(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fp32(v) for v in x)
    return x


def run_in_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Make ``module`` compute in fp32 inside a bf16 autocast region: its forward runs with autocast
    disabled and its reduced-precision floating inputs cast to fp32 (parameters are fp32 master
    weights already). Idempotent; returns ``module``."""
    if getattr(module, "_scalefold_fp32", False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: object, **kwargs: object) -> object:
        device_type = next((p.device.type for p in module.parameters()), "cpu")
        with torch.autocast(device_type, enabled=False):
            return inner(*_to_fp32(args), **_to_fp32(kwargs))

    module.forward = forward
    module._scalefold_fp32 = True
    return module


def keep_fp32_regions(model: torch.nn.Module, regions: Sequence[str] = FP32_REGIONS) -> list[str]:
    """Apply :func:`run_in_fp32` to the named submodules of ``model`` that exist; returns their names."""
    done = []
    for name in regions:
        sub = getattr(model, name, None)
        if isinstance(sub, torch.nn.Module):
            run_in_fp32(sub)
            done.append(name)
    return done


#: Regions ``--compile`` compiles: the blocks of the three stacks (each block's ``forward`` separately,
#: so one compiled graph serves all blocks of a stack with equal shapes), the structure module (its whole
#: forward, fp32 under bf16) and the loss (:data:`LOSS_REGION`, when :func:`compile_blocks` is given the
#: loss module). :func:`compile_blocks` also takes other module regions without blocks
#: (``auxiliary_heads``, the embedders): their whole forward.
LOSS_REGION = "loss"
COMPILE_REGIONS = ("evoformer_stack", "extra_msa_stack", "template_pair_stack", "structure_module", LOSS_REGION)
#: A guard failure that only says the grad mode changed: the second, expected compilation of a region
#: (no-grad recycling passes, then the grad pass). Any other guard failure is a recompilation.
_GRAD_MODE_ONLY = "GLOBAL_STATE changed: grad_mode"


class CompileCheckError(RuntimeError):
    """Strict compilation (``compile_blocks(..., strict=True)``) found graph breaks or recompilations."""


class CompileReport(int):
    """What :func:`compile_blocks` compiled (as an ``int``: the number of compiled forwards) and,
    read at any later time, what ``torch._dynamo`` did with them since: :meth:`stats` (graph breaks
    with their reasons, recompilations with their guard failures, graphs compiled per region),
    :meth:`summary` (one line for the run's summary) and :meth:`check` (raise in strict mode).

    Graph breaks are ``torch._dynamo``'s process-wide counter since the call (ScaleFold compiles
    nothing else); recompilations are counted per compiled code object from dynamo's guard failures:
    each region compiles once per grad mode (no-grad recycling passes, grad pass), and any further
    compilation -- a new shape, another module instance that the graph does not serve, the recompile
    limit reached and eager fallback -- counts.
    """

    regions: dict[str, int]
    strict: bool
    backend: str

    def __new__(cls, regions: dict[str, int], codes: dict[str, object], strict: bool, backend: str) -> CompileReport:
        from torch._dynamo.utils import counters, guard_failures

        self = super().__new__(cls, sum(regions.values()))
        self.regions, self.strict, self.backend = dict(regions), strict, backend
        self._codes = dict(codes)  # region -> code object torch.compile wraps
        self._failures0 = {name: len(guard_failures.get(code, ())) for name, code in codes.items()}
        self._breaks0 = dict(counters["graph_break"])
        self._graphs0 = counters["stats"]["unique_graphs"]
        return self

    def stats(self) -> dict:
        """``graph_breaks``, ``graph_break_reasons``, ``recompiles``, ``recompile_reasons``,
        ``graphs`` (compiled since), ``frames`` (compiled versions per region), ``blocks`` per region."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.utils import counters, guard_failures

        reasons = {k: v - self._breaks0.get(k, 0) for k, v in counters["graph_break"].items()}
        reasons = {k: v for k, v in reasons.items() if v > 0}
        recompiles: dict[str, list[str]] = {}
        frames = {}
        for name, code in self._codes.items():
            new = [str(r) for r in guard_failures.get(code, ())][self._failures0[name]:]
            grad_mode_switches = [r for r in new if r.strip().endswith(_GRAD_MODE_ONLY)]
            unexpected = [r for r in new if r not in grad_mode_switches[:1]]
            if unexpected:
                recompiles[name] = unexpected
            frames[name] = len(_debug_get_cache_entry_list(code))
        return {
            "graph_breaks": sum(reasons.values()), "graph_break_reasons": reasons,
            "recompiles": sum(len(v) for v in recompiles.values()), "recompile_reasons": recompiles,
            "graphs": counters["stats"]["unique_graphs"] - self._graphs0, "frames": frames, "blocks": dict(self.regions),
            "backend": self.backend, "strict": self.strict,
        }  # fmt: skip

    def summary(self) -> str:
        s = self.stats()
        line = (f"torch.compile ({self.backend}{', strict' if self.strict else ''}): {int(self)} forwards in "
                f"{len(self.regions)} regions, {s['graphs']} graphs, {s['graph_breaks']} graph breaks, "
                f"{s['recompiles']} recompiles")  # fmt: skip
        details = [f"break: {r} (x{n})" for r, n in s["graph_break_reasons"].items()]
        details += [f"recompile {name}: {r.strip()[:200]}" for name, rs in s["recompile_reasons"].items() for r in rs]
        return line + "".join(f"\n  {d}" for d in details)

    def check(self) -> None:
        """Strict mode: raise :class:`CompileCheckError` (with the reasons) if anything broke or
        recompiled since :func:`compile_blocks`; otherwise nothing."""
        s = self.stats()
        if self.strict and (s["graph_breaks"] or s["recompiles"]):
            raise CompileCheckError(self.summary())


def _contiguous(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    if isinstance(x, Mapping):  # the loss region's (outputs, batch) dicts
        return {k: _contiguous(v) for k, v in x.items()}
    return x


def _with_contiguous_inputs(fn):
    """``fn`` called with contiguous tensor arguments. Dynamo guards on strides (``dynamic=False``), and
    a region's inputs change strides with the step's recycling count (slices ``[..., it]`` of a batch
    ``[..., n + 1]``: the masks, the template features; the loss's batch ``[..., -1]``) -- one
    recompilation per recycling count without this (found by the strict test on the bf16 step). A
    contiguous input passes as it is."""

    def forward(*args: object, **kwargs: object) -> object:
        return fn(*(_contiguous(a) for a in args), **{k: _contiguous(v) for k, v in kwargs.items()})

    return forward


def _compile_target(module: torch.nn.Module, method: str = "forward") -> tuple[object, object]:
    """(the function to compile in place of ``module.<method>``, the code object dynamo caches it
    under). A :func:`run_in_fp32` region compiles its inner forward (autocast is switched off outside
    the graph), so two fp32 regions do not share the wrapper's code (and its compile cache)."""
    if method != "forward":
        target = getattr(module, method)
        return target, getattr(target, "__func__", target).__code__
    forward = module.forward
    inner = getattr(forward, "__wrapped__", None) if getattr(module, "_scalefold_fp32", False) else None
    target = inner if inner is not None else forward
    return target, getattr(target, "__func__", target).__code__


def compile_blocks(
    model: torch.nn.Module, regions: Sequence[str] = COMPILE_REGIONS, backend: str = "inductor", strict: bool = False,
    loss_fn: torch.nn.Module | None = None,
) -> CompileReport:
    """``torch.compile`` the forward of every block of the ``regions`` stacks (a region without
    ``blocks``: its whole forward); returns a :class:`CompileReport` (an ``int``: how many forwards).

    Region :data:`LOSS_REGION` is ``loss_fn`` (an :class:`~scalefold.losses.AlphaFoldLoss`), when given:
    its ``compute_terms`` (every loss term, the violations and the renamed ground truth) is compiled;
    its ``forward`` (weights, the non-finite-term check with its warning, the length scale) stays eager.
    Without ``loss_fn`` the region is skipped, as is any region ``model`` lacks.

    The eager module stays the reference (the compiled forward computes the same function, equal up to
    rounding; ``tests/train/test_precision_compile.py`` compares them). Default: a block whose
    compilation fails at run time falls back to eager (``torch._dynamo`` ``suppress_errors``), and the
    report counts what happened (print :meth:`CompileReport.summary` at the end of the run).
    ``strict=True``: no fallback -- a graph break raises at compilation (``fullgraph``) with its reason,
    and :meth:`CompileReport.check` (call it after the warm-up) raises on recompilations.
    """
    if not hasattr(torch, "compile"):
        warnings.warn("torch.compile is unavailable: running eager", stacklevel=2)
        return CompileReport({}, {}, strict, backend)
    from torch import _dynamo

    _dynamo.config.suppress_errors = not strict
    if strict:  # a clean baseline: code compiled earlier in this process (another backend) is not a recompile
        _dynamo.reset()
    counts: dict[str, int] = {}
    codes: dict[str, object] = {}
    for name in regions:
        region = loss_fn if name == LOSS_REGION else getattr(model, name, None)
        if region is None:
            continue
        modules = list(getattr(region, "blocks", None) or []) if hasattr(region, "blocks") else [region]
        for module in modules:
            if getattr(module, "_scalefold_compiled", False):
                continue
            method = "compute_terms" if name == LOSS_REGION else "forward"
            target, code = _compile_target(module, method)
            compiled = _with_contiguous_inputs(torch.compile(target, dynamic=False, backend=backend, fullgraph=strict))
            if method != "forward":
                setattr(module, method, compiled)
            elif target is module.forward:
                module.forward = compiled
            else:  # an fp32 region: the compiled inner forward, wrapped in fp32 again
                module.forward = compiled
                module._scalefold_fp32 = False
                run_in_fp32(module)
            module._scalefold_compiled = True
            counts[name] = counts.get(name, 0) + 1
            codes[name] = code
    return CompileReport(counts, codes, strict, backend)


def warm_up(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast: bool = False, loss_fn: Any = None
) -> None:
    """One training forward (a no-grad recycling pass, then the grad pass) and backward on ``batch``,
    gradients discarded: ``torch.compile`` traces and compiles its regions for both grad modes here,
    before ``run_start``, not in the timed run (with ``loss_fn``, the training loss too, as the loop calls
    it). ``batch`` needs >= 2 recycling slices for the no-grad pass. The model's weights and the optimizer
    state are not touched (no step)."""
    was_training = model.training
    model.train()
    device_type = batch["aatype"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        outputs = model(batch)
    if loss_fn is not None:
        loss, _ = loss_fn(float_outputs(outputs) if autocast else outputs, batch)
    else:
        loss = sum(v.float().mean() for v in outputs.values() if v.is_floating_point() and v.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()  # in place: the optimizer's flat gradient views stay attached
    model.train(was_training)


# ---------------------------------------------------------------------------------------------
# Per-step agreement between ranks
# ---------------------------------------------------------------------------------------------


def nonfinite_terms_to_nan(loss: torch.Tensor, terms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The detached ``loss``, or NaN if any reported loss term is non-finite.

    :class:`~scalefold.losses.AlphaFoldLoss` replaces a non-finite term by a constant 0 (as the
    reference does), which can leave a finite loss, even zero gradients, on a step whose model output
    was garbage; the loop treats such a step as non-finite and skips it. No host synchronisation.
    """
    loss = loss.detach()
    if not terms:
        return loss
    finite = torch.stack([v.detach().to(loss.device, torch.float64).reshape(()) for v in terms.values()]).isfinite().all()
    return torch.where(finite, loss, torch.full_like(loss, float("nan")))


def allreduce_step_stats(
    loss: torch.Tensor, stop: bool, group: dist.ProcessGroup | None, world_size: int, count: int = 0
) -> tuple[float, bool, int]:
    """(mean loss over the training ranks, any rank asked to stop, sum of ``count`` over the ranks):
    one all-reduce of three numbers (``count``: e.g. the samples this rank's loader replaced)."""
    stats = torch.tensor([0.0, float(stop), float(count)], dtype=torch.float64, device=loss.device)
    stats[0] = loss.detach().to(torch.float64)
    if world_size > 1:
        dist.all_reduce(stats, group=group)
    mean_loss, stops, total = stats.tolist()
    return mean_loss / world_size, stops > 0, int(round(total))


def broadcast_float(value: float, src: int, group: dist.ProcessGroup | None, device: torch.device, distributed: bool) -> float:
    """``value`` of rank ``src`` on every rank of ``group`` (the evaluation result: all ranks stop together)."""
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=src, group=group)
    return float(t.item())


__all__ = [
    "sample_pairs", "recycling_count", "forward_seed", "to_device", "step_batch", "setup_precision",
    "float_outputs", "run_in_fp32", "keep_fp32_regions", "FP32_REGIONS", "COMPILE_REGIONS", "LOSS_REGION", "compile_blocks",
    "CompileReport", "CompileCheckError", "warm_up", "nonfinite_terms_to_nan", "allreduce_step_stats",
    "broadcast_float", "deterministic_environment", "CUBLAS_WORKSPACE_CONFIG",
]  # fmt: skip
