"""``scalefold bench step``: the training step timed eager and compiled, in one process, paired.

The same :class:`~scalefold.train.step.TrainingStep` (model seeded as the run seeds it, synthetic batch
of the preset's training shapes, loss, backward, clipping, Adam + SWA) runs eager and, built afresh with
:func:`~scalefold.compilation.regions.compile_blocks` applied (by default the model's elementwise chains;
strict: a graph break or recompilation makes the compiled figure invalid, so it is reported and, with
``--strict``, fatal), compiled. A cycle is one step per recycling count ``0 .. R-1`` (the mix training
draws, uniformly). ``compile_s``: the compiled step's first cycle (compilation for both grad modes happens
there; cold or warm as ``--compile-cache`` is) less the same cycle once compiled; the process's one-time
compiler set-up (imports, the C++ compiler's probe: ``compiler_setup_s``) and its first eager steps are
taken before. Then eager and compiled cycles alternate (the order reversed every repeat, so a drifting
load falls on both): ``eager_s`` / ``compiled_s`` are medians, with each repeat's time and the range, and
``speedup`` is the median of the paired ratios (``speedup_range`` their range). ``--per-region`` adds one
compiled configuration per region alone (the default: each elementwise chain alone), each on a freshly
built model, paired with the eager step again: its ``compile_s`` and step-time ``gain_s``.

Timings of a shared machine vary: the JSON carries the load average before and after, the core count,
and every repeat's time, so a figure can be judged. Nothing here asserts a speed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from scalefold.config.training import TrainConfig


class _Config:
    """One configuration of the paired comparison: a step, and the elementwise mode its cycles run in."""

    def __init__(self, step: Any, elementwise_backend: str | None) -> None:
        self.step, self.elementwise_backend = step, elementwise_backend
        self.cycles: list[float] = []  # s/step of each timed cycle
        self.phases: dict[str, list[float]] = defaultdict(list)

    def cycle(self, timed: bool = True) -> float:
        """One step per recycling count 0..R-1; the mean seconds per step (recorded when ``timed``)."""
        from scalefold.kernels import elementwise

        counts = list(range(self.step.num_ensembles))
        phases: dict[str, float] = defaultdict(float)
        with elementwise.mode(self.elementwise_backend):
            t_cycle = time.perf_counter()
            for n in counts:
                marks: list[tuple[str, float]] = []
                self.step.run(n, phase=lambda name, marks=marks: marks.append((name, time.perf_counter())))
                marks.append(("end", time.perf_counter()))
                for (name, t0), (_, t1) in zip(marks, marks[1:]):
                    phases[name] += t1 - t0
            seconds = (time.perf_counter() - t_cycle) / len(counts)
        if timed:
            self.cycles.append(seconds)
            for name, t in phases.items():
                self.phases[name].append(t / len(counts))
        return seconds

    def summary(self) -> dict[str, Any]:
        c = sorted(self.cycles)
        return {
            "step_s": statistics.median(c), "min_s": round(c[0], 4), "max_s": round(c[-1], 4),
            "spread": round((c[-1] - c[0]) / statistics.median(c), 3), "repeats_s": [round(t, 4) for t in self.cycles],
            "phases_s": {k: round(statistics.median(v), 4) for k, v in self.phases.items()},
        }  # fmt: skip


def paired_times(configs: Sequence[_Config], repeats: int, warmup: int) -> dict[str, Any]:
    """``warmup`` untimed, then ``repeats`` timed cycles of every configuration, alternating (the order
    reversed every repeat, so a drifting machine load falls on both alike); the paired ratios
    ``configs[0] / configs[i]`` of each repeat with their median and range."""
    for _ in range(warmup):
        for c in configs:
            c.cycle(timed=False)
    for r in range(repeats):
        for c in configs if r % 2 == 0 else list(reversed(configs)):
            c.cycle()
    base = configs[0].cycles
    ratios = [[b / t for b, t in zip(base, c.cycles)] for c in configs[1:]]
    return {"ratios": [sorted(x) for x in ratios],
            "ratio_median": [round(statistics.median(x), 3) for x in ratios]}  # fmt: skip


_setup: dict[str, float] = {}  # backend -> seconds of the process's first compilation


def compiler_setup_s(backend: str) -> float:
    """Seconds of the first compilation in this process, once per backend: importing dynamo and inductor,
    probing the C++ compiler and its ISA, loading the precompiled header -- paid by every run whatever the
    cache holds, so it is reported beside ``compile_s`` (``compiler_setup_s``), not in it."""
    if backend not in _setup:
        t0 = time.perf_counter()
        torch.compile(lambda x: x * 2.0 + 1.0, backend=backend, dynamic=True)(torch.ones(4))
        _setup[backend] = time.perf_counter() - t0
    return _setup[backend]


def _compiled_step(cfg: TrainConfig, regions: Sequence[str], backend: str, strict: bool) -> tuple[_Config, Any, float]:
    """A freshly built step (same seed as the eager one) with ``regions`` compiled, and the seconds from its
    first call until it is ready (every recycling count once: both grad modes compiled) -- cold or warm as
    the compile cache is; the execution of that cycle is taken off by :func:`_net_compile_s`."""
    from scalefold.compilation.cache import compile_with_rebuild
    from scalefold.compilation.regions import ELEMENTWISE_REGION, compile_blocks
    from scalefold.kernels import elementwise
    from scalefold.train.step import TrainingStep

    torch._dynamo.reset()
    step = TrainingStep.build(cfg)
    with elementwise.mode(None):
        report = compile_blocks(step.model, regions=regions, backend=backend, strict=strict, loss_fn=step.loss_fn)
    chains = any(r == ELEMENTWISE_REGION or r.startswith(ELEMENTWISE_REGION + ":") for r in regions)
    config = _Config(step, backend if chains else None)
    t0 = time.perf_counter()
    compile_with_rebuild(lambda: config.cycle(timed=False))  # compilation happens here (a corrupt cache: rebuilt)
    compile_s = time.perf_counter() - t0
    report.mark_warm()
    return config, report, compile_s


def _net_compile_s(first_cycle_s: float, config: _Config) -> float:
    """``compile_s``: the first compiled cycle less what the same cycle takes once compiled (its median)."""
    steady = statistics.median(config.cycles) * config.step.num_ensembles if config.cycles else 0.0
    return max(first_cycle_s - steady, 0.0)


def _compiled_result(config: _Config, report: Any, first_cycle_s: float, strict: bool) -> dict[str, Any]:
    stats = report.stats()
    if strict:
        report.check()
    return {**config.summary(), "compile_s": round(_net_compile_s(first_cycle_s, config), 2),
            "first_cycle_s": round(first_cycle_s, 2), **stats}  # fmt: skip


def run_step_benchmark(
    cfg: TrainConfig, compile: bool = True, regions: Sequence[str] | None = None, backend: str = "inductor",
    repeats: int = 5, warmup: int = 2, per_region: bool = False, strict: bool = False,
    log: Any = None, compile_cache: Any = None, compile_only: bool = False, call_sites: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Eager (and compiled) step times of ``cfg``'s training step, measured paired: eager and compiled
    cycles alternate; the result printed as JSON. ``compile_cache``: the
    :class:`~scalefold.compilation.cache.CompileCache` in use (reported)."""
    from scalefold.compilation.regions import COMPILE_REGIONS
    from scalefold.train.step import TrainingStep

    say = log or (lambda line: None)
    load0 = os.getloadavg()
    if call_sites:
        return _finish(_call_sites_result(cfg, regions, backend, compile_cache, say), load0)
    regions = tuple(regions or COMPILE_REGIONS)
    eager = _Config(TrainingStep.build(cfg), None)
    eager.cycle(timed=False)  # the process's first steps (lazy initialisation) are not counted in compile_s
    result: dict[str, Any] = {
        "preset": cfg.model_preset, "precision": cfg.precision, "crop": cfg.crop_size,
        "recycling_counts": list(range(_num_ensembles(cfg))), "repeats": repeats, "warmup": warmup,
        "compile_s": None, "eager_s": None, "compiled_s": None, "speedup": None, "graph_breaks": None,
        "recompiles": None, "regions": list(regions) if compile else None, "backend": backend if compile else None,
        "compile_cache": _cache_info(compile_cache),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
    }  # fmt: skip
    if not compile:
        say(f"eager: {warmup} warm-up + {repeats} timed cycles of recycling counts 0..{eager.step.num_ensembles - 1}")
        paired_times([eager], repeats, warmup)
        result.update(eager_s=round(eager.summary()["step_s"], 4), eager=eager.summary())
        return _finish(result, load0)
    if compile_only:
        return _finish(_compile_only(cfg, result, regions, backend, strict, per_region, say), load0)
    result["compiler_setup_s"] = round(compiler_setup_s(backend), 2)
    say(f"compiled ({backend}): regions {', '.join(regions)}; compiling (first call of every recycling count)")
    compiled, report, compile_s = _compiled_step(cfg, regions, backend, strict)
    say(f"first compiled cycle {compile_s:.1f} s; eager and compiled alternating: {warmup} warm-up + {repeats} timed cycles each")
    paired = paired_times([eager, compiled], repeats, warmup)
    c = _compiled_result(compiled, report, compile_s, strict)
    e = eager.summary()
    result.update(
        compile_s=c["compile_s"], eager_s=round(e["step_s"], 4), compiled_s=round(c["step_s"], 4),
        speedup=paired["ratio_median"][0], speedup_range=[round(paired["ratios"][0][0], 3), round(paired["ratios"][0][-1], 3)],
        graph_breaks=c["graph_breaks"], recompiles=c["recompiles"], eager=e, compiled=c,
    )  # fmt: skip
    del compiled
    if per_region:
        result["per_region"] = {}
        for region in _per_region(regions):
            say(f"compiled ({backend}): {region} alone")
            alone, alone_report, alone_s = _compiled_step(cfg, (region,), backend, strict)
            eager.cycles.clear()
            pr = paired_times([eager, alone], repeats, max(warmup - 1, 0))
            a = _compiled_result(alone, alone_report, alone_s, strict)
            result["per_region"][region] = {
                "compile_s": a["compile_s"], "step_s": round(a["step_s"], 4), "eager_s": round(eager.summary()["step_s"], 4),
                "speedup": pr["ratio_median"][0], "gain_s": round(eager.summary()["step_s"] - a["step_s"], 4),
                "phases_s": a["phases_s"], "graph_breaks": a["graph_breaks"], "recompiles": a["recompiles"],
            }  # fmt: skip
            del alone
    return _finish(result, load0)


