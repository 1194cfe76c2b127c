"""``scalefold bench step``: the training step timed eager and compiled, in one process.

The same :class:`~scalefold.train.step.TrainingStep` (model seeded as the run seeds it, synthetic batch
of the preset's training shapes, loss, backward, clipping, Adam + SWA) is timed eager, then with
:func:`~scalefold.train.step.compile_blocks` applied to the model and the loss (strict: a graph break or
recompilation makes the compiled figure invalid, so it is reported and, with ``--strict``, fatal). The
recycling count cycles through ``0 .. R-1`` so every configuration sees the step mix training draws
(uniform); warm-up steps (one per recycling count at least: compilation for both grad modes happens
there) are not timed; the figures are medians over ``repeats`` cycles. ``--per-region`` adds one compiled configuration per
region alone, each on a freshly built model, to show which regions gain.

Timings of a shared machine vary: the JSON carries the load average before and after, the core count,
and every repeat's time, so a figure can be judged. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from scalefold.config.training import TrainConfig


def _cycle_times(step: Any, repeats: int, warmup: int) -> dict[str, Any]:
    """Median seconds per step and per phase over ``repeats`` cycles of recycling counts 0..R-1."""
    counts = list(range(step.num_ensembles))
    for _ in range(warmup):
        for n in counts:
            step.run(n)
    per_step: list[float] = []
    phases: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        cycle: dict[str, float] = defaultdict(float)
        t_cycle = time.perf_counter()
        for n in counts:
            marks: list[tuple[str, float]] = []
            step.run(n, phase=lambda name, marks=marks: marks.append((name, time.perf_counter())))
            marks.append(("end", time.perf_counter()))
            for (name, t0), (_, t1) in zip(marks, marks[1:]):
                cycle[name] += t1 - t0
        per_step.append((time.perf_counter() - t_cycle) / len(counts))
        for name, seconds in cycle.items():
            phases[name].append(seconds / len(counts))
    return {
        "step_s": statistics.median(per_step), "repeats_s": [round(t, 4) for t in per_step],
        "phases_s": {k: round(statistics.median(v), 4) for k, v in phases.items()},
    }  # fmt: skip


def _compiled_times(cfg: TrainConfig, regions: Sequence[str], backend: str, strict: bool, repeats: int,
                    warmup: int) -> dict[str, Any]:  # fmt: skip
    from scalefold.compilation.regions import compile_blocks
    from scalefold.train.step import TrainingStep

    torch._dynamo.reset()
    step = TrainingStep.build(cfg)
    report = compile_blocks(step.model, regions=regions, backend=backend, strict=strict, loss_fn=step.loss_fn)
    t0 = time.perf_counter()
    for n in range(step.num_ensembles):  # compilation happens here (both grad modes)
        step.run(n)
    compile_s = time.perf_counter() - t0
    timed = _cycle_times(step, repeats, max(warmup - 1, 0))
    stats = report.stats()
    if strict:
        report.check()
    return {**timed, "compile_s": round(compile_s, 2), "regions": list(regions), **stats}


def run_step_benchmark(
    cfg: TrainConfig, compile: bool = True, regions: Sequence[str] | None = None, backend: str = "inductor",
    repeats: int = 5, warmup: int = 2, per_region: bool = False, strict: bool = False,
    log: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Eager (and compiled) step times of ``cfg``'s training step; the result printed as JSON."""
    from scalefold.compilation.regions import COMPILE_REGIONS
    from scalefold.train.step import TrainingStep

    say = log or (lambda line: None)
    regions = tuple(regions or COMPILE_REGIONS)
    load0 = os.getloadavg()
    step = TrainingStep.build(cfg)
    say(f"eager: {warmup} warm-up + {repeats} timed cycles of recycling counts 0..{step.num_ensembles - 1}")
    eager = _cycle_times(step, repeats, warmup)
    del step
    result: dict[str, Any] = {
        "preset": cfg.model_preset, "precision": cfg.precision, "crop": cfg.crop_size,
        "recycling_counts": list(range(_num_ensembles(cfg))), "repeats": repeats, "warmup": warmup,
        "eager_s": round(eager["step_s"], 4), "eager": eager, "compiled_s": None, "speedup": None,
        "graph_breaks": None, "recompiles": None, "backend": backend if compile else None,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
    }  # fmt: skip
    if compile:
        say(f"compiled ({backend}): regions {', '.join(regions)}")
        compiled = _compiled_times(cfg, regions, backend, strict, repeats, warmup)
        result.update(
            compiled_s=round(compiled["step_s"], 4), speedup=round(eager["step_s"] / compiled["step_s"], 3),
            graph_breaks=compiled["graph_breaks"], recompiles=compiled["recompiles"], compiled=compiled,
        )  # fmt: skip
        if per_region:
            result["per_region"] = {}
            for region in regions:
                say(f"compiled ({backend}): {region} alone")
                alone = _compiled_times(cfg, (region,), backend, strict, repeats, warmup)
                result["per_region"][region] = {
                    "step_s": round(alone["step_s"], 4), "speedup": round(eager["step_s"] / alone["step_s"], 3),
                    "phases_s": alone["phases_s"], "graph_breaks": alone["graph_breaks"],
                    "recompiles": alone["recompiles"], "compile_s": alone["compile_s"],
                }  # fmt: skip
    result["loadavg_before"] = [round(x, 2) for x in load0]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _num_ensembles(cfg: TrainConfig) -> int:
    from scalefold.data.pipeline import FeatureConfig
    from scalefold.model.factory import build_model_config

    return FeatureConfig.from_reference_config(build_model_config(cfg).to_dict()).num_ensembles


