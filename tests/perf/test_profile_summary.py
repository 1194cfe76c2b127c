"""The headline's profile of one step, summarised (on a Chrome trace, synthetic and real), its plan and
table (``bench/step_headline.py``) and ``gpu_session.sh``'s dry run: everything of the headline a CPU can check."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from scalefold.perf.profile_summary import plot_summary, profile_step, summarize_trace

REPO = Path(__file__).resolve().parents[2]


def _ev(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def _trace():
    """One step: forward (module::evoformer_stack inside) 0-100 µs, backward 100-200 µs; three launches, one
    of them a CUDA-graph replay; kernels on the device overlapping once."""
    return {"traceEvents": [
        _ev("phase::forward", "user_annotation", 0, 100), _ev("module::evoformer_stack", "user_annotation", 10, 60),
        _ev("phase::backward", "user_annotation", 100, 100),
        _ev("cudaLaunchKernel", "cuda_runtime", 20, 2, correlation=1),
        _ev("cuLaunchKernel", "cuda_driver", 80, 2, correlation=2),  # a Triton kernel
        _ev("cudaGraphLaunch", "cuda_runtime", 150, 3, correlation=3),
        _ev("gemm", "kernel", 25, 40, correlation=1), _ev("softmax", "kernel", 50, 30, correlation=2),
        _ev("gemm", "kernel", 160, 20, correlation=3), _ev("aten::mm", "cpu_op", 19, 5),
        {"ph": "M", "name": "process_name"},
    ]}  # fmt: skip


def test_summary_attributes_kernels_to_phases_and_modules():
    s = summarize_trace(_trace())
    assert s["device"] == "cuda" and s["wall_s"] == pytest.approx(200e-6)
    assert s["kernel_s"] == pytest.approx((80 - 25 + 20) * 1e-6)  # [25, 80] union [160, 180]
    assert s["busy_fraction"] == pytest.approx(75 / 200)
    assert s["kernels_per_step"] == 3 and s["launches_per_step"] == 3 and s["ops_per_step"] == 1
    assert s["phases"]["forward"] == {"device_s": pytest.approx(70e-6), "kernels": 2, "host_s": pytest.approx(100e-6)}
    assert s["phases"]["backward"]["kernels"] == 1
    assert s["modules"]["evoformer_stack"]["kernels"] == 1  # the launch at 80 µs is outside the module's range
    assert s["top"][0] == {"name": "gemm", "s": pytest.approx(60e-6), "count": 2}
    halves = summarize_trace(_trace(), steps=2)
    assert halves["kernels_per_step"] == 1.5 and halves["wall_s"] == pytest.approx(100e-6)


def test_summary_without_kernels_uses_host_operators():
    trace = {"traceEvents": [_ev("phase::forward", "user_annotation", 0, 10), _ev("aten::add", "cpu_op", 1, 4)]}
    s = summarize_trace(trace)
    assert s["device"] == "cpu" and s["busy_fraction"] is None and s["kernel_s"] is None
    assert s["top"] == [{"name": "aten::add", "s": pytest.approx(4e-6), "count": 1}]
    assert s["phases"]["forward"]["kernels"] == 1


def test_profile_of_a_real_tiny_step_on_cpu(tmp_path):
    """torch.profiler on the tiny training step: every phase and the top-level modules are found."""
    from scalefold.config.training import TrainConfig
    from scalefold.train.step import TrainingStep

    step = TrainingStep.build(TrainConfig.from_preset("tiny", env={}))
    s = profile_step(step, 1, tmp_path, "tiny", keep_trace=True)
    assert set(s["phases"]) == {"forward", "loss", "backward", "optimizer"}
    assert {"evoformer_stack", "extra_msa_stack", "structure_module"} <= set(s["modules"])
    assert s["modules"]["evoformer_stack"]["host_s"] > 0 and s["ops_per_step"] > 100
    assert json.loads((tmp_path / "tiny_profile.json").read_text())["recycling_passes"] == 1
    assert (tmp_path / "tiny_trace.json.gz").exists() and not (tmp_path / "tiny_trace.json").exists()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "tiny_profile.png").stat().st_size > 0
    assert plot_summary(summarize_trace(_trace()), tmp_path / "gpu.png").stat().st_size > 0


def _headline():
    spec = importlib.util.spec_from_file_location("step_headline", REPO / "bench" / "step_headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_headline_plan_mfu_and_table(capsys):
    h = _headline()
    assert h.main(["--dry-run", "--no-estimate", "--deadline", "465", "--card", "h100"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "expected ~" in line and "kernels=" in line]
    assert [line.split()[0] for line in lines] == ["eager", "graphs-step", "all", "triton", "graphs", "compile"]  # priority order
    for line, name in zip(lines, h.CONFIGS):
        expect = h.hp.expected_s(name, "h100-sxm")
        assert f"expected ~{expect:>3.0f} s, cap {h.hp.cap_s(expect):.0f} s" in line
    assert "skipped" in lines[-1] and "total expected ~" in out  # compile does not fit 465 s on an H100
    assert h.flops_by_recycling(None) is None
    assert h.flops_by_recycling({"model_flops": {"0": 1e12, "1": 2e12}}) == {0: 1e12, 1: 2e12}
    import argparse

    cmd = h.flops_command(argparse.Namespace(preset="mlperf", precision="bf16"))
    assert cmd[2:] == ["scalefold", "estimate-step", "--preset", "mlperf", "--precision", "bf16", "--kernels", "triton", "--json"]
    assert h.mfu({0: 1.0, 1: 2.0}, {0: 1e12, 1: 5e12}, 1e12) == pytest.approx(2.0)
    assert h.mfu({0: 1.0}, None, 1e12) is None and h.peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12, rel=1e-3)
    assert h.peak_flops("NVIDIA H100 PCIe") == pytest.approx(756e12, rel=0.01) and h.peak_flops("Radeon") is None
    rows = [{"config": "eager", "kernels": "torch", "compile": False, "cuda_graphs": False, "step_s": 2.0,
             "step_s_by_recycling": {"0": 1.5, "1": 2.5}, "setup_s": 20, "mfu": None, "peak_bytes": 2**31,
             "profile": {"busy_fraction": 0.5, "launches_per_step": 9000}},
            {"config": "compile", "kernels": "torch", "compile": True, "cuda_graphs": False, "step_s": 1.0,
             "step_s_by_recycling": {"0": 0.8, "1": 1.2}, "setup_s": 60, "mfu": 0.31, "peak_bytes": 2**30,
             "graph_breaks": 0, "recompiles": 0},
            {"config": "all", "error": "no result: cap reached (cap 150 s)"}]  # fmt: skip
    table = h.format_table(rows, {"torch": {"peak_bytes": 2**31, "step_peak_bytes": 2**30}})
    lines = table.splitlines()
    assert "1.50/2.50" in lines[1] and "1.00x" in lines[1] and "0.5" in lines[1] and "9000" in lines[1]
    assert "2.00x" in lines[2] and "0.310" in lines[2] and "+0.0%" in lines[2] and "breaks 0" in lines[2]
    assert "cap reached" in lines[3]


def test_headline_caps_a_slow_configuration():
    """A child that outlives its cap is stopped and reported, and the next one still runs."""
    h = _headline()
    row, status = h.run_capped(["python3", "-c", "import time; print('started', flush=True); time.sleep(60)"], 2)
    assert row is None and status == "cap reached"
    row, status = h.run_capped(["python3", "-c", 'print(\'ROW {"config": "x"}\')'], 30)
    assert row == {"config": "x"} and status == "ok"
    seen = []  # a cap that lands after the row (mid-profile): the row stands, handed over the moment it was printed
    child = 'import time; print(\'ROW {"config": "y", "step_s": 1.0}\', flush=True); time.sleep(600)'
    row, status = h.run_capped(["python3", "-c", child], 20, on_row=seen.append)
    assert row == {"config": "y", "step_s": 1.0} and seen == [row] and status == "ok, cap reached after the row"


def test_gpu_session_dry_run_prints_the_headline_plan(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "PARTS": "headline", "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "PYTHON": os.environ.get("PYTHON", "python3"), "COMPILE_CACHE": str(tmp_path / "cache")}  # fmt: skip
    import sys

    env["PYTHON"] = sys.executable
    run = subprocess.run(["bash", str(REPO / "bench" / "gpu_session.sh")], env=env, capture_output=True, text=True,
                         timeout=600, cwd=REPO)  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-2000:]
    assert "step_headline (plan)" in out and "expected ~" in out
    plan = [line for line in out.splitlines() if line.startswith("  ") and "kernels=" in line]
    assert [line.split()[0] for line in plan][:6] == ["eager", "graphs-step", "all", "triton", "graphs", "compile"]
    expected = int(out.split("step_headline (plan)")[1].split("total expected ~")[1].split()[0])
    assert f"(dry run) expected ~{expected}s, limit 480s" in out and f"--compile-cache {tmp_path / 'cache'}" in out
    assert "tests_kernels" not in out.split("step_headline (plan)")[1].split("summary")[0] or "not in PARTS" in out
    total = int(out.split("the call expects ~")[1].split("s")[0])
    # every part of the call (env, install, capture_real, the headline, the trainer's two runs and their comparison,
    # packing) as the plan counts them, >= 15 % under the 540 s deadline
    assert total == 20 + 3 + 90 + expected + 55 + 55 + 3 + 5 and total <= 0.85 * 540
    assert f"total expected ~{total} s of the 540 s deadline" in out
    assert "window plan (15 minutes" in out and "give_back" in out and "machine start" in out
