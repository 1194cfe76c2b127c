"""The memory model's allocating sites and their comparison with a CUDA allocator trace (no CUDA needed:
the trace is a hand-built dict of ``torch.cuda.memory._snapshot()``'s layout). Tiny preset only."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from scalefold.config.training import TrainConfig
from scalefold.perf.cuda_snapshot import NO_STACK, PeakReport, dump_snapshot, peak_allocations, project_path
from scalefold.perf.memory import StorageTracker, estimate_memory
from scalefold.perf.memory_sites import OTHER_SITES, SiteLog, compare, format_comparison, read_peak

REPO = Path(__file__).resolve().parents[2]
SITE = re.compile(r"^(scalefold/[\w/]+\.py):(\d+) (\w+|<\w+>)$")  # <dictcomp> etc. (Python < 3.12), <lambda>


def _cfg() -> TrainConfig:
    return TrainConfig.from_preset("tiny", overrides={"precision": "bf16", "activation_checkpointing": True}, env={})


@pytest.fixture(scope="module")
def est():
    return estimate_memory(_cfg(), target="cuda", kernels="torch", cuda_graphs=False, sites=True)


def test_sites_add_up_to_the_peak_and_name_lines_of_the_model(est):
    assert sum(v["bytes"] for v in est.sites.values()) == est.step_peak_bytes
    assert sum(v["count"] for v in est.sites.values()) > len(est.sites) > 20
    for category in ("parameters", "gradients", "optimizer_state", "batch"):  # storages from before the step
        assert est.sites[f"({category})"]["bytes"] == est.breakdown[category]
    code = {k: v for k, v in est.sites.items() if not k.startswith("(")}
    assert sum(v["bytes"] for v in code.values()) > 0.5 * est.step_peak_bytes
    for site in code:
        m = SITE.match(site)
        assert m, site
        path, line, func = m.group(1), int(m.group(2)), m.group(3)
        assert not path.startswith("scalefold/perf/"), site  # the tracker's own frames are skipped
        lines = (REPO / path).read_text().splitlines()
        assert 1 <= line <= len(lines), site
        assert func.startswith("<") or re.search(rf"def {func}\b", "\n".join(lines[:line])), site
    assert list(est.sites) == sorted(est.sites, key=lambda k: -est.sites[k]["bytes"])  # largest first
    assert estimate_memory(_cfg(), target="cuda", kernels="torch", cuda_graphs=False).sites == {}  # off: none


def test_backward_sites_stop_at_the_autograd_engine():
    """Operators the engine runs itself have no Python stack (on CUDA: its device thread), whoever called
    backward; the forward's allocations name the model's line."""
    from scalefold.model.primitives import LayerNorm

    layer = LayerNorm(8)
    x = torch.randn(3, 8, requires_grad=True)
    forward = StorageTracker(sites=True)
    with forward:
        y = layer(x)
    assert forward.sites.names and all(n.startswith("scalefold/") for n in forward.sites.names), forward.sites.names
    loss = torch.nn.functional.gelu(y).sum()
    backward = StorageTracker(sites=True)
    with backward:
        loss.backward()
    names = backward.sites.names
    assert NO_STACK in names and x.grad is not None
    # only the scalar loss's seed gradient, made before the engine starts (on CUDA too), has frames
    assert all(n == NO_STACK or n.endswith(" _make_grads") for n in names), names


def test_site_log_keeps_what_was_live_at_the_marked_peak():
    log = SiteLog()
    log.alloc(1, 100, "a")
    log.alloc(2, 50, "b")
    log.mark_peak()
    log.free(1)
    log.alloc(3, 70, "b")  # 120 live: below the peak
    log.alloc(4, 10, "c")
    assert log.at_peak() == {"a": {"bytes": 100, "count": 1}, "b": {"bytes": 50, "count": 1}}
    assert log.at_peak(top=1) == {"a": {"bytes": 100, "count": 1}, OTHER_SITES: {"bytes": 50, "count": 1}}


def test_project_frames_whatever_the_checkout_is_called():
    assert project_path("/root/scalefold/scalefold/model/triangle.py") == "scalefold/model/triangle.py"
    assert project_path("/x/site-packages/scalefold/kernels/reference.py") == "scalefold/kernels/reference.py"
    assert project_path("/root/scalefold/scalefold/cli.py") == "scalefold/cli.py"
    assert project_path("/root/scalefold/bench/step_headline.py") is None
    assert project_path("/root/scalefold/.venv/lib/python3.12/site-packages/torch/nn/functional.py") is None
    assert project_path("/root/myscalefold/model/triangle.py") is None


def _frames(site: str, checkout: str = "/root/scalefold/") -> list[dict]:
    """Frames (innermost first) a CUDA trace would hold for an allocation at ``site``: torch's, then the
    model line, then the caller's; in a checkout folder called ``scalefold``."""
    m = SITE.match(site)
    return [{"filename": "/venv/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": checkout + m.group(1), "line": int(m.group(2)), "name": m.group(3)},
            {"filename": checkout + "bench/step_headline.py", "line": 5, "name": "run_config"}]  # fmt: skip


