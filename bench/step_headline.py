"""The headline GPU figure: the full training step at MLPerf shapes, five ways, with peak memory.

The training step of ``scalefold train --preset mlperf --precision bf16`` (crop 256, 124 MSA clusters,
1,024 extra MSA rows, 4 templates, activation checkpointing; recycling counts 0..3 in turn, the
uniform draw of training) timed as

    eager     PyTorch reference kernels, no compile, no CUDA graphs   (SCALEFOLD_KERNELS=torch)
    compile   + torch.compile of the Evoformer / extra-MSA / template blocks (compile_blocks)
    triton    the fused Triton kernels instead of the references       (SCALEFOLD_KERNELS=triton)
    graphs    CUDA graphs of the no-grad recycling passes (GraphedStep)
    all       Triton kernels + compile + CUDA graphs

each on a freshly built model (same seed), with ``torch.cuda.max_memory_allocated`` over the
configuration (model, optimizer, batch and steps) against the memory model's prediction
(``scalefold estimate-memory``, computed meanwhile on the host's CPUs in two subprocesses). One JSON
line per configuration as it finishes (a timeout keeps the finished ones), a table at the end.

    python bench/step_headline.py [--configs eager triton graphs compile all] [--cycles 1] [--dry-run]

Needs CUDA: elsewhere it says so and exits 2 (``--dry-run`` lists what it would run, anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {  # name -> (kernels, compile, cuda graphs); run in this order: the compiled ones last, since
    # inductor at MLPerf shapes took > 200 s on an H200 host (first GPU session) and a time limit then
    # keeps the rows already finished
    "eager": ("torch", False, False),
    "triton": ("triton", False, False),
    "graphs": ("torch", False, True),
    "compile": ("torch", True, False),
    "all": ("triton", True, True),
}


def estimate_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The memory-model runs whose predictions the configurations are compared with."""
    base = [sys.executable, "-m", "scalefold", "estimate-memory", "--preset", args.preset, "--precision",
            args.precision, "--json"]  # fmt: skip
    return {kernels: base + ["--kernels", kernels] for kernels in ("torch", "triton")}


