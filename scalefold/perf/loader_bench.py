"""Loader-stall benchmark (``scalefold bench loader``: the command line is :mod:`scalefold.commands.bench`)
and its simulated workload.

ScaleFold's Fig. 4 situation: sample preparation time is heavy-tailed -- most samples take about
the same time, ~10 % take ten times longer (deep MSAs, long chains, many templates). The training
loop runs a fixed simulated step time and records how long it waits for each batch, for the
priority-queue loader and for the in-order loader with the same workers, queue depth, samples and
per-sample preparation times.

The measurement is made to be meaningful rather than flattering:

* **Same workload for both loaders.** One :class:`SimulatedSample` and one ``(index, seed)``
  sequence per repeat; a sample's preparation time is a pure function of ``(workload seed,
  index)``, so both loaders build exactly the same samples taking exactly the same times.
* **Heavy tail.** Every sample's time is ``base * LogNormal(0, jitter)``; a seeded ~10 % of them
  are ``slow_factor`` times slower. Defaults: normal samples take a median of 2 steps, slow ones
  ~20 steps, 8 workers, 2 samples in flight per worker (PyTorch ``DataLoader``'s default
  ``prefetch_factor``); on average the workers produce ~2x what the loop consumes, so any stall
  comes from the tail, not from a loader that is simply too slow.
* **Cold start excluded.** Worker start-up is outside the loop, and the first ``warmup`` steps
  (default: twice the queue depth, while the queues fill) are run but not measured; their waits
  are reported separately.
* **Out-of-order delivery is counted**: ``pq_out_of_order`` batches were delivered while a
  lower-position sample was still being prepared (they overtook it), ``pq_overtaken`` batches were
  delivered after a higher position; the in-order loader's counts are 0 by construction.
* **Repeats.** ``repeats`` runs with workload seeds ``seed, seed + 1, ...``, the loaders'
  order alternating between repeats (a loaded machine drifts); the headline numbers pool all
  repeats, the per-repeat ratios are listed too.

The last line of output is one JSON object with at least ``wait_ratio`` (priority-queue wait /
in-order wait) and ``wait_fraction`` (priority-queue wait / its total loop time), over the
measured steps of all repeats.

:class:`SimulatedSample` is the picklable ``sample_fn`` of that workload; it also carries the
fault injection (crash once, always fail) that the loader tests use.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scalefold.data.loader import InOrderLoader, PriorityQueueLoader


@dataclass(frozen=True)
class SimulatedSample:
    """``(index, seed) -> batch`` that sleeps for a heavy-tailed preparation time.

    The time of sample ``index`` depends only on ``(workload_seed, index)``: every loader that
    builds that sample waits exactly as long.

    Attributes:
        base_seconds: median preparation time of an ordinary sample.
        slow_fraction: fraction of samples that are slow (chosen by a hash of ``(seed, index)``).
        slow_factor: slow samples take ``slow_factor`` times longer.
        workload_seed: seeds which indices are slow and the jitter.
        payload_bytes: size of the dummy array in each batch.
        slow_indices: indices that are always slow.
        crash_once: indices whose first attempt kills the worker process (``os._exit``).
        fail_always: indices that always raise.
        marker_dir: directory for the crash-once markers (required with ``crash_once``) and the
            release markers of ``hold``.
        jitter: sigma of a log-normal factor (median 1) on every sample's time; 0 = none.
        hold: indices that, after their preparation time, also wait until ``marker_dir/release-<index>``
            exists (at most ``hold_limit_s``): a logical clock for tests that need a sample to
            finish only after something else happened, whatever the machine's load.
        hold_limit_s: the longest a held sample waits for its release marker.
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
    jitter: float = 0.0
    hold: tuple[int, ...] = ()
    hold_limit_s: float = 300.0

    def _rng(self, index: int) -> random.Random:
        return random.Random(f"{self.workload_seed}:{index}")

    def is_slow(self, index: int) -> bool:
        if index in self.slow_indices:
            return True
        return self._rng(index).random() < self.slow_fraction

    def prep_seconds(self, index: int) -> float:
        rng = self._rng(index)
        slow = rng.random() < self.slow_fraction or index in self.slow_indices
        factor = math.exp(rng.gauss(0.0, self.jitter)) if self.jitter > 0 else 1.0
        return self.base_seconds * factor * (self.slow_factor if slow else 1.0)

    def __call__(self, index: int, seed: int) -> dict[str, Any]:
        if index in self.crash_once:
            marker = Path(self.marker_dir or ".") / f"crashed-{index}"
            if not marker.exists():
                marker.touch()
                os._exit(17)
        if index in self.fail_always:
            raise ValueError(f"sample {index} is broken (injected failure)")
        time.sleep(self.prep_seconds(index))
        if index in self.hold:
            release, deadline = Path(self.marker_dir or ".") / f"release-{index}", time.monotonic() + self.hold_limit_s
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        import numpy as np  # here, not at import: ``scalefold --help`` needs only the standard library

        return {"index": index, "seed": seed, "payload": np.zeros(self.payload_bytes, np.uint8)}


