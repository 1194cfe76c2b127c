"""Where one training step's time goes, from ``torch.profiler``: per phase and top-level module, the top
kernels, the device's busy fraction and the kernel launches per step (``bench/step_headline.py``).

:func:`profile_step` profiles one step of a :class:`~scalefold.train.step.TrainingStep` with a
``record_function`` range per phase (forward, loss, backward, optimizer) and per top-level module's
forward (``module::evoformer_stack``, ...), and writes the Chrome trace; :func:`summarize_trace` reads a
trace (any: a dict as :func:`json.load` gives it) and attributes every GPU kernel to the innermost range
whose host code launched it (by the launch's correlation id); :func:`plot_summary` draws it.

The figures: ``wall_s`` (the step on the host, first range to last), ``kernel_s`` (the union of the
kernels' intervals: overlapping kernels count once), ``busy_fraction`` = ``kernel_s / wall_s`` (low: the
GPU waits -- for the host launching kernels one by one, or for the host's own work), ``kernels`` and
``launches`` (host launch calls; a CUDA-graph replay is one launch of many kernels). Without kernels (a
CPU run) the host operators stand in for them, and the busy fraction is None.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

MODULE_PREFIX = "module::"
PHASE_PREFIX = "phase::"
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaLaunchCooperativeKernel", "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # Triton's (inductor's) kernels launch through the driver API
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length (µs in, s out) of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e6


def summarize_trace(trace: dict[str, Any], top: int = 15, steps: int = 1) -> dict[str, Any]:
    """Summary of a Chrome trace of ``steps`` training steps (see the module's docstring)."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    ranges = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
                     if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith((MODULE_PREFIX, PHASE_PREFIX))),
                    key=lambda r: (r[0], -r[1]))  # fmt: skip
    launches = {e.get("args", {}).get("correlation"): float(e["ts"]) for e in events
                if e.get("cat") in LAUNCH_CATS and e.get("name") in LAUNCH_NAMES}  # fmt: skip
    kernels = [e for e in events if e.get("cat") in KERNEL_CATS]
    on_device = bool(kernels)
    work = kernels if on_device else [e for e in events if e.get("cat") == "cpu_op"]
    by_range: dict[str, dict[str, float]] = defaultdict(lambda: {"s": 0.0, "kernels": 0})
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: {"s": 0.0, "count": 0})
    for e in work:
        dur = float(e.get("dur", 0)) / 1e6
        by_name[e["name"]]["s"] += dur
        by_name[e["name"]]["count"] += 1
        t = launches.get(e.get("args", {}).get("correlation")) if on_device else float(e["ts"])
        for name in _enclosing(ranges, t):
            by_range[name]["s"] += dur
            by_range[name]["kernels"] += 1
    wall_us = (max(r[1] for r in ranges) - min(r[0] for r in ranges)) if ranges else 0.0
    kernel_s = _union_seconds((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels)
    host = {r[2]: 0.0 for r in ranges}
    for a, b, name in ranges:
        host[name] += (b - a) / 1e6
    top_items = sorted(by_name.items(), key=lambda kv: -kv[1]["s"])[:top]
    return {
        "device": "cuda" if on_device else "cpu", "steps": steps, "wall_s": round(wall_us / 1e6 / steps, 6),
        "kernel_s": round(kernel_s / steps, 6) if on_device else None,
        "busy_fraction": round(kernel_s * 1e6 / wall_us, 4) if on_device and wall_us > 0 else None,
        "kernels_per_step": len(kernels) / steps if on_device else None,
        "launches_per_step": sum(1 for e in events if e.get("cat") in LAUNCH_CATS and e.get("name") in LAUNCH_NAMES) / steps,
        "ops_per_step": sum(1 for e in events if e.get("cat") == "cpu_op") / steps,
        "phases": _ranges(by_range, host, PHASE_PREFIX, steps), "modules": _ranges(by_range, host, MODULE_PREFIX, steps),
        "top": [{"name": n[:120], "s": round(v["s"] / steps, 6), "count": int(v["count"] / steps)} for n, v in top_items],
    }  # fmt: skip


def _enclosing(ranges: Sequence[tuple[float, float, str]], t: float | None) -> list[str]:
    """The innermost phase range and the innermost module range around time ``t``."""
    if t is None:
        return []
    found: dict[str, str] = {}
    for a, b, name in ranges:
        if a > t:
            break
        if a <= t <= b:  # sorted by start: a later match is nested deeper
            found[PHASE_PREFIX if name.startswith(PHASE_PREFIX) else MODULE_PREFIX] = name
    return list(found.values())


def _ranges(by_range: dict, host: dict[str, float], prefix: str, steps: int) -> dict[str, dict[str, float]]:
    names = [n for n in host if n.startswith(prefix)]
    return {n[len(prefix):]: {"device_s": round(by_range[n]["s"] / steps, 6), "kernels": int(by_range[n]["kernels"] / steps),
                              "host_s": round(host[n] / steps, 6)} for n in names}  # fmt: skip


@contextlib.contextmanager
def module_ranges(model: Any) -> Iterator[None]:
    """A ``record_function`` range ``module::<name>`` around each top-level submodule's forward."""
    import torch

    handles, open_ranges = [], {}

    def pre(name):
        def hook(module, args):
            open_ranges[name] = torch.profiler.record_function(MODULE_PREFIX + name).__enter__()
        return hook

    def post(name):
        def hook(module, args, output):
            r = open_ranges.pop(name, None)
            if r is not None:
                r.__exit__(None, None, None)
        return hook

    for name, child in model.named_children():
        handles += [child.register_forward_pre_hook(pre(name)), child.register_forward_hook(post(name))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def profile_step(step: Any, n: int, out_dir: str | Path, tag: str, forward: Any = None,
                 keep_trace: bool = False) -> dict[str, Any]:  # fmt: skip
    """Profile one step of ``step`` (a :class:`~scalefold.train.step.TrainingStep`) with ``n`` recycling
    passes; write ``<tag>_profile.json`` (the summary), ``<tag>_profile.png`` and, with ``keep_trace``,
    ``<tag>_trace.json.gz`` (the Chrome trace) to ``out_dir``; return the summary."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if step.device.type == "cuda" else [])
    current: list[Any] = []

    def phase(name: str) -> None:
        while current:
            current.pop().__exit__(None, None, None)
        current.append(record_function(PHASE_PREFIX + name).__enter__())

    with profile(activities=activities) as prof, module_ranges(step.model):
        step.run(n, phase=phase, forward=forward)
        if step.device.type == "cuda":
            torch.cuda.synchronize()
        while current:
            current.pop().__exit__(None, None, None)
    trace_path = out / f"{tag}_trace.json"
    prof.export_chrome_trace(str(trace_path))
    summary = summarize_trace(json.loads(trace_path.read_text()))
    if keep_trace:
        with open(trace_path, "rb") as src, gzip.open(f"{trace_path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    trace_path.unlink()
    summary["recycling_passes"] = n
    (out / f"{tag}_profile.json").write_text(json.dumps(summary, indent=1) + "\n")
    with contextlib.suppress(Exception):  # the figures stand without the picture (no matplotlib)
        plot_summary(summary, out / f"{tag}_profile.png", title=tag)
    return summary


def plot_summary(summary: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Two bar charts: time per phase and top-level module (device and host), and the top kernels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    rows = [(f"phase {k}", v) for k, v in summary["phases"].items()] + list(summary["modules"].items())
    labels = [r[0] for r in rows]
    y = range(len(rows))
    ax1.barh([i + 0.2 for i in y], [r[1]["host_s"] * 1e3 for r in rows], height=0.4, label="host (range)")
    ax1.barh([i - 0.2 for i in y], [r[1]["device_s"] * 1e3 for r in rows], height=0.4, label="kernels launched")
    ax1.set_yticks(list(y), labels, fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel("ms per step")
    ax1.legend(fontsize=7)
    busy = summary.get("busy_fraction")
    ax1.set_title(f"{title}: wall {summary['wall_s'] * 1e3:.0f} ms, busy {busy if busy is not None else '-'}, "
                  f"{summary.get('kernels_per_step') or summary['ops_per_step']:.0f} kernels/ops", fontsize=8)  # fmt: skip
    top = summary["top"]
    ax2.barh(range(len(top)), [t["s"] * 1e3 for t in top])
    ax2.set_yticks(range(len(top)), [t["name"][:60] for t in top], fontsize=6)
    ax2.invert_yaxis()
    ax2.set_xlabel("ms per step")
    ax2.set_title("top kernels" if summary["device"] == "cuda" else "top host operators", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


__all__ = ["module_ranges", "plot_summary", "profile_step", "summarize_trace"]