def run_config(name: str, args: argparse.Namespace, after_warm_up=None) -> dict:
    import torch

    from scalefold.compilation.graphed_step import GraphedStep
    from scalefold.compilation.regions import compile_blocks
    from scalefold.config.training import TrainConfig
    from scalefold.train.step import TrainingStep

    kernels, compiled, graphs = CONFIGS[name]
    os.environ["SCALEFOLD_KERNELS"] = kernels
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    cfg = TrainConfig.from_preset(args.preset, overrides={"precision": args.precision, "cuda_graphs": "on" if graphs else "off"},
                                  env={})  # fmt: skip
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
    for n in counts:  # warm-up: compilation, autotuning, cuDNN/cuBLAS heuristics
        step.run(n, forward=forward)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t_build
    if after_warm_up is not None:  # e.g. stop the allocator trace: the timed steps run without it
        after_warm_up()
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.cycles):
        for n in counts:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step.run(n, forward=forward)
            torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t0)
    per_n = {n: statistics.median(ts) for n, ts in times.items()}
    result = {
        "config": name, "kernels": kernels, "compile": compiled, "cuda_graphs": graphs,
        "step_s": round(statistics.mean(per_n.values()), 4),  # mean over the uniform recycling draw
        "step_s_by_recycling": {n: round(t, 4) for n, t in per_n.items()}, "setup_s": round(setup_s, 1),
        "peak_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved(),
        "device": torch.cuda.get_device_name(),
    }  # fmt: skip
    if report is not None:
        stats = report.stats()
        result.update(graph_breaks=stats["graph_breaks"], recompiles=stats["recompiles"])
    del step, forward
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--preset", default="mlperf")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--cycles", type=int, default=1, help="timed cycles of recycling counts 0..R-1 (default 1)")
    ap.add_argument("--no-estimate", action="store_true", help="skip the memory-model comparison")
    ap.add_argument("--dry-run", action="store_true", help="list what would run (no CUDA needed)")
    ap.add_argument("--memory-snapshot", metavar="DIR", help="record the allocator's trace of the first "
                    "configuration, write it to DIR/<config>_memory.pickle.gz and print what is live at its peak, "
                    "by allocating line (scalefold.perf.cuda_snapshot)")  # fmt: skip
    args = ap.parse_args(argv)
    estimates = {} if args.no_estimate else estimate_commands(args)
    if args.dry_run:
        print(f"step_headline (dry run): preset {args.preset} {args.precision}, {args.cycles} timed cycle(s) of "
              "recycling counts 0..R-1 after one warm-up cycle, per configuration:")  # fmt: skip
        for name in args.configs:
            kernels, compiled, graphs = CONFIGS[name]
            print(f"  {name:<8} kernels={kernels} compile={compiled} cuda_graphs={graphs}  -> step_s, peak_bytes")
        for kernels, cmd in estimates.items():
            print(f"  memory model ({kernels} kernels, in the background): {' '.join(cmd[1:])}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/step_headline.py: needs CUDA (the headline is a GPU figure); no CUDA device here -- nothing "
              "measured (--dry-run lists what would run)", file=sys.stderr)  # fmt: skip
        return 2
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
             for k, cmd in estimates.items()}
    rows = []
    predicted: dict[str, dict] = {}

    def collect(wait: bool) -> None:
        """Print each memory-model prediction as soon as it is in (a time limit that cuts the run keeps it)."""
        for kernels, proc in list(procs.items()):
            if not wait and proc.poll() is None:
                continue
            del procs[kernels]
            try:
                out, _ = proc.communicate(timeout=60)
                predicted[kernels] = json.loads(out)
                keep = ("peak_bytes", "step_peak_bytes")
                print(json.dumps({"memory_model": kernels, **{k: predicted[kernels][k] for k in keep}}), flush=True)
            except Exception as exc:  # noqa: BLE001
                proc.kill()
                print(f"memory model ({kernels}) gave no result: {type(exc).__name__}", flush=True)

    snaps: list = []  # the first configuration's allocator trace, taken after its warm-up
    for i, name in enumerate(args.configs):
        snapshot = args.memory_snapshot and i == 0
        try:
            if snapshot:  # the warm-up (every recycling count, same shapes) is traced, the timed steps not
                from scalefold.perf import cuda_snapshot

                cuda_snapshot.record_history()
                row = run_config(name, args, after_warm_up=lambda: snaps.append(cuda_snapshot.take_snapshot()))
            else:
                row = run_config(name, args)
        except Exception as exc:  # noqa: BLE001 -- one configuration failing must not hide the others
            row = {"config": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        if snapshot:
            try:
                snap = snaps[0] if snaps else cuda_snapshot.take_snapshot()
                Path(args.memory_snapshot).mkdir(parents=True, exist_ok=True)
                path = cuda_snapshot.dump_snapshot(snap, Path(args.memory_snapshot) / f"{name}_memory.pickle.gz")
                print(f"{name}: allocator trace in {path}\n{cuda_snapshot.format_peak(cuda_snapshot.peak_allocations(snap))}",
                      flush=True)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 -- the figures above stand without it
                print(f"{name}: no allocator trace: {type(exc).__name__}: {exc}", flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        collect(wait=False)
    collect(wait=True)
    eager = next((r["step_s"] for r in rows if r.get("config") == "eager" and "step_s" in r), None)
    print(f"\n{'config':<8} {'s/step':>8} {'vs eager':>9} {'peak GiB':>9} {'predicted':>10} {'error':>7}  notes")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<8} {r['error']}")
            continue
        est = predicted.get(r["kernels"])
        pred = None
        if est:
            pred = est["peak_bytes"] if r["cuda_graphs"] else est["step_peak_bytes"]
        ratio = f"{eager / r['step_s']:.2f}x" if eager else "-"
        notes = f"breaks {r.get('graph_breaks')}, recompiles {r.get('recompiles')}" if r["compile"] else ""
        print(f"{r['config']:<8} {r['step_s']:>8.3f} {ratio:>9} {r['peak_bytes'] / 2**30:>9.2f} "
              f"{(pred or 0) / 2**30:>10.2f} {(100 * (pred / r['peak_bytes'] - 1)) if pred else float('nan'):>6.1f}%  {notes}")  # fmt: skip
    print(json.dumps({"rows": rows, "predicted": {k: {"peak_bytes": v["peak_bytes"], "step_peak_bytes": v["step_peak_bytes"]}
                                                  for k, v in predicted.items()}}))  # fmt: skip
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
