"""Where the memory model's peak was allocated, by source line, and the same for a real CUDA run side by side.

The memory model (:func:`scalefold.perf.memory.estimate_memory` with ``sites=True``) records for every
storage its fake step creates the *allocating site*: the innermost Python frame of the project's code, as
``scalefold/<path>:<line> <function>`` -- the key :func:`scalefold.perf.cuda_snapshot.peak_allocations`
gives each allocation of a real CUDA allocator trace (:func:`~scalefold.perf.cuda_snapshot.site_key`
for both). :func:`compare` puts the two side by side: per site the bytes live at the predicted peak and at
the measured one, largest difference first, so the lines the model gets wrong stand out.

Making the model's stacks look like the CUDA trace's:

* frames of ``scalefold/perf/`` (the tracker, the autocast probe, the FLOP counter) are skipped: the site
  is the model's line that issued the operator, as on CUDA;
* **backward**: on CUDA the autograd engine runs the backward's operators on its own device thread, whose
  Python stack holds only what the engine calls back into (custom ``autograd.Function`` backwards,
  activation checkpointing's recomputation of the model's forward) -- the C++ operators' allocations carry no
  Python frame at all (``(no stack)``). The fake step runs on CPU, where the engine works on the calling
  thread under ``loss.backward()``; the walk stops at the engine's entry (``_engine_run_backward``), so both
  sides name the same site;
* storages that exist before the step (parameters, buffers, gradients, optimizer state, the batch) have
  no operator: their site is their category, ``(parameters)`` etc. A trace of one step after the warm-up
  (``bench/step_headline.py --memory-snapshot``) never sees them allocated: they are in its
  ``untracked_bytes`` (with the warm-up's cuBLAS workspaces), and the comparison prints both totals;
* the function name is the code object's (``co_name``, as torch's traces have it): Python 3.12 inlines
  comprehensions, so compare a trace with sites computed under the same Python minor version (the headline
  computes both on the same machine).

The sites' bytes at the model's peak add up to the eager step's peak (``step_peak_bytes``: without the
CUDA-graph pool, which has no site).
"""

from __future__ import annotations

import sys
from array import array
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from scalefold.perf.cuda_snapshot import NO_STACK, PeakReport, project_path

GiB = 2**30
_SKIP, _PROJECT, _OTHER, _ENGINE = range(4)
#: Where a backward enters the C++ autograd engine (torch >= 2.3; ``backward``, ``grad`` and checkpointing
#: call it): on CUDA the frames outside it are on another thread than the engine's operators.
_ENGINE_ENTRIES = {"torch/autograd/graph.py": {"_engine_run_backward"}}
#: torch's wrappers between the engine's entry and the C++ engine (``torch._disable_dynamo``): never a site.
_WRAPPERS = ("torch/_compile.py", "torch/_dynamo/eval_frame.py")
OTHER_SITES = "(other sites)"
#: The sites of the storages that exist before the step (:meth:`StorageTracker.register`'s categories).
BEFORE_STEP = ("(parameters)", "(buffers)", "(gradients)", "(optimizer_state)", "(batch)")


class FrameSites:
    """The allocating site of the Python stack at hand (:meth:`here`); file classifications cached."""

    def __init__(self, prefix: str = "scalefold/") -> None:
        self.prefix = prefix
        self._files: dict[str, tuple[int, str | None]] = {}
        self._interned: dict[str, str] = {}

    def _classify(self, filename: str) -> tuple[int, str | None]:
        path = project_path(filename, self.prefix)
        if path is not None:
            kind = _SKIP if path.startswith(self.prefix + "perf/") else _PROJECT
        else:
            kind = _ENGINE if any(filename.endswith(e) for e in _ENGINE_ENTRIES) else _OTHER
            kind = _SKIP if filename.endswith(_WRAPPERS) else kind
        self._files[filename] = (kind, path)
        return kind, path

    def here(self, depth: int = 1) -> str:
        """The innermost project frame above ``depth`` frames of the caller (the backward's engine entry
        ends the walk); else the innermost frame outside ``scalefold/perf/``; else ``(no stack)``."""
        frame: Any = sys._getframe(depth + 1)
        first = None
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename
            kind, path = self._files.get(filename) or self._classify(filename)
            if kind == _PROJECT:
                return self._intern(f"{path}:{frame.f_lineno} {code.co_name}")
            if kind == _ENGINE and any(filename.endswith(e) and code.co_name in names for e, names in _ENGINE_ENTRIES.items()):
                break
            if kind != _SKIP and first is None:
                first = frame
            frame = frame.f_back
        if first is None:
            return NO_STACK
        return self._intern(f"{first.f_code.co_filename}:{first.f_lineno} {first.f_code.co_name}")

    def _intern(self, site: str) -> str:
        return self._interned.setdefault(site, site)