def _trace_of(sites: dict, bump: str, bump_bytes: int) -> dict:
    """A snapshot whose peak holds exactly the model's code sites, ``bump`` with ``bump_bytes`` more, one
    site the model does not have, and a block allocated before recording."""
    events, addr = [{"action": "alloc", "addr": 10**6 + 1, "size": 4096, "frames": []},  # engine thread: no stack
                    {"action": "free_completed", "addr": 10**6 + 1, "size": 4096}], 0  # fmt: skip
    for site, v in sites.items():
        if site.startswith("("):
            continue  # parameters etc.: allocated elsewhere on CUDA
        per = v["bytes"] // v["count"]
        for i in range(v["count"]):
            addr += 1
            events.append({"action": "alloc", "addr": addr, "size": v["bytes"] - per * i if i == v["count"] - 1 else per,
                           "frames": _frames(site)})  # fmt: skip
    events.append({"action": "alloc", "addr": 10**6, "size": bump_bytes, "frames": _frames(bump)})
    segments = [{"device": 0, "blocks": [{"address": 0, "size": 512, "state": "active_allocated"}]}]
    return {"device_traces": [events], "segments": segments}


def test_comparison_with_a_trace_of_the_same_sites(est):
    code = [k for k in est.sites if not k.startswith("(")]
    bump = code[0]
    extra = est.step_peak_bytes  # more than any row: the bumped site comes first
    report = peak_allocations(_trace_of(est.sites, bump, extra))
    assert report.untracked_bytes == 512 and report.unknown_frees == 0
    cmp = compare(report, est.sites)
    rows = {r.site: r for r in cmp.rows}
    assert set(rows) == set(est.sites)  # the no-stack block was freed before the trace's peak
    assert cmp.rows[0].site == bump and rows[bump].difference == extra
    assert rows[bump].measured_bytes == est.sites[bump]["bytes"] + extra
    for site in code[1:]:
        assert rows[site].difference == 0 and rows[site].measured_count == est.sites[site]["count"], site
    assert rows["(parameters)"].difference == -est.sites["(parameters)"]["bytes"]
    assert [abs(r.difference) for r in cmp.rows] == sorted((abs(r.difference) for r in cmp.rows), reverse=True)
    assert cmp.predicted_bytes == est.step_peak_bytes
    assert cmp.measured_bytes == sum(v["bytes"] for k, v in est.sites.items() if not k.startswith("(")) + extra
    js = cmp.to_json()
    assert js["difference_bytes"] == cmp.measured_bytes - cmp.predicted_bytes and js["untracked_bytes"] == 512
    assert json.loads(json.dumps(js))["rows"][0]["difference_bytes"] == cmp.rows[0].difference
    text = format_comparison(cmp, top=3)
    assert bump in text and "total at each side's peak" in text and "more sites" in text


def test_record_history_asks_for_allocation_stacks_and_skips_unread_events(monkeypatch):
    from scalefold.perf import cuda_snapshot

    seen = []

    def new(enabled="all", context="all", stacks="all", max_entries=0, skip_actions=None):  # torch >= 2.9
        seen.append({"context": context, "stacks": stacks, "max_entries": max_entries, "skip_actions": skip_actions})

    def old(enabled="all", context="all", stacks="all", max_entries=0):  # torch 2.6
        seen.append({"context": context, "stacks": stacks, "max_entries": max_entries})

    for fn in (new, old):
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fn)
        cuda_snapshot.record_history(max_entries=5)
    assert seen[0] == {"context": "alloc", "stacks": "python", "max_entries": 5,
                       "skip_actions": list(cuda_snapshot.SKIPPED_ACTIONS)}  # fmt: skip
    assert seen[1] == {"context": "alloc", "stacks": "python", "max_entries": 5}
    assert not {"alloc", "free_completed"} & set(cuda_snapshot.SKIPPED_ACTIONS)  # what peak_allocations reads


