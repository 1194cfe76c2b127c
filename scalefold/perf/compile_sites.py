"""Compile cost per region at a preset's own call sites, without running its step (``bench step --call-sites``).

At MLPerf shapes a training step takes hours on a CPU, so ``scalefold bench step --compile`` cannot say there
what compiling costs. But a compiled region only ever sees its own inputs: the elementwise chains their operand
tensors, a compiled block its block inputs. So:

1. **Record.** The preset's step runs once on fake tensors (:func:`scalefold.perf.memory.estimate_memory`'s
   step: no data, no compute; every no-grad recycling pass, the grad pass with its checkpointing, backward)
   with the chains routed as a compiled run routes them (:func:`scalefold.kernels.elementwise.recording`: the
   operands merged and shaped as the compiled functions receive them) and a pre-hook on the first block of each
   stack. Every distinct call -- each tensor's shape, strides, dtype and ``requires_grad``, the other arguments,
   the grad mode and CPU autocast state -- is a *site*; how often the step makes it is counted.
2. **Replay.** Per region, from a clean dynamo state (the compile cache on disk as configured): the region
   compiled exactly as ``--compile`` compiles it (the chains through :func:`scalefold.kernels.elementwise.enable`,
   a block's ``forward`` as :func:`scalefold.compilation.regions.compile_blocks` compiles it) is called once per
   site on real tensors of the recorded layout (random values: compilation does not depend on them), backward
   where the site had gradients; then every site again, and once eager. ``compile_s`` = first pass less the
   second; ``graphs`` = the graphs dynamo compiled for the region (a chain serves all its sites of one rank,
   dtype and broadcast pattern; a block one per grad mode).

What this does not cover: the structure module and the loss (their inputs carry residue indices and frames
whose values matter; replayed with random values they would not be the step's computation), and the inductor
compile of a real GPU (Triton code, not C++). The step's speed is not measured here: ``bench step`` and, on a
GPU, the headline do that.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from scalefold.config.training import TrainConfig

#: Regions measured by default: every elementwise chain (what a GPU compiles) and, for comparison, a block of
#: each stack (what ``--compile`` compiled before the chains).
DEFAULT_REGIONS = ("elementwise:all", "evoformer_stack", "extra_msa_stack", "template_pair_stack")
STACKS = ("evoformer_stack", "extra_msa_stack", "template_pair_stack")


@dataclass(frozen=True)
class TensorSpec:
    """The layout of one recorded tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, bool(t.requires_grad))

    def make(self, generator: torch.Generator) -> torch.Tensor:
        """A real tensor of this layout (a view of a random base with these strides; a grad-requiring view
        of a grad-requiring base, as the step's operands are)."""
        size = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        if self.dtype.is_floating_point:
            base = torch.randn(size, generator=generator).to(self.dtype)
        elif self.dtype == torch.bool:
            base = torch.ones(size, dtype=torch.bool)
        else:
            base = torch.zeros(size, dtype=self.dtype)
        base.requires_grad_(self.requires_grad)
        return base.as_strided(self.shape, self.stride)

    def __str__(self) -> str:
        dims = "x".join(str(n) for n in self.shape) or "scalar"
        strided = " strided" if self.stride != tuple(torch.empty(self.shape, device="meta").stride()) else ""
        return f"{dims}{strided} {str(self.dtype).removeprefix('torch.')}{' grad' if self.requires_grad else ''}"


@dataclass(frozen=True)
class Site:
    """One distinct call of a region: its arguments' layouts and the modes it ran in."""

    region: str
    args: tuple[Any, ...]  # TensorSpec, or the argument itself (None, a float, a bool)
    kwargs: tuple[tuple[str, Any], ...]
    grad: bool
    autocast: bool

    def needs_backward(self) -> bool:
        return self.grad and any(isinstance(a, TensorSpec) and a.requires_grad for a in (*self.args, *dict(self.kwargs).values()))

    def describe(self) -> str:
        tensors = [str(a) for a in (*self.args, *dict(self.kwargs).values()) if isinstance(a, TensorSpec)]
        mode = ("grad" if self.grad else "no-grad") + (", autocast" if self.autocast else "")
        return f"{self.region}({'; '.join(tensors)}) [{mode}]"


