"""What is live at the peak of a real CUDA run: a summary of a ``torch.cuda.memory._snapshot()``.

The memory model (``scalefold.perf.memory``) predicts the peak from fake tensors; on the first GPU run
(H200, MLPerf shapes, bf16, PyTorch reference kernels) the measured ``max_memory_allocated`` was 11.6 GiB
against 6.0 GiB predicted. This module turns the allocator's own event trace into the same kind of answer
the model gives -- which code allocated what is live at the peak -- so a GPU session can bring the
difference home in one file:

    record_history()                # before the step (CUDA only)
    ... run the step ...
    snap = take_snapshot()          # the allocator's trace; dump_snapshot(path) writes it (gzip pickle)
    print(format_peak(peak_allocations(snap)))

``peak_allocations`` replays the trace's ``alloc`` / ``free_completed`` events (device 0), finds the moment
the live total is largest and groups what is live then by the innermost frame of the caller's code
(``scalefold/`` by default: :func:`site_key`). Works on a plain dict of the snapshot's layout, so it is tested
without CUDA. The trace keeps only its last ``max_entries`` events: record one step, not several (an
MLPerf-shape step is of the order of 10^5-10^6 events); ``unknown_frees`` says when the start was lost.
:mod:`scalefold.perf.memory_sites` puts the memory model's sites (same keys) beside this report.
"""

from __future__ import annotations

import gzip
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NO_STACK = "(no stack)"  # an allocation without Python frames (e.g. on the autograd engine's device thread)


@dataclass
class PeakReport:
    peak_bytes: int  # live bytes (allocations, not reserved segments) at the peak
    event_index: int  # the trace event at which the peak was reached
    by_site: dict[str, int] = field(default_factory=dict)  # "file:line function" -> bytes live at the peak
    counts: dict[str, int] = field(default_factory=dict)  # site -> live allocations
    untracked_bytes: int = 0  # live before recording started (frees of unknown addresses are ignored)
    events: int = 0  # trace events replayed (as many as record_history's max_entries: the start was cut off)
    unknown_frees: int = 0  # frees of blocks the trace never saw allocated (before recording, or cut off)
    allocated_at_start: int = 0  # torch.cuda.memory_allocated() when recording began (set by the recorder)


#: Trace events :func:`peak_allocations` does not read: not recorded where torch can skip them (>= 2.9).
SKIPPED_ACTIONS = ("free_requested", "segment_alloc", "segment_free", "segment_map", "segment_unmap")


def record_history(max_entries: int = 2_000_000) -> None:
    """Start recording allocator events with the allocations' Python stacks (CUDA only). The trace keeps the
    last ``max_entries`` events: one MLPerf-shape step is of the order of 10^5-10^6 of them."""
    import inspect

    import torch

    record = torch.cuda.memory._record_memory_history
    kwargs: dict[str, Any] = {"max_entries": max_entries, "stacks": "python", "context": "alloc"}
    if "skip_actions" in inspect.signature(record).parameters:
        kwargs["skip_actions"] = list(SKIPPED_ACTIONS)
    record(**kwargs)


def take_snapshot() -> dict[str, Any]:
    """The allocator's snapshot (segments + event traces); stops recording."""
    import torch

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap


def dump_snapshot(snap: dict[str, Any], path: str | Path) -> Path:
    """Write the snapshot as a gzip pickle (``torch.cuda._memory_viz`` reads the unzipped pickle)."""
    path = Path(path)
    with gzip.open(path, "wb", compresslevel=1) as fh:  # fast: it is written within the configuration's cap
        pickle.dump(snap, fh)
    return path


def load_snapshot(path: str | Path) -> dict[str, Any]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as fh:
        return pickle.load(fh)


#: The package's top-level entries (subpackages and modules): a frame is the project's when the path after
#: its last ``scalefold/`` names one of them -- so a checkout in a folder called ``scalefold``, or a virtual
#: environment inside it, does not make ``bench/`` or ``site-packages/torch`` frames the project's.
_PACKAGE_ENTRIES = frozenset(
    p.stem if p.suffix == ".py" else p.name
    for p in Path(__file__).resolve().parents[1].iterdir()
    if p.suffix == ".py" or (p.is_dir() and not p.name.startswith(("_", ".")))
)