def _compile_only(cfg: TrainConfig, result: dict[str, Any], regions: Sequence[str], backend: str, strict: bool,
                  per_region: bool, say: Any) -> dict[str, Any]:  # fmt: skip
    """``compile_s`` (and each region's alone) without the paired timing: each compiled step's first cycle
    less its second; ``eager_cycle_s``: an eager cycle, for comparison."""
    from scalefold.train.step import TrainingStep

    eager = _Config(TrainingStep.build(cfg), None)
    eager.cycle(timed=False)  # the process's first steps (lazy initialisation)
    t0 = time.perf_counter()
    eager.cycle(timed=False)
    result["eager_cycle_s"] = round(time.perf_counter() - t0, 2)  # an eager cycle, all recycling counts
    del eager
    result["compiler_setup_s"] = round(compiler_setup_s(backend), 2)
    todo = [tuple(regions)] + ([(r,) for r in _per_region(regions)] if per_region else [])
    for i, group in enumerate(todo):
        say(f"compiled ({backend}): {', '.join(group)}")
        config, report, first_s = _compiled_step(cfg, group, backend, strict)
        config.cycle()  # once compiled: what the first cycle took besides compiling
        stats = report.stats()
        row = {"compile_s": round(_net_compile_s(first_s, config), 2), "first_cycle_s": round(first_s, 2),
               "graph_breaks": stats["graph_breaks"], "recompiles": stats["recompiles"]}  # fmt: skip
        if i == 0:
            result.update(row)
        else:
            result.setdefault("per_region", {})[group[0]] = {**row, "step_s": None}
        del config
    return result


