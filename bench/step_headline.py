"""The headline GPU figure: the full training step at MLPerf shapes, five ways, in one run.

The training step of ``scalefold train --preset mlperf --precision bf16`` (crop 256, 124 MSA clusters,
1,024 extra MSA rows, 4 templates, activation checkpointing; recycling counts 0..3 in turn, the
uniform draw of training) timed as

    eager     PyTorch reference kernels, no compile, no CUDA graphs   (SCALEFOLD_KERNELS=torch)
    triton    the fused Triton kernels instead of the references       (SCALEFOLD_KERNELS=triton)
    graphs    CUDA graphs of the no-grad recycling passes (GraphedStep)
    compile   + torch.compile of the model's elementwise chains (compile_blocks' default region)
    all       Triton kernels + compile + CUDA graphs

each in a process of its own (a fresh model, same seed), killed at its cap (``CONFIGS``) so one slow
configuration cannot starve the rest, all within ``--deadline``. Per configuration: s/step per recycling
count and their mean, MFU (model FLOPs from ``scalefold estimate-step``, counted on the host CPUs meanwhile, over the device's dense peak), ``torch.cuda.max_memory_allocated``
against the memory model's prediction (``scalefold estimate-memory``, computed meanwhile on the host's CPUs),
and a ``torch.profiler`` profile of one step (``--out``: ``<config>_profile.json`` and ``.png``, per phase,
per top-level module and the top kernels, with the GPU's busy fraction and the kernel launches per step;
:mod:`scalefold.perf.profile_summary`). One JSON line per configuration as it finishes, a table at the end.
Inductor's and Triton's caches go to ``--compile-cache`` (kept between runs: the second run starts warm).

    python bench/step_headline.py [--configs eager triton graphs compile all] [--cycles 1] [--out DIR] [--dry-run]

Needs CUDA: elsewhere it says so and exits 2 (``--dry-run`` prints the plan with expected seconds, anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRACE_S = (20, 40)  # --memory-snapshot: the traced configuration's extra (expected, cap) seconds: one step recorded
# with its stacks, the snapshot, its peak and the gzip dump (estimated: not yet measured at MLPerf shapes)
CONFIGS = {  # name -> (kernels, compile, cuda graphs, expected s, cap s) on an H100 at MLPerf shapes; run in this order.
    # expected: child start + model and batch (~15 s) + the warm-up cycle (4 steps, ~3.5 s each on the H200) + a
    # timed cycle + one profiled step; compile: + inductor / Triton for the elementwise chains (cold cache)
    "eager": ("torch", False, False, 60, 100),
    "triton": ("triton", False, False, 65, 100),
    "graphs": ("torch", False, True, 70, 100),
    "compile": ("torch", True, False, 100, 150),
    "all": ("triton", True, True, 110, 150),
}


def flops_command(args: argparse.Namespace) -> list[str]:
    """``scalefold estimate-step``: the step's model FLOPs per recycling count (no recomputation: the
    same for every configuration), counted on the host's CPUs while the configurations run."""
    policy = ["--activation-checkpointing", args.activation_checkpointing] if getattr(args, "activation_checkpointing", None) else []
    return [sys.executable, "-m", "scalefold", "estimate-step", "--preset", args.preset, "--precision", args.precision,
            "--kernels", "triton", *policy, "--json"]  # fmt: skip


def flops_by_recycling(estimate: dict | None) -> dict[int, float] | None:
    """``{n: model FLOPs}`` of a step with ``n`` no-grad recycling passes from ``estimate-step``'s JSON."""
    if not estimate or "model_flops" not in estimate:
        return None
    return {int(n): float(f) for n, f in estimate["model_flops"].items()}