def _spec(x: Any) -> Any:
    return TensorSpec.of(x) if isinstance(x, torch.Tensor) else x


def _site(region: str, args: tuple, kwargs: dict) -> Site:
    return Site(region, tuple(_spec(a) for a in args), tuple((k, _spec(v)) for k, v in sorted(kwargs.items())),
                torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))  # fmt: skip


def _region_names(regions: Sequence[str]) -> tuple[list[str], list[str]]:
    """(chains, stacks) the regions name; ValueError for anything else."""
    from scalefold.compilation.regions import ELEMENTWISE_REGION, elementwise_chains

    chains: list[str] = []
    stacks: list[str] = []
    for r in regions:
        if r == ELEMENTWISE_REGION or r.startswith(ELEMENTWISE_REGION + ":"):
            chains += [c for c in elementwise_chains(r, "cuda") if c not in chains]
        elif r in STACKS:
            stacks.append(r)
        else:
            raise ValueError(f"--call-sites measures the elementwise chains and {', '.join(STACKS)}; not {r!r} "
                             "(the structure module's and the loss's inputs carry values that matter)")  # fmt: skip
    return chains, stacks


def check_regions(regions: Sequence[str] | None) -> None:
    """ValueError (naming it) for a region ``--call-sites`` cannot measure."""
    _region_names(regions or DEFAULT_REGIONS)


def record_sites(cfg: TrainConfig, regions: Sequence[str] = DEFAULT_REGIONS, kernels: str = "torch") -> Counter:
    """Every distinct call the step of ``cfg`` makes of the ``regions`` (fake tensors; chains shaped as
    when compiled), with how many times one step makes it."""
    from scalefold.kernels import elementwise
    from scalefold.perf.memory import estimate_memory

    chains, stacks = _region_names(regions)
    sites: Counter = Counter()

    def on_chain(name: str, args: tuple) -> None:
        if name in chains:
            sites[_site(f"elementwise:{name}", args, {})] += 1

    @contextlib.contextmanager
    def observe(step: Any, tracker: Any) -> Iterator[None]:
        handles = []
        for stack in stacks:
            blocks = getattr(getattr(step.model, stack, None), "blocks", None)
            if blocks:
                hook = (lambda name: lambda mod, args, kwargs: sites.update([_site(name, args, kwargs)]))(stack)
                handles.append(blocks[0].register_forward_pre_hook(hook, with_kwargs=True))
        try:
            with elementwise.recording(on_chain):
                yield
        finally:
            for h in handles:
                h.remove()

    estimate_memory(cfg, target="cpu", kernels=kernels, recycling=None, cuda_graphs=False, observe=observe)
    return sites


def _call(fn: Callable[..., Any], site: Site, generator: torch.Generator) -> float:
    """``fn`` on real tensors of ``site``'s layout, in its modes; backward through a sum where it had gradients.
    Returns the seconds of the call and its backward (making the inputs is not counted)."""
    args = [a.make(generator) if isinstance(a, TensorSpec) else a for a in site.args]
    kwargs = {k: v.make(generator) if isinstance(v, TensorSpec) else v for k, v in site.kwargs}
    t0 = time.perf_counter()
    with torch.set_grad_enabled(site.grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=site.autocast):
        out = fn(*args, **kwargs)
    if site.needs_backward():
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        losses = [o.float().sum() for o in outs if o.requires_grad]
        if losses:
            torch.stack(losses).sum().backward()
    return time.perf_counter() - t0


def _timed_pass(fn: Callable[..., Any], sites: Sequence[Site]) -> float:
    generator = torch.Generator().manual_seed(0)
    return sum(_call(fn, site, generator) for site in sites)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _region_functions(region: str, cfg: TrainConfig, backend: str, model: Any) -> tuple[Callable, Callable]:
    """(compiled, eager) functions of ``region``, compiled as ``--compile`` compiles it."""
    from scalefold.compilation.regions import compile_blocks
    from scalefold.kernels import elementwise, reference

    if region.startswith("elementwise:"):
        name = region.split(":", 1)[1]
        elementwise.enable(backend, (name,))
        return elementwise.chain(name), getattr(reference, name)
    block = getattr(model, region).blocks[0]
    eager = block.forward
    compile_blocks(model, (region,), backend=backend)  # every block of the stack, as --compile <region> does
    return block.forward, eager


