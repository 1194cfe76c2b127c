"""``torch.compile`` of selected regions of the model and the loss (``--compile``), with a report.

:func:`compile_blocks` compiles the model's elementwise chains (the default), or the forward of every
block of the chosen stacks (and, given the loss module, its terms); :class:`CompileReport` says afterwards what ``torch._dynamo`` did with them (graph
breaks, recompilations); :func:`warm_up` runs one forward and backward so compilation happens before
``run_start``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from scalefold.kernels import elementwise
from scalefold.model.precision import float_outputs, run_in_fp32

#: Regions ``compile_blocks`` can compile. :data:`ELEMENTWISE_REGION` (the default, ``--compile``): the
#: model's memory-bound elementwise chains, each a small compiled function behind the kernels' dispatch
#: point (:mod:`scalefold.kernels.elementwise`: attention's softmax glue and output gate, the triangle
#: gates, dropout + residual adds) -- the part that pays on a GPU and
#: compiles in seconds. :data:`BLOCK_REGIONS` (asked for by name): the blocks of the three stacks (each
#: block's ``forward`` separately, so one compiled graph serves all blocks of a stack with equal shapes),
#: the structure module (its whole forward, fp32 under bf16) and the loss (:data:`LOSS_REGION`, when
#: :func:`compile_blocks` is given the loss module); on the 2-core box they took 2,096 s to compile cold
#: at demo shapes (issue 26). :func:`compile_blocks` also takes other module regions without blocks
#: (``auxiliary_heads``, the embedders): their whole forward.
LOSS_REGION = "loss"
ELEMENTWISE_REGION = "elementwise"
BLOCK_REGIONS = ("evoformer_stack", "extra_msa_stack", "template_pair_stack", "structure_module", LOSS_REGION)
COMPILE_REGIONS = (ELEMENTWISE_REGION,)
ALL_REGIONS = (ELEMENTWISE_REGION, *BLOCK_REGIONS)
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

    def __new__(cls, regions: dict[str, int], codes: dict[str, object], strict: bool, backend: str,
                chains: dict[str, object] | None = None) -> CompileReport:  # fmt: skip
        from torch._dynamo.utils import counters, guard_failures

        self = super().__new__(cls, sum(regions.values()))
        self.regions, self.strict, self.backend = dict(regions), strict, backend
        self._codes = dict(codes)  # region -> code object torch.compile wraps
        self._chains = dict(chains or {})  # elementwise chain -> code object (one graph per dtype/rank/grad mode)
        self._chain_graphs_warm: dict[str, int] | None = None
        self._failures0 = {name: len(guard_failures.get(code, ())) for name, code in codes.items()}
        self._breaks0 = dict(counters["graph_break"])
        self._graphs0 = counters["stats"]["unique_graphs"]
        return self

    def _chain_graphs(self) -> dict[str, int]:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return {name: len(_debug_get_cache_entry_list(code)) for name, code in self._chains.items()}

    def mark_warm(self) -> None:
        """The warm-up is over (every recycling count, both grad modes, ran once): from now on a new graph
        of an elementwise chain counts as a recompilation (before, each new dtype / rank / broadcast
        pattern / grad mode compiles its graph once, as expected)."""
        self._chain_graphs_warm = self._chain_graphs()

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
        chain_graphs = self._chain_graphs()
        if self._chain_graphs_warm is not None:
            for name, n in chain_graphs.items():
                if n > self._chain_graphs_warm[name]:
                    late = f"{name}: {n - self._chain_graphs_warm[name]} graph(s) compiled after the warm-up"
                    recompiles.setdefault(ELEMENTWISE_REGION, []).append(late)
        return {
            "graph_breaks": sum(reasons.values()), "graph_break_reasons": reasons,
            "recompiles": sum(len(v) for v in recompiles.values()), "recompile_reasons": recompiles,
            "graphs": counters["stats"]["unique_graphs"] - self._graphs0, "frames": frames, "blocks": dict(self.regions),
            "elementwise_graphs": chain_graphs, "backend": self.backend, "strict": self.strict,
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
    contiguous input passes as it is. The call runs with the cyclic garbage collector off
    (:func:`~scalefold.kernels.elementwise.collector_off`: a first call compiles)."""

    @elementwise.collector_off
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


def elementwise_chains(region: str, device_type: str = "cpu") -> tuple[str, ...]:
    """The chains of region ``elementwise`` (the device's default), ``elementwise:all`` or
    ``elementwise:<chain>[+<chain>...]``; ValueError naming an unknown chain."""
    if region == ELEMENTWISE_REGION:
        return elementwise.default_chains(device_type)
    names = region.split(":", 1)[1]
    chains = elementwise.CHAINS if names == "all" else tuple(n for n in names.split("+") if n)
    unknown = [c for c in chains if c not in elementwise.CHAINS]
    if unknown or not chains:
        raise ValueError(f"region {region!r}: unknown elementwise chain(s) {unknown or names!r}; expected "
                         f"'{ELEMENTWISE_REGION}:all' or some of {'+'.join(elementwise.CHAINS)}")  # fmt: skip
    return chains


def _device_type(model: torch.nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def compile_blocks(
    model: torch.nn.Module, regions: Sequence[str] = COMPILE_REGIONS, backend: str = "inductor", strict: bool = False,
    loss_fn: torch.nn.Module | None = None,
) -> CompileReport:
    """``torch.compile`` the forward of every block of the ``regions`` stacks (a region without
    ``blocks``: its whole forward); returns a :class:`CompileReport` (an ``int``: how many forwards, and
    elementwise chains). Region :data:`ELEMENTWISE_REGION` (the default) switches the kernels' elementwise
    chains (the device's default set, :data:`scalefold.kernels.elementwise.DEFAULT_CHAINS`; ``elementwise:all``
    or ``elementwise:<chain>+<chain>``: those) to their compiled functions, process-wide (:func:`scalefold.kernels.elementwise.enable`; the
    model is not touched: ``scalefold.kernels.elementwise.mode(None)`` runs it eager again).

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
    chains: dict[str, object] = {}
    for name in regions:
        if name == ELEMENTWISE_REGION or name.startswith(ELEMENTWISE_REGION + ":"):
            chains = elementwise.enable(backend, elementwise_chains(name, _device_type(model)))
            counts[ELEMENTWISE_REGION] = len(chains)
            continue
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
    return CompileReport(counts, codes, strict, backend, chains)


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


__all__ = [
    "ALL_REGIONS", "BLOCK_REGIONS", "COMPILE_REGIONS", "ELEMENTWISE_REGION", "LOSS_REGION", "CompileCheckError",
    "CompileReport", "compile_blocks", "elementwise_chains", "warm_up",
]  # fmt: skip