@dataclass
class LoaderBenchConfig:
    """Benchmark parameters (defaults: the setting reported in ``bench/RESULTS.md``).

    ``steps`` are measured, after ``warmup`` unmeasured steps (None: twice the queue depth,
    ``2 * num_workers * prefetch_factor``), in each of ``repeats`` runs per loader.
    """

    steps: int = 200
    step_seconds: float = 0.05
    base_seconds: float = 0.1
    slow_fraction: float = 0.1
    slow_factor: float = 10.0
    jitter: float = 0.3
    num_workers: int = 8
    prefetch_factor: int = 2
    warmup: int | None = None
    repeats: int = 3
    seed: int = 0
    payload_bytes: int = 0
    mp_context: str | None = None

    @property
    def warmup_steps(self) -> int:
        return 2 * self.num_workers * self.prefetch_factor if self.warmup is None else self.warmup


@dataclass
class LoaderRun:
    name: str
    waits: list[float] = field(default_factory=list)  # seconds waited before each measured step
    warmup_waits: list[float] = field(default_factory=list)  # the same for the warm-up steps
    positions: list[int] = field(default_factory=list)  # delivered positions, warm-up included
    loop_seconds: float = 0.0  # measured steps only
    out_of_order: int = 0  # measured deliveries that overtook a lower position still being prepared
    overtaken: int = 0  # measured deliveries of a position lower than one delivered before
    max_delay_steps: int = 0  # most steps a batch arrived after its in-order slot

    @property
    def total_wait(self) -> float:
        return float(sum(self.waits))

    @property
    def total_warmup_wait(self) -> float:
        return float(sum(self.warmup_waits))


def delivery_order_stats(positions: list[int], start: int = 0) -> tuple[int, int, int]:
    """``(out_of_order, overtaken, max_delay_steps)`` of the deliveries ``positions[start:]``.

    A delivery is *out of order* when a lower position had not been delivered yet (it jumped the
    queue), *overtaken* when a higher position was delivered before it; ``max_delay_steps`` is the
    largest ``step - position`` (how many steps late a batch arrived relative to sampler order).
    """
    delivered: set[int] = set()
    lowest_missing, highest = 0, -1
    out_of_order = overtaken = max_delay = 0
    for step, position in enumerate(positions):
        if step >= start:
            out_of_order += position != lowest_missing
            overtaken += position < highest
            max_delay = max(max_delay, step - position)
        delivered.add(position)
        highest = max(highest, position)
        while lowest_missing in delivered:
            lowest_missing += 1
    return out_of_order, overtaken, max_delay


