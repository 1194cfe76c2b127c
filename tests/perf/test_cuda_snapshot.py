"""The peak-of-a-real-run summary, on a hand-made snapshot of the allocator's layout (no CUDA needed)."""

from __future__ import annotations

from scalefold.perf.cuda_snapshot import dump_snapshot, format_peak, load_snapshot, peak_allocations


def _frames(*sites):
    return [{"filename": f, "line": line, "name": name} for f, line, name in sites]


ATT = ("/x/site-packages/scalefold/kernels/reference.py", 40, "attention")
MUL = ("/x/site-packages/scalefold/model/triangle.py", 99, "forward")
TORCH = ("/x/site-packages/torch/nn/functional.py", 1, "softmax")


def _snapshot():
    ev = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(TORCH, ATT, MUL)},  # innermost first
        {"action": "alloc", "addr": 2, "size": 300, "frames": _frames(MUL)},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 250, "frames": _frames(TORCH, ATT)},
        {"action": "alloc", "addr": 4, "size": 50, "frames": _frames(TORCH)},  # peak: 300 + 250 + 50
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "free_completed", "addr": 99, "size": 7},  # allocated before recording: ignored
        {"action": "alloc", "addr": 5, "size": 200, "frames": []},  # 500 live: below the peak
    ]
    segments = [{"device": 0, "blocks": [{"address": 77, "size": 1000, "state": "active_allocated"},
                                         {"address": 5, "size": 200, "state": "active_allocated"}]}]  # fmt: skip
    return {"device_traces": [ev], "segments": segments}


def test_peak_is_the_largest_live_total_grouped_by_the_innermost_project_frame(tmp_path):
    report = peak_allocations(_snapshot())
    assert report.peak_bytes == 600 and report.event_index == 5
    assert list(report.by_site) == [
        "scalefold/model/triangle.py:99 forward",
        "scalefold/kernels/reference.py:40 attention",
        "/x/site-packages/torch/nn/functional.py:1 softmax",  # no project frame: the innermost one
    ]
    assert list(report.by_site.values()) == [300, 250, 50]
    assert report.untracked_bytes == 1000  # live in a segment, never seen allocated in the trace
    text = format_peak(report, top=2)
    assert "1 more sites" in text and "scalefold/model/triangle.py:99 forward" in text
    path = dump_snapshot(_snapshot(), tmp_path / "snap.pickle.gz")
    assert peak_allocations(load_snapshot(path)).peak_bytes == 600


def test_an_empty_trace_reports_nothing():
    report = peak_allocations({"device_traces": [], "segments": []})
    assert report.peak_bytes == 0 and report.by_site == {}