def project_path(filename: str, prefix: str = "scalefold/") -> str | None:
    """``filename`` from its last ``prefix`` on (``scalefold/model/triangle.py``), or None where it is not the
    project's. For the default prefix the next path part must be one of the package's entries."""
    i = filename.rfind(prefix)
    while i > 0 and filename[i - 1] != "/":
        i = filename.rfind(prefix, 0, i)
    if i < 0:
        return None
    path = filename[i:]
    if prefix == "scalefold/":
        head = path[len(prefix):].split("/", 1)[0]
        if head.removesuffix(".py") not in _PACKAGE_ENTRIES:
            return None
    return path


def site_key(filename: str, line: Any, name: Any, prefix: str = "scalefold/") -> str | None:
    """``"scalefold/<path>:<line> <function>"`` for a project frame, else None (the one format both the
    CUDA trace here and the memory model's sites, :mod:`scalefold.perf.memory_sites`, use)."""
    path = project_path(filename, prefix)
    return None if path is None else f"{path}:{line} {name}"


def _site(frames: list[dict[str, Any]], prefix: str) -> str:
    """The innermost frame whose file is the project's (:func:`project_path`; else the innermost frame)."""
    for frame in frames:  # innermost first, as the snapshot stores them
        site = site_key(str(frame.get("filename", "")), frame.get("line"), frame.get("name"), prefix)
        if site is not None:
            return site
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return NO_STACK


def peak_allocations(snap: dict[str, Any], device: int = 0, prefix: str = "scalefold/") -> PeakReport:
    """Replay ``snap['device_traces'][device]`` and report what is live at the largest live total."""
    traces = snap.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    unknown = [0]

    def replay(upto: int) -> tuple[dict[int, tuple[int, dict]], int, int]:
        """Live allocations after events ``0 .. upto`` (address -> (size, event)), the peak total, its index."""
        live: dict[int, tuple[int, dict]] = {}
        total = peak = peak_index = unknown[0] = 0
        for i, ev in enumerate(events[: upto + 1]):
            action, addr = ev.get("action"), ev.get("addr")
            if action == "alloc":
                live[addr] = (int(ev.get("size", 0)), ev)
                total += live[addr][0]
                if total > peak:
                    peak, peak_index = total, i
            elif action == "free_completed":
                if addr in live:
                    total -= live.pop(addr)[0]
                else:  # a block from before recording (or before the kept part of the trace): ignored
                    unknown[0] += 1
        return live, peak, peak_index

    _, peak, peak_index = replay(len(events) - 1)  # two linear passes: find the peak, then what is live there
    unknown_frees = unknown[0]
    peak_live, _, _ = replay(peak_index) if events else ({}, 0, 0)
    by_site: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for size, ev in peak_live.values():
        site = _site(ev.get("frames") or [], prefix)
        by_site[site] += size
        counts[site] += 1
    # blocks allocated before recording began: in the segments but never in the trace
    traced = {ev.get("addr") for ev in events if ev.get("action") == "alloc"}
    untracked = sum(
        int(b.get("size", 0))
        for seg in snap.get("segments", [])
        if seg.get("device", 0) == device
        for b in seg.get("blocks", [])
        if b.get("state") == "active_allocated" and b.get("address") not in traced
    )
    ordered = dict(sorted(by_site.items(), key=lambda kv: -kv[1]))
    return PeakReport(peak_bytes=peak, event_index=peak_index, by_site=ordered, counts=dict(counts),
                      untracked_bytes=untracked, events=len(events), unknown_frees=unknown_frees)  # fmt: skip


def format_peak(report: PeakReport, top: int = 25) -> str:
    gib = 2**30
    lines = [
        f"live at the traced peak: {report.peak_bytes / gib:.2f} GiB (event {report.event_index}); "
        f"allocated before recording and still live at the end: {report.untracked_bytes / gib:.2f} GiB"
        + (f" (allocated when recording began: {report.allocated_at_start / gib:.2f} GiB)" if report.allocated_at_start else ""),
        f"{'GiB':>7} {'n':>5}  allocated at",
    ]
    if report.unknown_frees:
        lines.insert(1, f"  ({report.unknown_frees} frees of blocks the trace never saw allocated among {report.events} "
                        "events: if that is record_history's max_entries, the trace's start was cut off)")  # fmt: skip
    for site, size in list(report.by_site.items())[:top]:
        lines.append(f"{size / gib:>7.3f} {report.counts[site]:>5}  {site}")
    rest = sum(list(report.by_site.values())[top:])
    if rest:
        lines.append(f"{rest / gib:>7.3f}        ({len(report.by_site) - top} more sites)")
    return "\n".join(lines)


__all__ = ["NO_STACK", "PeakReport", "dump_snapshot", "project_path", "site_key", "format_peak", "load_snapshot", "peak_allocations", "record_history",
           "take_snapshot"]  # fmt: skip