def run_loop(loader, steps: int, step_seconds: float, name: str, warmup: int = 0) -> LoaderRun:
    """Simulated training loop: wait for a batch, then "compute" for ``step_seconds``.

    Worker start-up happens before the loop; the first ``warmup`` steps run but are not measured.
    """
    run = LoaderRun(name)
    loader.start(wait_ready=True)  # worker start-up is not part of the loop
    iterator = iter(loader)
    t0 = time.perf_counter()
    try:
        for step in range(warmup + steps):
            if step == warmup:
                t0 = time.perf_counter()
            t = time.perf_counter()
            position, _batch = next(iterator)
            (run.waits if step >= warmup else run.warmup_waits).append(time.perf_counter() - t)
            run.positions.append(int(position))
            time.sleep(step_seconds)
        run.loop_seconds = time.perf_counter() - t0
    finally:
        iterator.close()
        loader.close()
    run.out_of_order, run.overtaken, run.max_delay_steps = delivery_order_stats(run.positions, warmup)
    return run


def workload_stats(workload: SimulatedSample, indices: range, step_seconds: float, num_workers: int) -> dict:
    """Summary of the preparation times of ``indices`` (in steps) and the workers' headroom."""
    import numpy as np

    times = np.array([workload.prep_seconds(i) for i in indices])
    mean = float(times.mean())
    return {
        "prep_mean_steps": mean / step_seconds,
        "prep_p50_steps": float(np.percentile(times, 50)) / step_seconds,
        "prep_p90_steps": float(np.percentile(times, 90)) / step_seconds,
        "prep_p99_steps": float(np.percentile(times, 99)) / step_seconds,
        "prep_max_steps": float(times.max()) / step_seconds,
        "slow_samples": int(sum(workload.is_slow(i) for i in indices)),
        # samples the workers can build per consumed sample, on average (>1: enough throughput)
        "producer_headroom": num_workers * step_seconds / mean,
    }


def run_loader_benchmark(
    cfg: LoaderBenchConfig, extra_loaders: Mapping[str, Callable[..., Any]] | None = None
) -> dict[str, Any]:
    """Priority-queue vs in-order loader on the same workload, ``cfg.repeats`` times.

    ``extra_loaders`` maps a name to a factory ``(sample_fn, pairs, num_workers=, prefetch_factor=,
    mp_context=) -> loader`` run on the same workload too (``bench/loader_stall.py --with-dali``);
    its results appear as ``{name}_wait_s``, ``{name}_loop_s``, ``{name}_wait_fraction``.
    """
    if cfg.steps < 1 or cfg.repeats < 1:
        raise ValueError("steps and repeats must be >= 1")
    factories: dict[str, Callable[..., Any]] = {
        "priority_queue": PriorityQueueLoader,
        "in_order": InOrderLoader,
        **(extra_loaders or {}),
    }
    runs, per_repeat, workloads = run_repeats(cfg, factories)
    result = pooled_result(cfg, runs, per_repeat, workloads)
    result["_runs"] = {name: run_list[0] for name, run_list in runs.items()}  # the first repeat (for the plot)
    return result


def run_repeats(
    cfg: LoaderBenchConfig, factories: Mapping[str, Callable[..., Any]]
) -> tuple[dict[str, list[LoaderRun]], list[dict[str, Any]], list[SimulatedSample]]:
    """Run every loader of ``factories`` (``priority_queue`` and ``in_order`` first) on the workload
    of each repeat (seed ``cfg.seed + r``), alternating the order of those two between repeats.

    Returns the runs per loader, a summary per repeat and the repeats' workloads.
    """
    warmup = cfg.warmup_steps
    total_steps = warmup + cfg.steps
    # More pairs than steps so the queue never drains at the end of the loop.
    pairs = [(i, i) for i in range(total_steps + cfg.num_workers * cfg.prefetch_factor)]
    common = dict(num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor, mp_context=cfg.mp_context)
    runs: dict[str, list[LoaderRun]] = {name: [] for name in factories}
    per_repeat, workloads = [], []
    for r in range(cfg.repeats):
        workload = SimulatedSample(
            cfg.base_seconds, cfg.slow_fraction, cfg.slow_factor, workload_seed=cfg.seed + r,
            payload_bytes=cfg.payload_bytes, jitter=cfg.jitter,
        )  # fmt: skip
        workloads.append(workload)
        order = list(factories) if r % 2 == 0 else [*reversed(list(factories)[:2]), *list(factories)[2:]]
        for name in order:
            loader = factories[name](workload, pairs, **common)
            runs[name].append(run_loop(loader, cfg.steps, cfg.step_seconds, name, warmup=warmup))
        pq_r, io_r = runs["priority_queue"][r], runs["in_order"][r]
        per_repeat.append(
            {
                "workload_seed": workload.workload_seed,
                "slow_samples": int(sum(workload.is_slow(i) for i in range(warmup, total_steps))),
                "pq_wait_s": pq_r.total_wait,
                "in_order_wait_s": io_r.total_wait,
                "wait_ratio": pq_r.total_wait / io_r.total_wait if io_r.total_wait > 0 else 0.0,
                "wait_fraction": pq_r.total_wait / pq_r.loop_seconds,
                "pq_out_of_order": pq_r.out_of_order,
            }
        )
    return runs, per_repeat, workloads