class SiteLog:
    """Every tracked storage's site, size and life (allocation and free sequence numbers), in flat
    arrays: O(1) per event, and what was live at any marked moment is found afterwards (:meth:`at_peak`)."""

    NEVER = 2**62

    def __init__(self) -> None:
        self.frames = FrameSites()
        self.seq = 0
        self.peak_seq = -1
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._site = array("i")
        self._bytes = array("q")
        self._born = array("q")
        self._died = array("q")
        self._open: dict[int, int] = {}  # tracker key -> entry

    def alloc(self, key: int, nbytes: int, site: str | None = None) -> None:
        """A storage of ``nbytes`` tracked under ``key``; ``site`` None: the caller's stack's site."""
        site = site if site is not None else self.frames.here(2)
        sid = self._ids.get(site)
        if sid is None:
            sid = self._ids[site] = len(self._names)
            self._names.append(site)
        self.seq += 1
        self._open[key] = len(self._site)
        self._site.append(sid)
        self._bytes.append(nbytes)
        self._born.append(self.seq)
        self._died.append(self.NEVER)

    def free(self, key: int) -> None:
        entry = self._open.pop(key, None)
        if entry is not None:
            self.seq += 1
            self._died[entry] = self.seq

    @property
    def names(self) -> list[str]:
        """Every site seen, in order of first allocation."""
        return list(self._names)

    def mark_peak(self) -> None:
        """The state now (after the last :meth:`alloc`) is the peak."""
        self.peak_seq = self.seq

    def at_peak(self, top: int | None = None) -> dict[str, dict[str, int]]:
        """``{site: {"bytes", "count"}}`` live at the marked peak, largest first; beyond ``top`` sites the
        rest folded into one ``(other sites)`` row (its count: the allocations)."""
        live_bytes: dict[int, int] = defaultdict(int)
        counts: dict[int, int] = defaultdict(int)
        peak = self.peak_seq
        for sid, nbytes, born, died in zip(self._site, self._bytes, self._born, self._died):
            if born <= peak < died:
                live_bytes[sid] += nbytes
                counts[sid] += 1
        ordered = sorted(live_bytes, key=lambda s: (-live_bytes[s], self._names[s]))
        out = {self._names[s]: {"bytes": live_bytes[s], "count": counts[s]} for s in ordered[:top]}
        rest = ordered[top:] if top is not None else []
        if rest:
            out[OTHER_SITES] = {"bytes": sum(live_bytes[s] for s in rest), "count": sum(counts[s] for s in rest)}
        return out


# ---------------------------------------------------------------------------------------------
# Predicted against measured
# ---------------------------------------------------------------------------------------------


@dataclass
class SiteRow:
    site: str
    predicted_bytes: int
    measured_bytes: int
    predicted_count: int
    measured_count: int

    @property
    def difference(self) -> int:  # measured - predicted: what the model misses (positive) or adds (negative)
        return self.measured_bytes - self.predicted_bytes


@dataclass
class Comparison:
    rows: list[SiteRow]  # largest |measured - predicted| first
    predicted_bytes: int  # sum of the model's sites (its eager step's peak)
    measured_bytes: int  # live at the traced peak (allocated while recording)
    untracked_bytes: int  # allocated before recording, still live at the end (not in the measured peak)
    unknown_frees: int = 0
    predicted_before_step: int = 0  # the model's storages from before the step (parameters, ..., batch)
    allocated_at_start: int = 0  # torch.cuda.memory_allocated() when the trace began (0: not recorded)
    extra: dict[str, Any] = field(default_factory=dict)  # what was compared (settings, files)

    def to_json(self) -> dict[str, Any]:
        rows = [{**asdict(r), "difference_bytes": r.difference} for r in self.rows]
        return {"rows": rows, "predicted_bytes": self.predicted_bytes, "measured_bytes": self.measured_bytes,
                "difference_bytes": self.measured_bytes - self.predicted_bytes, "untracked_bytes": self.untracked_bytes,
                "unknown_frees": self.unknown_frees, "predicted_before_step_bytes": self.predicted_before_step,
                "allocated_at_start_bytes": self.allocated_at_start, **self.extra}  # fmt: skip