def _call_sites_result(cfg: TrainConfig, regions: Sequence[str] | None, backend: str, compile_cache: Any,
                       say: Any) -> dict[str, Any]:  # fmt: skip
    """``--call-sites``: compile seconds per region at the step's own call sites, the step not run
    (:mod:`scalefold.perf.compile_sites`)."""
    from scalefold.model.factory import build_model_config
    from scalefold.perf.compile_sites import run_call_sites
    from scalefold.perf.memory import crop_size

    result: dict[str, Any] = {
        "preset": cfg.model_preset, "precision": cfg.precision, "crop": crop_size(build_model_config(cfg)),
        "backend": backend, "compile_cache": _cache_info(compile_cache), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "compiler_setup_s": round(compiler_setup_s(backend), 2),
    }  # fmt: skip
    result.update(run_call_sites(cfg, regions, backend, say=say))
    return result


def _per_region(regions: Sequence[str]) -> list[str]:
    """The regions ``--per-region`` compiles one at a time: the default (the elementwise chains) one chain at a
    time; otherwise each region given (block regions only when named: they take long to compile)."""
    from scalefold.compilation.regions import COMPILE_REGIONS, ELEMENTWISE_REGION
    from scalefold.kernels import elementwise

    if tuple(regions) == COMPILE_REGIONS:
        return [f"{ELEMENTWISE_REGION}:{c}" for c in elementwise.CHAINS]
    return list(regions)


