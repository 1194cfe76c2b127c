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
(``scalefold/`` by default). Works on a plain dict of the snapshot's layout, so it is tested without CUDA.
"""

from __future__ import annotations

import gzip
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PeakReport:
    peak_bytes: int  # live bytes (allocations, not reserved segments) at the peak
    event_index: int  # the trace event at which the peak was reached
    by_site: dict[str, int] = field(default_factory=dict)  # "file:line function" -> bytes live at the peak
    counts: dict[str, int] = field(default_factory=dict)  # site -> live allocations
    untracked_bytes: int = 0  # live before recording started (frees of unknown addresses are ignored)


def record_history(max_entries: int = 200_000) -> None:
    """Start recording allocator events with Python stacks (CUDA only)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def take_snapshot() -> dict[str, Any]:
    """The allocator's snapshot (segments + event traces); stops recording."""
    import torch

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap


def dump_snapshot(snap: dict[str, Any], path: str | Path) -> Path:
    """Write the snapshot as a gzip pickle (``torch.cuda._memory_viz`` reads the unzipped pickle)."""
    path = Path(path)
    with gzip.open(path, "wb") as fh:
        pickle.dump(snap, fh)
    return path


def load_snapshot(path: str | Path) -> dict[str, Any]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as fh:
        return pickle.load(fh)


def _site(frames: list[dict[str, Any]], prefix: str) -> str:
    """The innermost frame whose file path contains ``prefix`` (else the innermost frame at all)."""
    for frame in frames:  # innermost first, as the snapshot stores them
        name = str(frame.get("filename", ""))
        if prefix in name:
            return f"{name[name.index(prefix):]}:{frame.get('line')} {frame.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "(no stack)"


def peak_allocations(snap: dict[str, Any], device: int = 0, prefix: str = "scalefold/") -> PeakReport:
    """Replay ``snap['device_traces'][device]`` and report what is live at the largest live total."""
    traces = snap.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    def replay(upto: int) -> tuple[dict[int, tuple[int, dict]], int, int]:
        """Live allocations after events ``0 .. upto`` (address -> (size, event)), the peak total, its index."""
        live: dict[int, tuple[int, dict]] = {}
        total = peak = peak_index = 0
        for i, ev in enumerate(events[: upto + 1]):
            action, addr = ev.get("action"), ev.get("addr")
            if action == "alloc":
                live[addr] = (int(ev.get("size", 0)), ev)
                total += live[addr][0]
                if total > peak:
                    peak, peak_index = total, i
            elif action == "free_completed" and addr in live:  # frees of blocks from before recording: ignored
                total -= live.pop(addr)[0]
        return live, peak, peak_index

    _, peak, peak_index = replay(len(events) - 1)  # two linear passes: find the peak, then what is live there
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
                      untracked_bytes=untracked)  # fmt: skip


def format_peak(report: PeakReport, top: int = 25) -> str:
    gib = 2**30
    lines = [
        f"live at the traced peak: {report.peak_bytes / gib:.2f} GiB (event {report.event_index}); "
        f"allocated before recording and still live at the end: {report.untracked_bytes / gib:.2f} GiB",
        f"{'GiB':>7} {'n':>5}  allocated at",
    ]
    for site, size in list(report.by_site.items())[:top]:
        lines.append(f"{size / gib:>7.3f} {report.counts[site]:>5}  {site}")
    rest = sum(list(report.by_site.values())[top:])
    if rest:
        lines.append(f"{rest / gib:>7.3f}        ({len(report.by_site) - top} more sites)")
    return "\n".join(lines)


__all__ = ["PeakReport", "dump_snapshot", "format_peak", "load_snapshot", "peak_allocations", "record_history",
           "take_snapshot"]  # fmt: skip