def replay_sites(sites: Counter, cfg: TrainConfig, backend: str = "inductor", say: Callable[[str], None] | None = None,
                 model_factory: Callable[[], Any] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per region: its sites compiled (cold in dynamo, the disk cache as configured), again, and eager."""
    from torch import _dynamo

    from scalefold.kernels import elementwise

    say = say or (lambda line: None)
    by_region: dict[str, list[Site]] = {}
    for site in sorted(sites, key=lambda s: (not s.region.startswith("elementwise:"), s.region)):
        by_region.setdefault(site.region, []).append(site)
    model = None
    if any(not r.startswith("elementwise:") for r in by_region):
        model = (model_factory or (lambda: _real_model(cfg)))()
    rows: dict[str, dict[str, Any]] = {}
    for region, group in by_region.items():
        say(f"{region}: {len(group)} site(s), compiling")
        _dynamo.reset()
        graphs0 = _graphs()
        compiled, eager = _region_functions(region, cfg, backend, model)
        try:
            first = _timed_pass(compiled, group)
            second = _timed_pass(compiled, group)
        finally:
            elementwise.disable()
        rows[region] = {
            "compile_s": round(max(first - second, 0.0), 2), "first_pass_s": round(first, 2),
            "compiled_pass_s": round(second, 2), "eager_pass_s": round(_timed_pass(eager, group), 2),
            "graphs": _graphs() - graphs0, "sites": len(group), "calls_per_step": sum(sites[s] for s in group),
            "site_list": [f"{sites[s]}x {s.describe()}" for s in group],
        }  # fmt: skip
        say(f"{region}: compile {rows[region]['compile_s']} s, {rows[region]['graphs']} graph(s)")
    return rows


def _real_model(cfg: TrainConfig) -> torch.nn.Module:
    from scalefold.model.factory import build_model_config
    from scalefold.train.step import training_model

    return training_model(cfg, build_model_config(cfg), "cpu")


def run_call_sites(cfg: TrainConfig, regions: Sequence[str] | None = None, backend: str = "inductor",
                   kernels: str = "torch", say: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """``bench step --call-sites``: record the sites, replay them per region; ``compile_s`` is the regions' sum
    for the chains (what ``--compile`` compiles), the blocks reported apart."""
    say = say or (lambda line: None)
    regions = tuple(regions or DEFAULT_REGIONS)
    t0 = time.perf_counter()
    sites = record_sites(cfg, regions, kernels)
    record_s = time.perf_counter() - t0
    say(f"recorded {len(sites)} distinct call sites on fake tensors in {record_s:.0f} s")
    rows = replay_sites(sites, cfg, backend, say)
    chains = [r for r in rows if r.startswith("elementwise:")]
    return {
        "call_sites": True, "kernels": kernels, "record_s": round(record_s, 1),
        "replay_s": round(time.perf_counter() - t0 - record_s, 1),
        "compile_s": round(sum(rows[r]["compile_s"] for r in chains), 2) if chains else None,
        "graphs": sum(rows[r]["graphs"] for r in chains) if chains else None, "per_region": rows,
    }  # fmt: skip


def format_call_sites(r: dict[str, Any]) -> str:
    lines = [f"  compile per region at the step's call sites ({r['kernels']} kernels; chains {r['compile_s']} s, "
             f"{r['graphs']} graphs):",
             f"  {'region':<30} {'sites':>5} {'calls':>5} {'graphs':>6} {'compile s':>9} {'compiled s':>10} {'eager s':>8}"]  # fmt: skip
    for region, a in r["per_region"].items():
        lines.append(f"  {region:<30} {a['sites']:>5} {a['calls_per_step']:>5} {a['graphs']:>6} {a['compile_s']:>9.1f} "
                     f"{a['compiled_pass_s']:>10.2f} {a['eager_pass_s']:>8.2f}")  # fmt: skip
    return "\n".join(lines)


__all__ = ["DEFAULT_REGIONS", "Site", "TensorSpec", "check_regions", "format_call_sites", "record_sites", "replay_sites", "run_call_sites"]