def _cache_info(cache: Any) -> dict[str, Any] | None:
    if cache is None or cache.path is None:
        return None
    return {"path": str(cache.path), "warm": cache.warm, "note": cache.note}


def _finish(result: dict[str, Any], load0: tuple[float, float, float]) -> dict[str, Any]:
    result["loadavg_before"] = [round(x, 2) for x in load0]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _num_ensembles(cfg: TrainConfig) -> int:
    from scalefold.data.pipeline import FeatureConfig
    from scalefold.model.factory import build_model_config

    return FeatureConfig.from_reference_config(build_model_config(cfg).to_dict()).num_ensembles


def format_result(r: dict[str, Any]) -> str:
    if r.get("call_sites"):
        from scalefold.perf.compile_sites import format_call_sites

        return (f"bench step --call-sites: preset {r['preset']}, {r['precision']}, crop {r['crop']}; load "
                f"{r['loadavg_before'][0]} -> {r['loadavg_after'][0]} on {r['cpus']} CPUs; compiler set-up "
                f"{r['compiler_setup_s']} s\n" + format_call_sites(r))  # fmt: skip
    lines = [f"bench step: preset {r['preset']}, {r['precision']}, recycling counts {r['recycling_counts']}, "
             f"median of {r['repeats']} cycles; load {r['loadavg_before'][0]} -> {r['loadavg_after'][0]} "
             f"on {r['cpus']} CPUs"]  # fmt: skip
    if r.get("compile_cache"):
        cache = r["compile_cache"]
        lines.append(f"  compile cache {cache['path']} ({'warm' if cache['warm'] else 'cold'})")
    if r["eager_s"] is not None:
        e = r["eager"]
        lines.append(f"  eager     {r['eager_s']:.3f} s/step (range {e['min_s']}-{e['max_s']})  {e['phases_s']}")
    if r["compile_s"] is not None:
        lines.append(f"  compile   {r['compile_s']:.1f} s (first call until ready, less the cycle's run; compiler "
                     f"set-up {r.get('compiler_setup_s')} s), regions {', '.join(r['regions'])}: "
                     f"{r['graph_breaks']} graph breaks, {r['recompiles']} recompiles")  # fmt: skip
    if r["compiled_s"] is not None:
        c = r["compiled"]
        lines.append(f"  compiled  {r['compiled_s']:.3f} s/step (range {c['min_s']}-{c['max_s']})  {c['phases_s']}  "
                     f"speed-up {r['speedup']:.2f}x (paired, range {r['speedup_range'][0]}-{r['speedup_range'][1]})")  # fmt: skip
    if r.get("flops_mean"):
        rates = ", ".join(f"{k} {r[f'{k}_tflops']:.4g} TFLOP/s" + (f" (MFU {100 * r[f'{k}_mfu']:.2f} %)" if r.get(f"{k}_mfu") else "")
                          for k in ("eager", "compiled") if r.get(f"{k}_tflops"))  # fmt: skip
        lines.append(f"  FLOPs     {r['flops_mean'] / 1e12:.4g} TFLOP per step (mean over the recycling counts): {rates}")
    if "host_syncs_per_step" in r:
        at = f" at {r['host_syncs_layout']}" if r.get("host_syncs_layout") else ""
        lines.append(f"  host syncs inside the step{at}: {r['host_syncs_per_step']:g} per step (reads made on the CPU only, "
                     f"not counted: {r['cpu_only_reads_per_step']:g}){' ' + str(r['host_syncs_where']) if r.get('host_syncs_where') else ''}")  # fmt: skip
    if r.get("graphs"):
        g = r["graphs"]
        lines.append(f"  graphs    {g['error']}" if "error" in g else
                     f"  graphs    {g['captured']} ({g['device']}): {g['graphed_s']:.3f} s/step vs eager {g['eager_s']:.3f} "
                     f"s/step on the GPU, speed-up {g['speedup']:.2f}x")  # fmt: skip
    for region, a in r.get("per_region", {}).items():
        step = f"{a['step_s']:.3f} s/step, speed-up {a['speedup']:.2f}x" if a.get("step_s") is not None else "not timed"
        lines.append(f"  {region:<20} alone: compile {a['compile_s']:.1f} s, {step}")
    return "\n".join(lines)