def pooled_result(
    cfg: LoaderBenchConfig,
    runs: Mapping[str, list[LoaderRun]],
    per_repeat: list[dict[str, Any]],
    workloads: list[SimulatedSample],
) -> dict[str, Any]:
    """The benchmark's result dict: every loader's waits and loop times pooled over the repeats,
    the workload statistics, and the per-repeat summaries (see :func:`run_loader_benchmark`)."""
    import numpy as np

    warmup = cfg.warmup_steps
    total_steps = warmup + cfg.steps

    def pooled(name: str, attr: str) -> float:
        return float(sum(getattr(run, attr) for run in runs[name]))

    pq_wait, io_wait = pooled("priority_queue", "total_wait"), pooled("in_order", "total_wait")
    pq_loop, io_loop = pooled("priority_queue", "loop_seconds"), pooled("in_order", "loop_seconds")
    stats = [workload_stats(w, range(warmup, total_steps), cfg.step_seconds, cfg.num_workers) for w in workloads]
    result = {
        "benchmark": "loader_stall",
        "config": {**asdict(cfg), "warmup": warmup},
        "measured_steps": cfg.steps * cfg.repeats,
        "slow_samples": sum(s["slow_samples"] for s in stats),
        "workload": {k: float(np.mean([s[k] for s in stats])) for k in stats[0] if k != "slow_samples"},
        "pq_wait_s": pq_wait,
        "in_order_wait_s": io_wait,
        "pq_loop_s": pq_loop,
        "in_order_loop_s": io_loop,
        "pq_warmup_wait_s": pooled("priority_queue", "total_warmup_wait"),
        "in_order_warmup_wait_s": pooled("in_order", "total_warmup_wait"),
        "pq_out_of_order": int(pooled("priority_queue", "out_of_order")),
        "pq_overtaken": int(pooled("priority_queue", "overtaken")),
        "pq_max_delay_steps": max(run.max_delay_steps for run in runs["priority_queue"]),
        "in_order_out_of_order": int(pooled("in_order", "out_of_order")),
        "pq_stalled_steps": sum(w > 0.1 * cfg.step_seconds for run in runs["priority_queue"] for w in run.waits),
        "in_order_stalled_steps": sum(w > 0.1 * cfg.step_seconds for run in runs["in_order"] for w in run.waits),
        "wait_ratio": pq_wait / io_wait if io_wait > 0 else 0.0,
        "wait_fraction": pq_wait / pq_loop,
        "in_order_wait_fraction": io_wait / io_loop,
        "wait_ratio_max": max(r["wait_ratio"] for r in per_repeat),
        "wait_fraction_max": max(r["wait_fraction"] for r in per_repeat),
        "repeats": per_repeat,
    }
    extra = [name for name in runs if name not in ("priority_queue", "in_order")]
    for name in extra:
        wait, loop = pooled(name, "total_wait"), pooled(name, "loop_seconds")
        result[f"{name}_wait_s"] = wait
        result[f"{name}_loop_s"] = loop
        result[f"{name}_wait_fraction"] = wait / loop
    result["extra_loaders"] = extra
    return result