def test_cli_sites_flag(capsys):
    from scalefold.cli import main

    assert main(["estimate-memory", "--preset", "tiny", "--kernels", "torch", "--sites", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(v["bytes"] for v in out["sites"].values()) == out["step_peak_bytes"]
    assert any(SITE.match(k) for k in out["sites"])
    assert main(["estimate-memory", "--preset", "tiny", "--kernels", "torch", "--sites"]) == 0
    assert "by allocating site at the peak" in capsys.readouterr().out


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_compare_snapshot_end_to_end_and_bad_files(est, tmp_path, capsys):
    bench = _bench("memory_model")
    code = [k for k in est.sites if not k.startswith("(")]
    snap = dump_snapshot(_trace_of(est.sites, code[1], est.step_peak_bytes), tmp_path / "eager_memory.pickle.gz")
    out = tmp_path / "cmp.json"
    assert bench.main(["--compare-snapshot", str(snap), "--preset", "tiny", "--precision", "bf16", "--kernels", "torch",
                       "--activation-checkpointing", "on", "--json", str(out)]) == 0  # fmt: skip
    js = json.loads(out.read_text())
    assert js["rows"][0]["site"] == code[1] and js["rows"][0]["difference_bytes"] == est.step_peak_bytes
    assert all(r["difference_bytes"] == 0 for r in js["rows"] if r["site"] in code[2:])  # the same model, the same lines
    assert js["predicted_bytes"] == est.step_peak_bytes and "total at each side's peak" in capsys.readouterr().out
    saved = tmp_path / "memory_model_torch.json"
    saved.write_text(json.dumps(est.to_json()))
    assert bench.main(["--compare-snapshot", str(snap), "--sites-json", str(saved), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == js["rows"]  # the model's saved output: the same comparison
    assert bench.main(["--compare-snapshot", str(snap), "--sites-json", str(snap)]) == 2
    assert "--sites-json" in capsys.readouterr().err
    garbage = tmp_path / "garbage.pickle.gz"
    garbage.write_bytes(b"not a gzip file")
    not_a_snapshot = tmp_path / "dict.pickle.gz"
    with gzip.open(not_a_snapshot, "wb") as fh:
        pickle.dump({"segments": []}, fh)
    for bad in (tmp_path / "missing.pickle.gz", garbage, not_a_snapshot):
        assert bench.main(["--compare-snapshot", str(bad), "--preset", "tiny"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(bad) in err and "Traceback" not in err


def test_headline_asks_for_sites_and_compares(tmp_path, capsys):
    h = _bench("step_headline")
    args = argparse.Namespace(preset="mlperf", precision="bf16", activation_checkpointing=None, configs=["eager", "triton"],
                              memory_snapshot=str(tmp_path))  # fmt: skip
    cmds = h.estimate_commands(args)
    assert "--sites" in cmds["torch"] and "--sites" not in cmds["triton"]
    assert all("--sites" not in c for c in h.estimate_commands(argparse.Namespace(**{**vars(args), "memory_snapshot": None})).values())
    site = "scalefold/model/triangle.py:99 forward"
    report = PeakReport(peak_bytes=300, event_index=1, by_site={site: 300}, counts={site: 2}, untracked_bytes=7,
                        allocated_at_start=1000)  # fmt: skip
    (tmp_path / "eager_memory_peak.json").write_text(json.dumps(report.__dict__))
    assert read_peak(str(tmp_path / "eager_memory_peak.json")) == report
    predicted = {"torch": {"sites": {site: {"bytes": 100, "count": 1}, "(parameters)": {"bytes": 50, "count": 3}},
                           "settings": {"kernels": "torch"}}}  # fmt: skip
    h.compare_memory(args, [{"config": "eager", "cuda_graphs": False, "peak_bytes": 400}], predicted)
    js = json.loads((tmp_path / "eager_memory_compare.json").read_text())
    assert [(r["site"], r["difference_bytes"]) for r in js["rows"]] == [(site, 200), ("(parameters)", -50)]
    assert js["max_memory_allocated"] == 400 and js["untracked_bytes"] == 7 and js["allocated_at_start_bytes"] == 1000
    assert js["predicted_before_step_bytes"] == 50
    assert site in capsys.readouterr().out
    import sys
    import time

    line = json.dumps({"peak_bytes": 1, "step_peak_bytes": 1, "sites": {site: {"bytes": 1, "count": 1}}})
    est = h.Estimates({"torch": [sys.executable, "-c", f"print({line!r})"]}, tmp_path / "kept", cap=300)
    got = est.poll(until=time.monotonic() + 300)
    assert got["torch"]["sites"] and json.loads((tmp_path / "kept" / "torch.json").read_text()) == got["torch"]