def step_host_syncs(cfg: TrainConfig, dp: int = 1) -> dict[str, Any]:
    """``host_syncs_per_step``: the host reads inside the training step (``TrainingStep.compute``, its one
    read after the step excluded), counted by :class:`~scalefold.perf.host_syncs.HostSyncCounter` over one
    step per recycling count on the CPU; ``cpu_only_reads_per_step``: reads only a CPU makes (not counted);
    ``host_syncs_where`` where any was counted.

    At ``cfg.dap`` x ``cfg.bp`` x ``dp`` > 1 the step is rank 0's of that layout on a ``fake`` process group
    (collectives are no-ops with real buffers: the numbers are not a real run's, the Python and its host reads
    are): the model wrapped for DAP/BP as the training loop wraps it, the flat gradient all-reduce over the
    training ranks (``--grad-reduce flat``), the cross-rank agreement over ``dp`` x DAP x BP ranks."""
    from scalefold.perf.memory import fake_process_group
    from scalefold.train.step import TrainingStep

    ranks = cfg.dap * cfg.bp * dp
    with fake_process_group(ranks):
        out = _count_host_syncs(_layout_step(cfg) if ranks > 1 else TrainingStep.build(cfg))
    if ranks > 1:
        out["host_syncs_layout"] = f"DAP {cfg.dap} x BP {cfg.bp} x DP {dp} (rank 0, fake process group)"
    return out


def layout_config(cfg: TrainConfig, dap: int, bp: int, dp: int) -> TrainConfig:
    """``cfg`` at DAP ``dap`` x BP ``bp`` (the Parallel Evoformer with BP), the layout of ``dap x bp x dp`` ranks
    validated (``ValueError`` naming the rule)."""
    import dataclasses

    from scalefold.distributed.layout import ParallelLayout
    from scalefold.model.factory import build_model_config
    from scalefold.perf.memory import crop_size

    layout = dataclasses.replace(cfg, dap=dap, bp=bp, parallel_evoformer=cfg.parallel_evoformer or bp > 1)
    ParallelLayout(dap * bp * dp, dap=dap, bp=bp).validate(parallel_evoformer=layout.parallel_evoformer,
                                                           crop_size=crop_size(build_model_config(layout)))  # fmt: skip
    return layout


def _layout_step(cfg: TrainConfig) -> Any:
    """The training step of rank 0 of the initialised (fake) world's layout."""
    import torch.distributed as dist
    from functools import partial

    from scalefold.distributed import setup_model_parallel
    from scalefold.model.factory import build_model_config
    from scalefold.optim.flat_reduce import FlatGradReducer
    from scalefold.perf.memory import crop_size
    from scalefold.train.step import TrainingStep, training_model

    model_cfg = build_model_config(cfg)
    ctx = setup_model_parallel(cfg.dap, cfg.bp, 0, cfg.parallel_evoformer, crop_size=crop_size(model_cfg))
    model = training_model(cfg, model_cfg, "cpu")
    ctx.wrap(model)
    step = TrainingStep.build(cfg, model=model)
    reducer = FlatGradReducer(step.opt, ctx.train_group, ctx.grad_scales(model))
    step.reduce, step.group = partial(reducer.reduce_and_clip, step.clipper), ctx.train_group
    step.world_size = dist.get_world_size(ctx.train_group)
    return step