def mfu(step_s_by_recycling: dict[int, float], flops: dict[int, float] | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation of the uniform recycling draw: total FLOPs of one step per recycling count over
    their total time, over the device's peak; None without FLOPs, peak or times."""
    if not flops or not peak_flops or not step_s_by_recycling:
        return None
    counts = [n for n in step_s_by_recycling if n in flops]
    seconds = sum(step_s_by_recycling[n] for n in counts)
    return round(sum(flops[n] for n in counts) / seconds / peak_flops, 4) if counts and seconds > 0 else None


def peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """The device's dense peak at ``precision`` (:mod:`scalefold.perf.devices`; None: unknown)."""
    from scalefold.perf.devices import device_spec

    spec = device_spec(device_name)
    return spec.peak_flops(precision) if spec is not None else None


def plan(args: argparse.Namespace) -> list[str]:
    """The dry run's lines: each configuration with its expected seconds and cap, the memory model, the total."""
    lines = [f"step_headline (plan): preset {args.preset} {args.precision}; per configuration a process of its own "
             f"(model, batch, one warm-up cycle of recycling counts 0..R-1, {args.cycles} timed cycle(s), one profiled "
             f"step), killed at its cap; deadline {args.deadline} s for all"]  # fmt: skip
    total = 0
    for name in args.configs:
        kernels, compiled, graphs, expect, cap = CONFIGS[name]
        total += expect
        lines.append(f"  {name:<8} kernels={kernels:<6} compile={str(compiled):<5} cuda_graphs={str(graphs):<5} "
                     f"expected ~{expect:>3} s, cap {cap} s  -> s/step per recycling count, mean, MFU, peak memory, profile")  # fmt: skip
    for kernels, cmd in ({} if args.no_estimate else estimate_commands(args)).items():
        lines.append(f"  memory model ({kernels} kernels, on the CPUs meanwhile): {' '.join(cmd[1:])}")
    if args.memory_snapshot and args.configs:
        first = args.configs[0]
        total += TRACE_S[0]
        lines.append(f"  allocator trace of one more {first} step (1 recycling pass, as the memory model), after its row: "
                     f"expected ~{TRACE_S[0]} s, its cap +{TRACE_S[1]} s; {args.memory_snapshot}/{first}_memory.pickle.gz (+ _peak.json); "
                     f"at the end, by allocating line against the memory model's --sites: {first}_memory_compare.json")  # fmt: skip
    caps = sum(CONFIGS[n][4] for n in args.configs) + (TRACE_S[1] if args.memory_snapshot and args.configs else 0)
    lines.append(f"  total expected ~{total} s (caps {caps} s, cut to the deadline "
                 f"{args.deadline} s); compile cache {args.compile_cache or '(default)'}")  # fmt: skip
    return lines


def estimate_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The memory-model runs whose predictions the configurations are compared with."""
    base = [sys.executable, "-m", "scalefold", "estimate-memory", "--preset", args.preset, "--precision",
            args.precision, "--json"]  # fmt: skip
    if args.activation_checkpointing:
        base += ["--activation-checkpointing", args.activation_checkpointing]
    traced = traced_kernels(args)  # its allocating sites, for the comparison with the allocator trace
    return {kernels: base + ["--kernels", kernels] + (["--sites"] if kernels == traced else [])
            for kernels in ("torch", "triton")}  # fmt: skip


def traced_kernels(args: argparse.Namespace) -> str | None:
    """The kernels of the configuration whose allocator trace is recorded (``--memory-snapshot``: the first)."""
    return CONFIGS[args.configs[0]][0] if args.memory_snapshot and args.configs else None


def run_config(name: str, args: argparse.Namespace, keep: dict | None = None) -> dict:
    """One configuration, in this process: build, warm up (compilation, capture), time, profile. ``keep``: gets
    ``run_step(n)``, one more step of the built configuration (the allocator trace, after the row is out)."""
    import torch

    from scalefold.compilation.cache import compile_with_rebuild
    from scalefold.compilation.graphed_step import GraphedStep
    from scalefold.compilation.regions import compile_blocks
    from scalefold.config.training import TrainConfig
    from scalefold.perf.profile_summary import profile_step
    from scalefold.train.step import TrainingStep

    kernels, compiled, graphs = CONFIGS[name][:3]
    os.environ["SCALEFOLD_KERNELS"] = kernels
    torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    overrides = {"precision": args.precision, "cuda_graphs": "on" if graphs else "off"}
    if args.activation_checkpointing:
        overrides["activation_checkpointing"] = args.activation_checkpointing
    cfg = TrainConfig.from_preset(args.preset, overrides=overrides, env={})
    step = TrainingStep.build(cfg, "cuda")
    report = compile_blocks(step.model, backend="inductor", loss_fn=step.loss_fn) if compiled else None
    forward = None
    if graphs:
        graphed = GraphedStep(step.model, enabled=True, log=None)
        graphed.warm_up(step.batch, autocast=step.autocast)
        if not graphed.active:
            return {"config": name, "error": f"CUDA graphs off: {graphed.reason}"}
        forward = graphed
    counts = list(range(step.num_ensembles))

    def warm_up_cycle() -> None:  # compilation, cuDNN/cuBLAS heuristics (no autotuning: SCALEFOLD_AUTOTUNE=0)
        for n in counts:
            step.run(n, forward=forward)

    compile_with_rebuild(warm_up_cycle)  # a corrupt compile cache: emptied with one line, compiled again
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t_build
    if report is not None:
        report.mark_warm()
    if keep is not None:
        keep["run_step"] = lambda n: step.run(min(n, counts[-1]), forward=forward)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.cycles):
        for n in counts:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step.run(n, forward=forward)
            torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t0)
    per_n = {n: statistics.median(ts) for n, ts in times.items()}
    device = torch.cuda.get_device_name()
    result = {
        "config": name, "kernels": kernels, "compile": compiled, "cuda_graphs": graphs,
        "step_s": round(statistics.mean(per_n.values()), 4),  # mean over the uniform recycling draw
        "step_s_by_recycling": {n: round(t, 4) for n, t in per_n.items()}, "setup_s": round(setup_s, 1),
        "peak_flops": peak_flops(device, args.precision),  # MFU: added by run_all from the FLOP count
        "peak_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved(),
        "device": device,
    }  # fmt: skip
    if report is not None:
        stats = report.stats()
        result.update(graph_breaks=stats["graph_breaks"], recompiles=stats["recompiles"])
    if args.out:  # where the step's time goes: one step without recycling passes (the grad pass), profiled
        t0 = time.perf_counter()
        summary = profile_step(step, 0, args.out, name, forward=forward, keep_trace=args.keep_trace)
        result["profile"] = {k: summary[k] for k in ("wall_s", "kernel_s", "busy_fraction", "kernels_per_step",
                                                      "launches_per_step")}  # fmt: skip
        result["profile_s"] = round(time.perf_counter() - t0, 1)
    return result


def run_child(name: str, args: argparse.Namespace) -> int:
    """``--child NAME``: one configuration; its row is the line ``ROW {json}``."""
    from scalefold.compilation.cache import configure_compile_cache

    cache = configure_compile_cache(args.compile_cache)  # before anything compiles (Triton kernels, inductor)
    print(f"{name}: {cache.describe()}", flush=True)
    kept: dict = {}
    try:
        row = run_config(name, args, keep=kept)
    except Exception as exc:  # noqa: BLE001 -- reported as the configuration's row
        row = {"config": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    row["compile_cache_warm"] = cache.warm
    print("ROW " + json.dumps(row), flush=True)
    if args.memory_snapshot and "run_step" in kept:  # after the row: whatever the trace costs, the figures stand
        try:
            trace_step(name, kept["run_step"], Path(args.memory_snapshot))
        except Exception as exc:  # noqa: BLE001 -- the figures above stand without it
            print(f"{name}: no allocator trace: {type(exc).__name__}: {exc}", flush=True)
    return 0 if "error" not in row else 1


def trace_step(name: str, run_step, folder: Path) -> None:
    """The allocator's trace of one more step with the memory model's recycling count (1), after the timed
    ones: the trace's window holds the whole step (the warm-up's four steps outgrow ``max_entries`` at MLPerf
    shapes and lose their start). Writes ``<name>_memory_peak.json`` (what is live at the peak by allocating
    line), prints it, then the trace itself, ``<name>_memory.pickle.gz``."""
    import torch

    from scalefold.perf import cuda_snapshot

    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    cuda_snapshot.record_history()
    run_step(1)
    torch.cuda.synchronize()
    snap = cuda_snapshot.take_snapshot()
    report = cuda_snapshot.peak_allocations(snap)
    report.allocated_at_start = allocated_before
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}_memory_peak.json").write_text(json.dumps(asdict(report)))
    print(f"{name}: {cuda_snapshot.format_peak(report)}", flush=True)  # first: the dump may meet the cap
    path = cuda_snapshot.dump_snapshot(snap, folder / f"{name}_memory.pickle.gz")
    print(f"{name}: allocator trace in {path}", flush=True)


def child_command(name: str, args: argparse.Namespace, snapshot: bool) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--preset", args.preset, "--precision",
           args.precision, "--cycles", str(args.cycles)]  # fmt: skip
    for flag, value in (("--out", args.out), ("--compile-cache", args.compile_cache),
                        ("--activation-checkpointing", args.activation_checkpointing),
                        ("--memory-snapshot", args.memory_snapshot if snapshot else None)):  # fmt: skip
        if value:
            cmd += [flag, str(value)]
    return cmd + (["--keep-trace"] if args.keep_trace else [])


def run_capped(cmd: list[str], cap: float) -> tuple[dict | None, str]:
    """Run a child, its output passed through; ``(row, status)``: killed at ``cap`` seconds (SIGINT, then
    SIGKILL 10 s later), so one slow configuration cannot starve the rest."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    row, deadline = None, time.monotonic() + cap
    killer = threading.Timer(cap, lambda: _stop(proc))
    killer.start()
    try:
        for line in proc.stdout:
            if line.startswith("ROW "):
                row = json.loads(line[4:])
            else:
                print(line, end="", flush=True)
        proc.wait()
    finally:
        killer.cancel()
    if row is not None:
        return row, "ok"
    return None, "cap reached" if time.monotonic() >= deadline - 1 else f"exit {proc.returncode}"


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--preset", default="mlperf")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--cycles", type=int, default=1, help="timed cycles of recycling counts 0..R-1 (default 1)")
    ap.add_argument("--no-estimate", action="store_true", help="skip the memory-model comparison")
    ap.add_argument("--activation-checkpointing", help="recompute policy on|off|N (default: the preset's); the "
                    "memory model and the FLOP count use it too")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the plan with expected seconds (no CUDA needed)")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds for all configurations (default 480)")
    ap.add_argument("--out", help="folder for each configuration's profile (<config>_profile.json / .png)")
    ap.add_argument("--keep-trace", action="store_true", help="also keep the Chrome traces (<config>_trace.json.gz)")
    ap.add_argument("--compile-cache", default=os.environ.get("SCALEFOLD_COMPILE_CACHE"),
                    help="persistent inductor/Triton cache (default $SCALEFOLD_COMPILE_CACHE, else ~/.cache/scalefold/compile)")
    ap.add_argument("--memory-snapshot", metavar="DIR", help="record the allocator's trace of one more step of the "
                    "first configuration after its warm-up, write it to DIR/<config>_memory.pickle.gz, print what is "
                    "live at its peak by allocating line (scalefold.perf.cuda_snapshot) and, at the end, that against "
                    "the memory model's sites (DIR/<config>_memory_compare.json; scalefold.perf.memory_sites)")  # fmt: skip
    ap.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args.child, args)
    if args.dry_run:
        print("\n".join(plan(args)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/step_headline.py: needs CUDA (the headline is a GPU figure); no CUDA device here -- nothing "
              "measured (--dry-run prints the plan)", file=sys.stderr)  # fmt: skip
        return 2
    return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    estimates = {} if args.no_estimate else {**estimate_commands(args), "flops": flops_command(args)}
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
             for k, cmd in estimates.items()}
    rows: list[dict] = []
    predicted: dict[str, dict] = {}
    for i, name in enumerate(args.configs):
        left = args.deadline - (time.monotonic() - t_start)
        traced = bool(args.memory_snapshot) and i == 0
        cap = min(CONFIGS[name][4] + (TRACE_S[1] if traced else 0), left - 5)
        if cap < 20:
            row = {"config": name, "error": f"skipped: {left:.0f} s left of the {args.deadline:.0f} s deadline"}
        else:
            print(f"=== {name} (cap {cap:.0f} s)", flush=True)
            row, status = run_capped(child_command(name, args, snapshot=traced), cap)
            row = row or {"config": name, "error": f"no result: {status} (cap {cap:.0f} s)"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        _collect(procs, predicted, wait=False, save_dir=args.memory_snapshot)
    _collect(procs, predicted, wait=True, save_dir=args.memory_snapshot)
    if args.memory_snapshot:
        compare_memory(args, rows, predicted)
    flops = flops_by_recycling(predicted.pop("flops", None))
    for row in rows:
        if "step_s_by_recycling" in row:
            per_n = {int(n): t for n, t in row["step_s_by_recycling"].items()}
            row["mfu"] = mfu(per_n, flops, row.get("peak_flops"))
    print("\n" + format_table(rows, predicted))
    print(json.dumps({"rows": rows, "predicted": {k: {"peak_bytes": v["peak_bytes"], "step_peak_bytes": v["step_peak_bytes"]}
                                                  for k, v in predicted.items()}}))  # fmt: skip
    return 0 if all("error" not in r for r in rows) else 1


def _collect(procs: dict, predicted: dict, wait: bool, save_dir: str | None = None) -> None:
    """Print each memory-model prediction as soon as it is in (a time limit that cuts the run keeps it); with
    ``save_dir`` also write the ones with allocating sites there, ``memory_model_<kernels>.json``."""
    for kernels, proc in list(procs.items()):
        if not wait and proc.poll() is None:
            continue
        del procs[kernels]
        try:
            out, _ = proc.communicate(timeout=60)
            predicted[kernels] = json.loads(out)
            if save_dir and predicted[kernels].get("sites"):  # the comparison can be redone from the files alone
                Path(save_dir).mkdir(parents=True, exist_ok=True)
                (Path(save_dir) / f"memory_model_{kernels}.json").write_text(out)
            keep = ("model_flops",) if kernels == "flops" else ("peak_bytes", "step_peak_bytes")
            print(json.dumps({"memory_model": kernels, **{k: predicted[kernels][k] for k in keep}}), flush=True)
        except Exception as exc:  # noqa: BLE001
            proc.kill()
            print(f"memory model ({kernels}) gave no result: {type(exc).__name__}", flush=True)


def compare_memory(args: argparse.Namespace, rows: list[dict], predicted: dict) -> None:
    """The traced configuration's peak by allocating line against the memory model's (``--sites``), as a
    table and as ``DIR/<config>_memory_compare.json`` (:mod:`scalefold.perf.memory_sites`)."""
    from scalefold.perf.memory_sites import compare, format_comparison, read_peak

    name, kernels = args.configs[0], traced_kernels(args)
    peak_file = Path(args.memory_snapshot) / f"{name}_memory_peak.json"
    est = predicted.get(kernels) or {}
    if not est.get("sites") or not peak_file.exists():
        print(f"memory comparison ({name}): no {'model sites' if not est.get('sites') else peak_file}", flush=True)
        return
    try:
        report = read_peak(str(peak_file))
    except ValueError as exc:
        print(f"memory comparison ({name}): {exc}", flush=True)
        return
    sites = dict(est["sites"])
    row = next((r for r in rows if r.get("config") == name), {})
    if row.get("cuda_graphs") and est.get("cuda_graph_pool_bytes"):  # the graphs' pool: the model has no site for it
        sites["(CUDA-graph pool, model)"] = {"bytes": est["cuda_graph_pool_bytes"], "count": 1}
    cmp = compare(report, sites, extra={"config": name, "settings": est.get("settings", {}),
                                        "max_memory_allocated": row.get("peak_bytes")})  # fmt: skip
    out = Path(args.memory_snapshot) / f"{name}_memory_compare.json"
    out.write_text(json.dumps(cmp.to_json(), indent=1))
    print(f"\n=== memory: {name} predicted (memory model, {kernels} kernels) vs measured (allocator trace) by "
          f"allocating line; max_memory_allocated {row.get('peak_bytes', 0) / 2**30:.2f} GiB; JSON {out}\n"
          f"{format_comparison(cmp)}", flush=True)  # fmt: skip


def format_table(rows: list[dict], predicted: dict) -> str:
    """The headline table: s/step per recycling count and mean, speed-up, MFU, peak vs predicted, profile."""
    eager = next((r["step_s"] for r in rows if r.get("config") == "eager" and "step_s" in r), None)
    lines = [f"{'config':<8} {'s/step by recycling 0..R-1':<28} {'mean':>7} {'vs eager':>8} {'MFU':>6} {'peak GiB':>8} "
             f"{'model':>6} {'error':>7} {'busy':>5} {'launch/step':>11}  notes"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<8} {r['error']}")
            continue
        est = predicted.get(r["kernels"])
        pred = (est["peak_bytes"] if r["cuda_graphs"] else est["step_peak_bytes"]) if est else None
        by_n = "/".join(f"{t:.2f}" for t in r["step_s_by_recycling"].values())
        prof = r.get("profile") or {}
        err = f"{100 * (pred / r['peak_bytes'] - 1):+.1f}%" if pred else "-"
        notes = f"setup {r['setup_s']} s" + (f", breaks {r.get('graph_breaks')}, recompiles {r.get('recompiles')}"
                                             if r["compile"] else "")  # fmt: skip
        ratio = f"{eager / r['step_s']:.2f}x" if eager else "-"
        util = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
        model = f"{pred / 2**30:.2f}" if pred else "-"
        lines.append(f"{r['config']:<8} {by_n:<28} {r['step_s']:>7.3f} {ratio:>8} {util:>6} {r['peak_bytes'] / 2**30:>8.2f} "
                     f"{model:>6} {err:>7} {prof.get('busy_fraction') or '-':>5} {prof.get('launches_per_step') or '-':>11}  "
                     f"{notes}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