def format_result(r: dict[str, Any]) -> str:
    lines = [f"bench step: preset {r['preset']}, {r['precision']}, recycling counts {r['recycling_counts']}, "
             f"median of {r['repeats']} cycles; load {r['loadavg_before'][0]} -> {r['loadavg_after'][0]} "
             f"on {r['cpus']} CPUs"]  # fmt: skip
    lines.append(f"  eager     {r['eager_s']:.3f} s/step  {r['eager']['phases_s']}")
    if r["compiled_s"] is not None:
        c = r["compiled"]
        lines.append(f"  compiled  {r['compiled_s']:.3f} s/step  {c['phases_s']}  speed-up {r['speedup']:.2f}x "
                     f"({r['graph_breaks']} graph breaks, {r['recompiles']} recompiles, compile {c['compile_s']} s)")  # fmt: skip
        for region, a in r.get("per_region", {}).items():
            lines.append(f"  {region:<28} alone: {a['step_s']:.3f} s/step, speed-up {a['speedup']:.2f}x")
    return "\n".join(lines)


def cmd_bench_step(args: argparse.Namespace) -> int:
    from scalefold.config.training import PRESETS

    if args.preset not in PRESETS:
        print(f"scalefold bench step: unknown preset {args.preset!r}; expected one of {sorted(PRESETS)}", file=sys.stderr)
        return 3
    if args.repeats < 1 or args.warmup < 1:
        print("scalefold bench step: --repeats and --warmup must be >= 1", file=sys.stderr)
        return 3
    overrides = {"precision": args.precision, "crop_size": args.crop}
    try:
        cfg = TrainConfig.from_preset(args.preset, overrides={k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        print(f"scalefold bench step: {exc}", file=sys.stderr)
        return 3
    if args.threads:
        torch.set_num_threads(args.threads)
    regions = tuple(r for r in (args.regions or "").split(",") if r) or None
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = run_step_benchmark(cfg, compile=args.compile, regions=regions, backend=args.backend, repeats=args.repeats,
                                warmup=args.warmup, per_region=args.per_region, strict=args.strict, log=log)  # fmt: skip
    print(json.dumps(result) if args.json else format_result(result), flush=True)
    return 0


def add_bench_step_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """``step`` under the ``scalefold bench`` sub-parser group."""
    p = bench_subparsers.add_parser(
        "step", help="training step time, eager vs torch.compile (graph breaks and recompiles counted)",
        description="Time one training step (synthetic batch of the preset's shapes; recycling counts 0..R-1 in turn) "
        "eager and, with --compile, compiled, in one process; medians over --repeats after --warmup cycles. "
        "See scalefold/perf/step_bench.py.",
    )  # fmt: skip
    p.add_argument("--preset", default="demo", help="training preset (demo, tiny, mlperf; default demo)")
    p.add_argument("--compile", action="store_true", help="also time the step with compile_blocks applied")
    p.add_argument("--regions", help="comma-separated regions to compile (default: those --compile compiles, "
                   "COMPILE_REGIONS: the three stacks, structure_module, loss; also e.g. auxiliary_heads)")  # fmt: skip
    p.add_argument("--per-region", action="store_true", help="also time each region compiled alone")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--strict", action="store_true", help="fail on any graph break or recompilation")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default: the preset's")
    p.add_argument("--crop", type=int, help="crop size override")
    p.add_argument("--repeats", type=int, default=5, help="timed cycles (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed cycles first (default 2)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default torch's; 1 is steadier on a loaded box)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_bench_step)
    return p


__all__ = ["run_step_benchmark", "add_bench_step_parser", "cmd_bench_step", "format_result"]
