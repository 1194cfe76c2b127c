"""Loader-stall benchmark (``scalefold bench loader``) and its simulated workload.

ScaleFold's Fig. 4 situation: most samples take about one training step to prepare, ~10 % take
ten times longer (deep MSAs, long chains, many templates). The training loop runs a fixed
simulated step time and records how long it waits for each batch, for the priority-queue loader
and for the in-order loader with the same number of workers and queue depth. The last line of
output is one JSON object with at least ``wait_ratio`` (priority-queue wait / in-order wait) and
``wait_fraction`` (priority-queue wait / its total loop time).

:class:`SimulatedSample` is the picklable ``sample_fn`` of that workload; it also carries the
fault injection (crash once, always fail) that the loader tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scalefold.data.loader import InOrderLoader, PriorityQueueLoader


@dataclass(frozen=True)
class SimulatedSample:
    """``(index, seed) -> batch`` that sleeps for a heavy-tailed preparation time.

    Attributes:
        base_seconds: preparation time of an ordinary sample.
        slow_fraction: fraction of samples that are slow (chosen by a hash of ``(seed, index)``).
        slow_factor: slow samples take ``slow_factor * base_seconds``.
        workload_seed: seeds which indices are slow.
        payload_bytes: size of the dummy array in each batch.
        slow_indices: indices that are always slow.
        crash_once: indices whose first attempt kills the worker process (``os._exit``).
        fail_always: indices that always raise.
        marker_dir: directory for the crash-once markers (required with ``crash_once``).
    """

    base_seconds: float = 0.05
    slow_fraction: float = 0.1
    slow_factor: float = 10.0
    workload_seed: int = 0
    payload_bytes: int = 0
    slow_indices: tuple[int, ...] = ()
    crash_once: tuple[int, ...] = ()
    fail_always: tuple[int, ...] = ()
    marker_dir: str | None = None

    def is_slow(self, index: int) -> bool:
        if index in self.slow_indices:
            return True
        return random.Random(f"{self.workload_seed}:{index}").random() < self.slow_fraction

    def prep_seconds(self, index: int) -> float:
        return self.base_seconds * (self.slow_factor if self.is_slow(index) else 1.0)

    def __call__(self, index: int, seed: int) -> dict[str, Any]:
        if index in self.crash_once:
            marker = Path(self.marker_dir or ".") / f"crashed-{index}"
            if not marker.exists():
                marker.touch()
                os._exit(17)
        if index in self.fail_always:
            raise ValueError(f"sample {index} is broken (injected failure)")
        time.sleep(self.prep_seconds(index))
        return {"index": index, "seed": seed, "payload": np.zeros(self.payload_bytes, np.uint8)}


@dataclass
class LoaderBenchConfig:
    """Benchmark parameters (defaults: the tuned setting reported in the docs)."""

    steps: int = 200
    step_seconds: float = 0.05
    base_seconds: float = 0.05
    slow_fraction: float = 0.1
    slow_factor: float = 10.0
    num_workers: int = 4
    prefetch_factor: int = 4
    seed: int = 0
    mp_context: str | None = None


@dataclass
class LoaderRun:
    name: str
    waits: list[float] = field(default_factory=list)  # seconds waited before each step
    loop_seconds: float = 0.0
    out_of_order: int = 0

    @property
    def total_wait(self) -> float:
        return float(sum(self.waits))


def run_loop(loader, steps: int, step_seconds: float, name: str) -> LoaderRun:
    """Simulated training loop: wait for a batch, then "compute" for ``step_seconds``."""
    run = LoaderRun(name)
    loader.start(wait_ready=True)  # worker start-up is not part of the loop
    iterator = iter(loader)
    last = -1
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        position, _batch = next(iterator)
        run.waits.append(time.perf_counter() - t)
        run.out_of_order += position < last
        last = max(last, position)
        time.sleep(step_seconds)
    run.loop_seconds = time.perf_counter() - t0
    iterator.close()
    loader.close()
    return run


def run_loader_benchmark(
    cfg: LoaderBenchConfig, extra_loaders: Mapping[str, Callable[..., Any]] | None = None
) -> dict[str, Any]:
    """Priority-queue vs in-order loader on the same workload.

    ``extra_loaders`` maps a name to a factory ``(sample_fn, pairs, num_workers=, prefetch_factor=,
    mp_context=) -> loader`` run on the same workload too (``bench/loader_stall.py --with-dali``);
    its results appear as ``{name}_wait_s``, ``{name}_loop_s``, ``{name}_wait_fraction``.
    """
    workload = SimulatedSample(cfg.base_seconds, cfg.slow_fraction, cfg.slow_factor, workload_seed=cfg.seed)
    # More pairs than steps so the queue never drains at the end of the loop.
    pairs = [(i, i) for i in range(cfg.steps + cfg.num_workers * cfg.prefetch_factor)]
    common = dict(num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor, mp_context=cfg.mp_context)
    runs = {
        "priority_queue": run_loop(
            PriorityQueueLoader(workload, pairs, **common), cfg.steps, cfg.step_seconds, "priority_queue"
        ),
        "in_order": run_loop(InOrderLoader(workload, pairs, **common), cfg.steps, cfg.step_seconds, "in_order"),
    }
    for name, factory in (extra_loaders or {}).items():
        runs[name] = run_loop(factory(workload, pairs, **common), cfg.steps, cfg.step_seconds, name)
    pq, io = runs["priority_queue"], runs["in_order"]
    result = {
        "benchmark": "loader_stall",
        "config": asdict(cfg),
        "slow_samples": int(sum(workload.is_slow(i) for i, _ in pairs[: cfg.steps])),
        "pq_wait_s": pq.total_wait,
        "in_order_wait_s": io.total_wait,
        "pq_loop_s": pq.loop_seconds,
        "in_order_loop_s": io.loop_seconds,
        "pq_out_of_order": pq.out_of_order,
        "wait_ratio": pq.total_wait / io.total_wait if io.total_wait > 0 else 0.0,
        "wait_fraction": pq.total_wait / pq.loop_seconds,
        "in_order_wait_fraction": io.total_wait / io.loop_seconds,
    }
    extra = [name for name in runs if name not in ("priority_queue", "in_order")]
    for name in extra:
        run = runs[name]
        result[f"{name}_wait_s"] = run.total_wait
        result[f"{name}_loop_s"] = run.loop_seconds
        result[f"{name}_wait_fraction"] = run.total_wait / run.loop_seconds
    result["extra_loaders"] = extra
    result["_runs"] = runs
    return result


def plot_waits(runs: dict[str, LoaderRun], path: str) -> None:
    """PNG of the per-step wait of both loaders."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for name, run in runs.items():
        ax.plot(
            np.arange(len(run.waits)), 1e3 * np.asarray(run.waits), label=f"{name} (total {run.total_wait:.2f} s)", lw=1
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("wait for batch [ms]")
    ax.set_title("Loader stall: heavy-tailed sample preparation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"loader stall: {cfg['steps']} steps of {cfg['step_seconds'] * 1e3:.0f} ms, prep {cfg['base_seconds'] * 1e3:.0f} ms "
        f"({cfg['slow_fraction']:.0%} x{cfg['slow_factor']:g}), {cfg['num_workers']} workers, prefetch {cfg['prefetch_factor']}",
        f"{'loader':<16}{'wait [s]':>10}{'loop [s]':>10}{'wait/loop':>11}",
        f"{'priority_queue':<16}{result['pq_wait_s']:>10.3f}{result['pq_loop_s']:>10.2f}{result['wait_fraction']:>11.2%}",
        f"{'in_order':<16}{result['in_order_wait_s']:>10.3f}{result['in_order_loop_s']:>10.2f}{result['in_order_wait_fraction']:>11.2%}",
        f"wait ratio (pq / in-order): {result['wait_ratio']:.3f}",
    ]
    for i, name in enumerate(result.get("extra_loaders", ())):
        lines.insert(
            4 + i,
            f"{name:<16}{result[f'{name}_wait_s']:>10.3f}{result[f'{name}_loop_s']:>10.2f}"
            f"{result[f'{name}_wait_fraction']:>11.2%}",
        )
    return "\n".join(lines)


def _cmd_bench_loader(args: argparse.Namespace) -> int:
    cfg = LoaderBenchConfig(
        steps=args.steps,
        step_seconds=args.step_ms / 1e3,
        base_seconds=args.prep_ms / 1e3,
        slow_fraction=args.slow_fraction,
        slow_factor=args.slow_factor,
        num_workers=args.workers,
        prefetch_factor=args.prefetch,
        seed=args.seed,
        mp_context=args.mp_context,
    )
    result = run_loader_benchmark(cfg, extra_loaders=getattr(args, "extra_loaders", None))
    runs = result.pop("_runs")
    if args.plot:
        plot_waits(runs, args.plot)
        result["plot"] = args.plot
    print(format_table(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def add_bench_loader_parser(bench_subparsers) -> argparse.ArgumentParser:
    """``loader`` under an existing ``scalefold bench`` sub-parser group."""
    d = LoaderBenchConfig()
    p = bench_subparsers.add_parser("loader", help="loader stall: priority-queue vs in-order loader")
    p.add_argument("--json", action="store_true", help="print one JSON line with the results last")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the per-step wait")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--step-ms", type=float, default=d.step_seconds * 1e3, help="simulated training step time")
    p.add_argument("--prep-ms", type=float, default=d.base_seconds * 1e3, help="preparation time of a normal sample")
    p.add_argument("--slow-fraction", type=float, default=d.slow_fraction)
    p.add_argument("--slow-factor", type=float, default=d.slow_factor)
    p.add_argument("--workers", type=int, default=d.num_workers)
    p.add_argument("--prefetch", type=int, default=d.prefetch_factor, help="queue depth per worker")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--mp-context", choices=("fork", "forkserver", "spawn"), default=None)
    p.set_defaults(handler=_cmd_bench_loader)
    return p


def add_bench_parser(subparsers) -> argparse._SubParsersAction:
    """Register ``scalefold bench`` with its ``loader`` subcommand; returns the bench sub-parsers
    so other benchmarks can add theirs."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    add_bench_loader_parser(bench_sub)
    return bench_sub


__all__ = [
    "SimulatedSample",
    "LoaderBenchConfig",
    "run_loader_benchmark",
    "plot_waits",
    "add_bench_parser",
    "add_bench_loader_parser",
]
