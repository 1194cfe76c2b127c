"""``scalefold bench loader`` and ``scalefold bench step``: argument parsing and wiring; the work is in
:mod:`scalefold.perf.loader_bench` and :mod:`scalefold.perf.step_bench`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scalefold.errors import UserError


def _check_bench_loader_args(args: argparse.Namespace) -> None:
    from scalefold.errors import require_range, require_writable_output

    for option in ("steps", "workers", "prefetch", "repeats"):
        require_range(getattr(args, option), f"--{option}", 1)
    for option in ("step_ms", "prep_ms", "slow_factor", "jitter", "payload_kb"):
        require_range(getattr(args, option), f"--{option.replace('_', '-')}", 0)
    require_range(args.slow_fraction, "--slow-fraction", 0, 1)
    require_range(args.warmup, "--warmup", 0)
    if args.plot:
        require_writable_output(args.plot, "--plot", suffixes=(".png",))


def _cmd_bench_loader(args: argparse.Namespace) -> int:
    from scalefold.perf.loader_bench import LoaderBenchConfig, format_table, plot_waits, run_loader_benchmark

    _check_bench_loader_args(args)
    cfg = LoaderBenchConfig(
        steps=args.steps,
        step_seconds=args.step_ms / 1e3,
        base_seconds=args.prep_ms / 1e3,
        slow_fraction=args.slow_fraction,
        slow_factor=args.slow_factor,
        jitter=args.jitter,
        num_workers=args.workers,
        prefetch_factor=args.prefetch,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        payload_bytes=int(args.payload_kb * 1024),
        mp_context=args.mp_context,
    )
    result = run_loader_benchmark(cfg, extra_loaders=getattr(args, "extra_loaders", None))
    runs = result.pop("_runs")
    if args.plot:
        plot_waits(runs, args.plot, cfg.step_seconds)
        result["plot"] = args.plot
    print(format_table(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def add_bench_loader_parser(bench_subparsers) -> argparse.ArgumentParser:
    """``loader`` under an existing ``scalefold bench`` sub-parser group."""
    from scalefold.perf.loader_bench import LoaderBenchConfig

    d = LoaderBenchConfig()
    p = bench_subparsers.add_parser(
        "loader",
        help="loader stall: priority-queue vs in-order loader",
        description="Priority-queue vs in-order loader on the same seeded heavy-tailed workload "
        "(warm-up steps excluded; results pooled over repeats). See scalefold/perf/loader_bench.py.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line with the results last")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the per-step wait")
    p.add_argument("--steps", type=int, default=d.steps, help="measured steps per run")
    p.add_argument(
        "--warmup", type=int, default=d.warmup, help="unmeasured steps first (default: 2 x workers x prefetch)"
    )
    p.add_argument("--repeats", type=int, default=d.repeats, help="runs per loader (workload seeds seed, seed+1, ...)")
    p.add_argument("--step-ms", type=float, default=d.step_seconds * 1e3, help="simulated training step time")
    p.add_argument(
        "--prep-ms", type=float, default=d.base_seconds * 1e3, help="median preparation time of a normal sample"
    )
    p.add_argument("--slow-fraction", type=float, default=d.slow_fraction)
    p.add_argument("--slow-factor", type=float, default=d.slow_factor)
    p.add_argument(
        "--jitter", type=float, default=d.jitter, help="sigma of the log-normal spread of every sample's time"
    )
    p.add_argument("--workers", type=int, default=d.num_workers)
    p.add_argument("--prefetch", type=int, default=d.prefetch_factor, help="queue depth per worker")
    p.add_argument("--payload-kb", type=float, default=0.0, help="size of each dummy batch (sent through the pipes)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--mp-context", choices=("fork", "forkserver", "spawn"), default=None)
    p.set_defaults(handler=_cmd_bench_loader)
    return p


def _cmd_bench_step(args: argparse.Namespace) -> int:
    import torch

    from scalefold.compilation.cache import configure_compile_cache
    from scalefold.perf.step_bench import (
        add_throughput,
        format_result,
        graphed_step_times,
        run_step_benchmark,
        step_host_syncs,
    )

    cfg, regions = _bench_step_config(args)
    layout = _layout_config(cfg, args)  # refused before anything runs
    if args.cuda_graphs not in ("off", "auto", "step") and not torch.cuda.is_available():  # step: emulated on a CPU
        raise UserError(f"--cuda-graphs {args.cuda_graphs} needs a CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    cache = configure_compile_cache(args.compile_cache) if args.compile else None  # before anything compiles
    result = run_step_benchmark(cfg, compile=args.compile, regions=regions, backend=args.backend, repeats=args.repeats,
                                warmup=args.warmup, per_region=args.per_region, strict=args.strict, log=log,
                                compile_cache=cache, compile_only=args.compile_only,
                                call_sites=args.call_sites)  # fmt: skip
    if not args.call_sites:
        if args.cuda_graphs != "off" and (args.cuda_graphs != "auto" or torch.cuda.is_available()):
            result["graphs"] = graphed_step_times(cfg, args.cuda_graphs, args.repeats, args.warmup)
        add_throughput(result, cfg)
        result.update(step_host_syncs(layout, dp=args.dp))
    print(json.dumps(result) if args.json else format_result(result), flush=True)
    return 0


def _layout_config(cfg: Any, args: argparse.Namespace) -> Any:
    """``cfg`` at ``--dap`` / ``--bp`` for the host-sync count, or a :class:`UserError` naming the flags."""
    from scalefold.perf.step_bench import layout_config

    if min(args.dap, args.bp, args.dp) < 1:
        raise UserError("--dap, --bp and --dp must be >= 1")
    try:
        return layout_config(cfg, args.dap, args.bp, args.dp)
    except ValueError as exc:
        raise UserError(f"--dap {args.dap} --bp {args.bp}: {exc}") from exc


def _bench_step_config(args: argparse.Namespace):
    """The run's :class:`~scalefold.config.training.TrainConfig` and regions from the flags, or :class:`UserError`."""
    from scalefold.compilation.regions import ALL_REGIONS, ELEMENTWISE_REGION, elementwise_chains
    from scalefold.config.training import PRESETS, TrainConfig

    if args.preset not in PRESETS:
        raise UserError(f"unknown preset {args.preset!r}; expected one of {sorted(PRESETS)}")
    if args.repeats < 1 or args.warmup < 1:
        raise UserError("--repeats and --warmup must be >= 1")
    overrides = {"precision": args.precision, "crop_size": args.crop}
    try:
        cfg = TrainConfig.from_preset(args.preset, overrides={k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    regions = tuple(r.strip() for r in (args.regions or "").split(",") if r.strip()) or None
    try:
        for r in regions or ():
            if r.startswith(ELEMENTWISE_REGION + ":"):
                elementwise_chains(r)
            elif r not in ALL_REGIONS and r != "auxiliary_heads":
                raise UserError(f"unknown region {r!r}; expected some of {', '.join(ALL_REGIONS)} "
                                f"or {ELEMENTWISE_REGION}:<chain>")  # fmt: skip
        if args.call_sites:
            from scalefold.perf.compile_sites import check_regions

            check_regions(regions)
            args.compile = True
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return cfg, regions


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
    p.add_argument("--regions", help="comma-separated regions to compile (default: elementwise, the model's "
                   "elementwise chains that pay on the device; elementwise:all, elementwise:<chain>+<chain>; also "
                   "evoformer_stack, extra_msa_stack, template_pair_stack, structure_module, loss, auxiliary_heads: "
                   "whole blocks)")  # fmt: skip
    p.add_argument("--per-region", action="store_true", help="also each region compiled alone: its compile seconds "
                   "and step-time gain (default regions: each elementwise chain alone)")
    p.add_argument("--compile-cache", metavar="DIR", help="persistent inductor/Triton cache (a subfolder per "
                   "torch/Triton/device; default ~/.cache/scalefold/compile; off: torch's defaults); a second run "
                   "with the same code, shapes and versions starts warm")  # fmt: skip
    p.add_argument("--compile-only", action="store_true", help="with --compile: measure compile_s only (no eager "
                   "or compiled timing: for shapes whose steps are slow here, e.g. --preset mlperf on a CPU)")
    p.add_argument("--call-sites", action="store_true", help="with --compile: compile each region at the call "
                   "sites the preset's step makes (recorded on fake tensors; default regions: every elementwise chain "
                   "and one block of each stack), without running the step: compile seconds per region at shapes "
                   "whose step is too slow to run here (e.g. --preset mlperf on a CPU)")  # fmt: skip
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--strict", action="store_true", help="fail on any graph break or recompilation")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default: the preset's")
    p.add_argument("--crop", type=int, help="crop size override")
    p.add_argument("--repeats", type=int, default=5, help="timed cycles (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed cycles first (default 2)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default torch's; 1 is steadier on a loaded box)")
    p.add_argument("--cuda-graphs", choices=("off", "recycling", "step", "auto"), default="off",
                   help="also time the step on the GPU with CUDA graphs: of the no-grad recycling passes, of the whole "
                   "step (one graph per recycling count), or the widest that captures (auto), each beside eager on the "
                   "GPU; not on a CPU (default off)")  # fmt: skip
    for flag, what in (("--dap", "DAP size"), ("--bp", "branch parallelism (2: the Parallel Evoformer)"),
                       ("--dp", "data-parallel ranks")):  # fmt: skip
        p.add_argument(flag, type=int, default=1, help=f"{what} of the layout host_syncs_per_step is counted at (rank 0 "
                       "on a fake process group: the layout's Python and reads, no-op collectives); the timings stay "
                       "one rank's (default 1)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_cmd_bench_step)
    return p


def add_bench_parser(subparsers) -> argparse._SubParsersAction:
    """Register ``scalefold bench`` with its ``loader`` and ``step`` subcommands; returns the bench sub-parsers
    so other benchmarks can add theirs."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    add_bench_loader_parser(bench_sub)
    add_bench_step_parser(bench_sub)  # the training step, eager vs compiled
    return bench_sub


__all__ = ["add_bench_loader_parser", "add_bench_parser", "add_bench_step_parser"]