def _count_host_syncs(step: Any) -> dict[str, Any]:
    from scalefold.perf.host_syncs import HostSyncCounter

    counts = list(range(step.num_ensembles))
    step.run(counts[-1])  # lazy initialisation, SWA's first update
    total, cpu_only, where = 0, 0, {}
    for n in counts:
        with HostSyncCounter() as counter:
            step.run(n, read=False)
        step.finish()  # the one read after the step, outside the count
        total, cpu_only = total + counter.count, cpu_only + len(counter.report.cpu_only)
        for place, k in counter.report.by_place().items():
            where[place] = where.get(place, 0) + k
    out: dict[str, Any] = {"host_syncs_per_step": total / len(counts), "cpu_only_reads_per_step": cpu_only / len(counts)}
    if where:
        out["host_syncs_where"] = where
    return out


def graphed_step_times(cfg: TrainConfig, mode: str, repeats: int, warmup: int) -> dict[str, Any]:
    """Eager vs CUDA-graphed steps (``mode``: recycling, step or auto -- the whole step where it captures, else
    the recycling passes), paired as :func:`paired_times`; ``speedup`` eager / graphed. On a GPU; ``step`` on a
    CPU runs the emulated capture (``captured: step (emulated)``: its replays run the recorded operators, so
    its time says nothing of a GPU's)."""
    from scalefold.compilation.graphed_step import GraphedStep
    from scalefold.train.step import TrainingStep

    device = "cuda" if torch.cuda.is_available() else "cpu"
    eager = _Config(TrainingStep.build(cfg, device), None)
    step = TrainingStep.build(cfg, device)
    out: dict[str, Any] = {"mode": mode, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    whole = step.use_whole_step_graphs() if mode in ("step", "auto") else None
    if whole is not None and whole.active:
        out.update(captured="step (emulated)" if whole.emulated else "step", counts=whole.captured())
    elif mode == "step":
        return {**out, "error": f"whole-step graphs off: {whole.reason}"}
    else:
        graphed = GraphedStep(step.model, enabled=True, log=None)
        graphed.warm_up(step.batch, autocast=step.autocast)
        if not graphed.active:
            return {**out, "error": f"CUDA graphs off: {graphed.reason}"}
        step.forward = graphed
        out.update(captured="recycling", whole_step_reason=None if whole is None else whole.reason)
    config = _Config(step, None)
    paired = paired_times([eager, config], repeats, warmup)
    out.update(eager_s=round(eager.summary()["step_s"], 4), graphed_s=round(config.summary()["step_s"], 4),
               speedup=paired["ratio_median"][0], eager=eager.summary(), graphed=config.summary())  # fmt: skip
    return out


def add_throughput(result: dict[str, Any], cfg: TrainConfig) -> None:
    """``flops_mean`` / ``model_flops_mean`` of the step (:func:`scalefold.perf.flops.run_flops_table`, over
    the uniform recycling draw a cycle takes) and each timed configuration's ``<config>_tflops`` (executed
    FLOPs per second) and, where the device's peak is known, ``<config>_mfu`` (model FLOPs over the peak).
    Not with ``count_flops`` off (``SCALEFOLD_COUNT_FLOPS=0``)."""
    if not cfg.count_flops:
        return
    from scalefold.perf.devices import current_device_spec
    from scalefold.perf.flops import run_flops_table

    try:
        table = run_flops_table(cfg, target="cuda" if torch.cuda.is_available() else "cpu")
    except Exception as exc:  # noqa: BLE001 -- the timings stand without it
        result["flops_error"] = f"{type(exc).__name__}: {exc}"
        return
    executed = statistics.mean(f for f, _ in table.values())
    model = statistics.mean(m for _, m in table.values())
    spec = current_device_spec()
    peak = spec.peak_flops(cfg.precision) if spec is not None else None
    result.update(flops_mean=executed, model_flops_mean=model)
    for key in ("eager", "compiled"):
        seconds = result.get(f"{key}_s")
        if seconds:
            result[f"{key}_tflops"] = round(executed / seconds / 1e12, 6)
            if peak:
                result[f"{key}_mfu"] = round(model / seconds / peak, 5)


__all__ = ["add_throughput", "format_result", "graphed_step_times", "layout_config", "run_step_benchmark",
           "step_host_syncs"]