def _as_sites(predicted: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{site: (bytes, count)}`` from the model's ``sites`` (``{"bytes", "count"}`` rows or plain bytes)."""
    out = {}
    for site, v in predicted.items():
        out[site] = (int(v["bytes"]), int(v.get("count", 0))) if isinstance(v, dict) else (int(v), 0)
    return out


def compare(report: PeakReport, predicted: dict[str, Any], extra: dict[str, Any] | None = None) -> Comparison:
    """Per site: the model's bytes at its peak (``predicted``: :attr:`MemoryEstimate.sites`) against the
    bytes live at the CUDA trace's peak (``report``), largest absolute difference first."""
    pred = _as_sites(predicted)
    rows = [
        SiteRow(site, pred.get(site, (0, 0))[0], report.by_site.get(site, 0), pred.get(site, (0, 0))[1],
                report.counts.get(site, 0))  # fmt: skip
        for site in dict.fromkeys([*pred, *report.by_site])
    ]
    rows.sort(key=lambda r: (-abs(r.difference), r.site))
    return Comparison(rows=rows, predicted_bytes=sum(b for b, _ in pred.values()), measured_bytes=report.peak_bytes,
                      untracked_bytes=report.untracked_bytes, unknown_frees=report.unknown_frees,
                      predicted_before_step=sum(pred[s][0] for s in BEFORE_STEP if s in pred),
                      allocated_at_start=report.allocated_at_start, extra=dict(extra or {}))  # fmt: skip


def read_peak(path: str) -> PeakReport:
    """The CUDA side of a comparison from a file: an allocator snapshot (``*.pickle[.gz]``, as
    ``bench/step_headline.py --memory-snapshot`` writes it) or the peak summary it writes beside it
    (``*_memory_peak.json``). A missing or unreadable file: ``ValueError`` with one line naming it."""
    import json

    from scalefold.perf.cuda_snapshot import load_snapshot, peak_allocations

    try:
        if str(path).endswith(".json"):
            with open(path) as fh:
                return PeakReport(**json.load(fh))
        snap = load_snapshot(path)
    except FileNotFoundError:
        raise ValueError(f"no such file: {path}") from None
    except Exception as exc:  # noqa: BLE001 -- unpickling arbitrary bytes raises many kinds: one line for all
        raise ValueError(f"cannot read {path} as an allocator snapshot or peak summary: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from None  # fmt: skip
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise ValueError(f"{path} is not an allocator snapshot (torch.cuda.memory._snapshot(): no device_traces)")
    return peak_allocations(snap)


def format_comparison(cmp: Comparison, top: int = 30) -> str:
    """The side-by-side table: GiB per site at the predicted and the measured peak, measured - predicted."""
    def gib(n: int) -> str:
        return f"{n / GiB:>9.3f}"

    lines = [f"{'predicted':>9} {'measured':>9} {'meas-pred':>9} {'n pred':>7} {'n meas':>7}  allocated at (GiB)"]
    for r in cmp.rows[:top]:
        lines.append(f"{gib(r.predicted_bytes)} {gib(r.measured_bytes)} {gib(r.difference)} {r.predicted_count:>7} "
                     f"{r.measured_count:>7}  {r.site}")  # fmt: skip
    rest = cmp.rows[top:]
    if rest:
        p, m = sum(r.predicted_bytes for r in rest), sum(r.measured_bytes for r in rest)
        lines.append(f"{gib(p)} {gib(m)} {gib(m - p)} {'':>7} {'':>7}  ({len(rest)} more sites)")
    lines.append(f"{gib(cmp.predicted_bytes)} {gib(cmp.measured_bytes)} {gib(cmp.measured_bytes - cmp.predicted_bytes)} "
                 f"{'':>7} {'':>7}  total at each side's peak")  # fmt: skip
    lines.append(f"allocated before the trace began and live at its end (not in 'measured'): {cmp.untracked_bytes / GiB:.3f} "
                 f"GiB; the model's storages from before the step ({', '.join(BEFORE_STEP)}, in 'predicted'): "
                 f"{cmp.predicted_before_step / GiB:.3f} GiB")  # fmt: skip
    if cmp.allocated_at_start:
        lines.append(f"allocated when the trace began: {cmp.allocated_at_start / GiB:.3f} GiB; measured peak + that: "
                     f"{(cmp.measured_bytes + cmp.allocated_at_start) / GiB:.3f} GiB")  # fmt: skip
    if cmp.unknown_frees:
        lines.append(f"{cmp.unknown_frees} frees of blocks the trace never saw allocated: its start may be cut off "
                     "(record_history's max_entries)")  # fmt: skip
    return "\n".join(lines)


def format_sites(sites: dict[str, dict[str, int]], top: int = 25) -> str:
    """The model's sites at its peak as text: the ``top`` largest and the rest."""
    items = list(sites.items())
    lines = [f"  by allocating site at the peak ({len(items)} sites), largest first:"]
    lines += [f"    {v['bytes'] / 2**20:10.2f} MiB {v['count']:>6}  {k}" for k, v in items[:top]]
    rest = items[top:]
    if rest:
        lines.append(f"    {sum(v['bytes'] for _, v in rest) / 2**20:10.2f} MiB {sum(v['count'] for _, v in rest):>6}  "
                     f"({len(rest)} more sites)")  # fmt: skip
    return "\n".join(lines)


__all__ = ["BEFORE_STEP", "Comparison", "FrameSites", "OTHER_SITES", "SiteLog", "SiteRow", "compare", "format_comparison", "read_peak",
           "format_sites"]  # fmt: skip