def plot_waits(runs: dict[str, LoaderRun], path: str, step_seconds: float | None = None) -> None:
    """PNG of the per-step wait of each loader (warm-up steps shaded)."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    warmup = 0
    for name, run in runs.items():
        warmup = len(run.warmup_waits)
        waits = 1e3 * np.asarray(run.warmup_waits + run.waits)
        label = f"{name} (measured {run.total_wait:.2f} s, {run.out_of_order} out of order)"
        ax.plot(np.arange(len(waits)), waits, label=label, lw=1, zorder=3 if name == "priority_queue" else 2)
    if warmup:
        ax.axvspan(-0.5, warmup - 0.5, color="0.9", zorder=0, label=f"warm-up ({warmup} steps, not measured)")
    if step_seconds:
        ax.axhline(1e3 * step_seconds, color="0.5", lw=0.5, ls="--")
    ax.set_xlabel("training step")
    ax.set_ylabel("wait for batch [ms]")
    ax.set_title("Loader stall: heavy-tailed sample preparation (first repeat)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict[str, Any]) -> str:
    cfg, wl = result["config"], result["workload"]
    steps = cfg["step_seconds"] * 1e3
    lines = [
        f"loader stall: {cfg['steps']} steps of {steps:.0f} ms (+{cfg['warmup']} warm-up) x {cfg['repeats']} repeats, "
        f"prep median {cfg['base_seconds'] * 1e3:.0f} ms (jitter {cfg['jitter']:g}, {cfg['slow_fraction']:.0%} "
        f"x{cfg['slow_factor']:g}), {cfg['num_workers']} workers, prefetch {cfg['prefetch_factor']}",
        f"workload (steps): mean {wl['prep_mean_steps']:.1f}, p50 {wl['prep_p50_steps']:.1f}, "
        f"p90 {wl['prep_p90_steps']:.1f}, p99 {wl['prep_p99_steps']:.1f}, max {wl['prep_max_steps']:.1f}; "
        f"{result['slow_samples']} slow of {result['measured_steps']}; producer headroom {wl['producer_headroom']:.2f}x",
        f"{'loader':<16}{'wait [s]':>10}{'loop [s]':>10}{'wait/loop':>11}{'stalled':>9}{'out of order':>14}",
        f"{'priority_queue':<16}{result['pq_wait_s']:>10.3f}{result['pq_loop_s']:>10.2f}"
        f"{result['wait_fraction']:>11.2%}{result['pq_stalled_steps']:>9}{result['pq_out_of_order']:>14}",
        f"{'in_order':<16}{result['in_order_wait_s']:>10.3f}{result['in_order_loop_s']:>10.2f}"
        f"{result['in_order_wait_fraction']:>11.2%}{result['in_order_stalled_steps']:>9}"
        f"{result['in_order_out_of_order']:>14}",
    ]
    for name in result.get("extra_loaders", ()):
        lines.append(
            f"{name:<16}{result[f'{name}_wait_s']:>10.3f}{result[f'{name}_loop_s']:>10.2f}"
            f"{result[f'{name}_wait_fraction']:>11.2%}"
        )
    per_repeat = ", ".join(f"{r['wait_ratio']:.3f}" for r in result["repeats"])
    lines.append(
        f"wait ratio (pq / in-order): {result['wait_ratio']:.3f} (per repeat: {per_repeat}); "
        f"pq wait fraction {result['wait_fraction']:.2%}; warm-up waits (not measured): "
        f"pq {result['pq_warmup_wait_s']:.3f} s, in-order {result['in_order_warmup_wait_s']:.3f} s"
    )
    return "\n".join(lines)


__all__ = [
    "SimulatedSample",
    "LoaderBenchConfig",
    "delivery_order_stats",
    "format_table",
    "run_loader_benchmark",
    "plot_waits",
]
