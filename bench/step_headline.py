"""The headline GPU figure: the full training step at MLPerf shapes, six ways, in one run.

The training step of ``scalefold train --preset mlperf --precision bf16`` (crop 256, 124 MSA clusters,
1,024 extra MSA rows, 4 templates, activation checkpointing; recycling counts 0..3 in turn, the
uniform draw of training) timed as

    eager        PyTorch reference kernels, no compile, no CUDA graphs   (SCALEFOLD_KERNELS=torch)
    graphs-step  whole-step CUDA graphs, PyTorch kernels  (--cuda-graphs step; this round's bar: <= 1.2 s/step, H100)
    all          Triton kernels + compile + whole-step CUDA graphs       (the product's figure)
    triton       the fused Triton kernels instead of the references       (SCALEFOLD_KERNELS=triton)
    graphs       CUDA graphs of the no-grad recycling passes (GraphedStep; --cuda-graphs recycling)
    compile      + torch.compile of the model's elementwise chains (compile_blocks' default region)

in that order, the order of their value (``bench/headline_plan.py``: the plan, expected seconds per card),
each in a process of its own (a fresh model, same seed) killed at its cap, each started only when the time
left before ``--deadline`` covers its expected seconds on the card in hand (after eager: from eager's
measured step; a whole-step configuration's captures counted from the capture code, and its row reshaped to
fewer recycling counts where all of them would not fit: ``headline_plan.fit_counts``); what is skipped is
said, with why. On the CPU rehearsal ``graphs-step`` runs the emulated capture. Per configuration, printed and written
(``--out``/rows.jsonl) the moment they exist, before its profile: s/step per recycling count and their
mean, MFU (model FLOPs from ``scalefold estimate-step`` over the device's dense peak), the step-time model's
prediction beside it (``estimate-step``'s ``predicted_s`` for the card in hand: eager for the rows without
whole-step graphs, graphed for graphs-step / all; the miss in %), and
``torch.cuda.max_memory_allocated`` (against ``scalefold estimate-memory`` in the table). Then the extras a
cap may cut without losing the row: a ``torch.profiler`` profile of one step (``<config>_profile.json`` /
``.png``; :mod:`scalefold.perf.profile_summary`) and, for the first configuration, the allocator trace of one
more step (``--memory-snapshot``). The CPU estimates run meanwhile, each with its own cap
(``--estimate-cap``), their output and errors in ``--out``/estimates/; the table never waits past the
deadline (a late estimate is reported late). ``--estimate-reuse DIR`` keeps answers between runs (or
carries them from a CPU machine). Inductor's and Triton's caches go to ``--compile-cache``.

    python bench/step_headline.py [--configs ...] [--cycles 1] [--out DIR] [--dry-run --card h100|h200]
    python bench/step_headline.py --device cpu --preset tiny --precision fp32   # the CPU rehearsal

Needs CUDA (``--device cpu``: the rehearsal, where what needs CUDA is skipped with its reason): elsewhere it
says so and exits 2 (``--dry-run`` prints the plan with expected seconds, anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import headline_plan as hp  # noqa: E402
from headline_procs import Estimates, faults, run_capped  # noqa: E402

CONFIGS = hp.CONFIGS


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


def predicted_mode(name: str) -> str:
    """Which of ``predicted_s``'s modes a configuration is measured against: ``graphed`` where every launch of the
    step is replayed (whole-step graphs: graphs-step, all), ``eager`` otherwise (the recycling-only ``graphs``
    too: its grad pass, most of the step, is issued eagerly)."""
    return "graphed" if CONFIGS[name].graphs == "step" else "eager"


def predicted_step_s(estimate: dict | None, card: str | None, mode: str = "eager") -> float | None:
    """The step-time model's mean step seconds from ``estimate-step``'s JSON: ``predicted_s`` is
    ``{card: {"eager": {"0": s, ..., "mean": s}, "graphed": {...}}}`` with ``card`` a
    :data:`scalefold.perf.devices.DEVICES` key (a bare number or ``{card: number}`` taken as is); None quietly
    where it has none (no estimate, a card it does not predict for)."""
    value = (estimate or {}).get("predicted_s")
    if isinstance(value, dict):
        value = value.get(card or "")
    if isinstance(value, dict):
        value = value.get(mode)
    if isinstance(value, dict):
        value = value.get("mean")
    return float(value) if isinstance(value, (int, float)) else None


def set_predicted(row: dict, estimate: dict | None, card: str | None) -> None:
    """The row's ``predicted_s`` / ``predicted_mode`` (the mode its configuration is measured against)."""
    mode = predicted_mode(row["config"]) if row.get("config") in CONFIGS else "eager"
    row["predicted_s"], row["predicted_mode"] = predicted_step_s(estimate, card, mode), mode


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
    """The dry run's lines: each configuration in priority order with its expected seconds and cap on
    ``--card``, what the deadline skips, the estimates, the total."""
    card = hp.card_key(args.card)
    trace = bool(args.memory_snapshot)
    lines = [f"step_headline (plan): preset {args.preset} {args.precision} on {args.card} (eager step ~"
             f"{hp.eager_step_s(card):.2f} s); per configuration a process of its own (model, batch, one warm-up "
             f"cycle of recycling counts 0..R-1, {args.cycles} timed cycle(s); its row printed then; one profiled "
             f"step), started only if its expected seconds fit the time left; deadline {args.deadline:.0f} s"]  # fmt: skip
    body, total = hp.plan_lines(card, args.configs, args.cycles, args.deadline, trace, rehearsal=args.device != "cuda")
    lines += body
    for key, cmd in ({} if args.no_estimate else {**estimate_commands(args), "flops": flops_command(args)}).items():
        lines.append(f"  estimate {key} (on the CPUs meanwhile, cap {args.estimate_cap or args.deadline:.0f} s): "
                     f"{' '.join(cmd[1:])}")  # fmt: skip
    if trace and args.configs:
        lines.append(f"  allocator trace of one more {args.configs[0]} step after its row and profile (in its expected "
                     f"seconds: ~{hp.TRACE_S[0]} s, cap +{hp.TRACE_S[1]} s): {args.memory_snapshot}/<config>_memory.pickle.gz")  # fmt: skip
    lines.append(f"  total expected ~{total:.0f} s of the {args.deadline:.0f} s deadline; compile cache "
                 f"{args.compile_cache or '(default)'}")  # fmt: skip
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
    return CONFIGS[args.configs[0]].kernels if args.memory_snapshot and args.configs else None


def build_config(name: str, args: argparse.Namespace):
    """Build ``name``'s step on ``args.device``: ``(step, forward, compile report, what ran)`` -- the last, for
    whole-step graphs, says whether they were replayed (or emulated on a CPU) or the capture fell back to
    eager, and why; warm-up not yet run."""
    import torch

    from scalefold.compilation.graphed_step import GraphedStep
    from scalefold.compilation.regions import compile_blocks
    from scalefold.config.training import TrainConfig
    from scalefold.train.step import TrainingStep

    if name in faults("raise"):
        raise RuntimeError(f"rehearsed fault ({name}): this configuration raises before its build")
    cfg = CONFIGS[name]
    os.environ["SCALEFOLD_KERNELS"] = cfg.kernels
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    overrides = {"precision": args.precision, "cuda_graphs": cfg.graphs or "off"}
    if args.activation_checkpointing:
        overrides["activation_checkpointing"] = args.activation_checkpointing
    step = TrainingStep.build(TrainConfig.from_preset(args.preset, overrides=overrides, env={}), args.device)
    report = compile_blocks(step.model, backend="inductor", loss_fn=step.loss_fn) if cfg.compiled else None
    forward, ran = None, None
    if cfg.graphs == "step":  # captured per recycling count; step.run replays them (forward stays None)
        whole = step.use_whole_step_graphs(counts=getattr(args, "counts", None))
        # a capture that falls back is still measured (eager), its row labelled with what ran and why
        ran = (("whole-step graphs, emulated on the CPU" if whole.emulated else "whole-step graphs") if whole.active
               else f"eager: the whole-step capture fell back ({whole.reason})")  # fmt: skip
    elif cfg.graphs:
        graphed = GraphedStep(step.model, enabled=True, log=None)
        graphed.warm_up(step.batch, autocast=step.autocast)
        if not graphed.active:
            raise RuntimeError(f"CUDA graphs off: {graphed.reason}")
        forward = graphed
    return step, forward, report, ran


def measure(name: str, args: argparse.Namespace) -> tuple[dict, object, object]:
    """Build, warm up (compilation, capture), time ``args.cycles`` cycles: ``(row, step, forward)``."""
    import torch

    from scalefold.compilation.cache import compile_with_rebuild

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_build = time.perf_counter()
    step, forward, report, ran = build_config(name, args)
    counts = getattr(args, "counts", None) or list(range(step.num_ensembles))  # the plan's reshaped row, or all

    # compilation, cuDNN/cuBLAS heuristics (no autotuning: SCALEFOLD_AUTOTUNE=0); whole-step graphs: the first
    # step after the capture is eager (SWA's first copy), absorbed here
    def warm_up_cycle() -> None:
        for n in counts:
            step.run(n, forward=forward)

    compile_with_rebuild(warm_up_cycle)  # a corrupt compile cache: emptied with one line, compiled again
    sync()
    setup_s = time.perf_counter() - t_build
    if report is not None:
        report.mark_warm()
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.cycles):
        for n in counts:
            sync()
            t0 = time.perf_counter()
            step.run(n, forward=forward)
            sync()
            times[n].append(time.perf_counter() - t0)
    per_n = {n: statistics.median(ts) for n, ts in times.items()}
    device = torch.cuda.get_device_name() if cuda else "cpu"
    cfg = CONFIGS[name]
    row = {
        "config": name, "kernels": cfg.kernels, "compile": cfg.compiled, "cuda_graphs": cfg.graphs or False,
        "step_s": round(statistics.mean(per_n.values()), 4),  # mean over the uniform recycling draw
        "step_s_by_recycling": {n: round(t, 4) for n, t in per_n.items()}, "setup_s": round(setup_s, 1),
        "peak_flops": peak_flops(device, args.precision) if cuda else None,  # MFU: added by the parent
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None, "device": device,
    }  # fmt: skip
    if cfg.graphs == "step":
        row["graphs_captured"] = step.graphs.captured() if step.graphs is not None else []
        row["ran"] = ran
        row["cuda_graphs"] = "step" if step.graphs is not None else False  # a fallback ran eagerly
    if report is not None:
        stats = report.stats()
        row.update(graph_breaks=stats["graph_breaks"], recompiles=stats["recompiles"])
    return row, step, forward


def run_child(name: str, args: argparse.Namespace) -> int:
    """``--child NAME``: one configuration; its row is the line ``ROW {json}``, printed as soon as it is
    measured; then the extras (``EXTRA {json}``): the profile, the allocator trace, each skipped when the
    cap (``--child-cap``) has no room left for it."""
    from scalefold.compilation.cache import configure_compile_cache

    t_end = time.monotonic() + (args.child_cap or 1e9)
    cache = configure_compile_cache(args.compile_cache)  # before anything compiles (Triton kernels, inductor)
    print(f"{name}: {cache.describe()}", flush=True)
    try:
        row, step, forward = measure(name, args)
    except Exception as exc:  # noqa: BLE001 -- reported as the configuration's row
        row, step = {"config": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}, None
    row["compile_cache_warm"] = cache.warm
    print("ROW " + json.dumps(row), flush=True)
    if step is None:
        return 1
    if args.out:
        extra(name, "profile", t_end, lambda: profile(name, step, forward, args))
    if args.memory_snapshot:
        if args.device != "cuda":
            print("EXTRA " + json.dumps({"trace": "skipped: needs CUDA (the allocator trace is CUDA's)"}), flush=True)
        else:
            extra(name, "trace", t_end, lambda: trace_step(name, step, forward, Path(args.memory_snapshot)))
    return 0


def extra(name: str, what: str, t_end: float, fn) -> None:
    """Run one extra (``fn() -> dict``) if its cap leaves room; print ``EXTRA {json}`` with what it gave or why not."""
    left = t_end - time.monotonic()
    if left < 10:
        print("EXTRA " + json.dumps({what: f"skipped: {left:.0f} s left of the cap"}), flush=True)
        return
    if what == "profile" and name in faults("hang-profile"):
        print(f"{name}: profiling (rehearsed fault: hangs here until its cap)", flush=True)
        time.sleep(3600)
    try:
        print("EXTRA " + json.dumps(fn()), flush=True)
    except Exception as exc:  # noqa: BLE001 -- the row stands without it
        print("EXTRA " + json.dumps({what: f"failed: {type(exc).__name__}: {exc}"[:300]}), flush=True)


def profile(name: str, step, forward, args: argparse.Namespace) -> dict:
    """Where the step's time goes: one step without recycling passes (the grad pass), profiled."""
    from scalefold.perf.profile_summary import profile_step

    t0 = time.perf_counter()
    summary = profile_step(step, 0, args.out, name, forward=forward, keep_trace=args.keep_trace)
    keys = ("wall_s", "kernel_s", "busy_fraction", "kernels_per_step", "launches_per_step")
    return {"profile": {k: summary.get(k) for k in keys}, "profile_s": round(time.perf_counter() - t0, 1)}


def trace_step(name: str, step, forward, folder: Path) -> dict:
    """The allocator's trace of one more step with the memory model's recycling count (1), after the timed
    ones: the trace's window holds the whole step (the warm-up's four steps outgrow ``max_entries`` at MLPerf
    shapes and lose their start). Writes ``<name>_memory_peak.json`` (what is live at the peak by allocating
    line), prints it, then the trace itself, ``<name>_memory.pickle.gz``."""
    import torch

    from scalefold.perf import cuda_snapshot

    t0 = time.perf_counter()
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    cuda_snapshot.record_history()
    step.run(min(1, step.num_ensembles - 1), forward=forward)
    torch.cuda.synchronize()
    snap = cuda_snapshot.take_snapshot()
    report = cuda_snapshot.peak_allocations(snap)
    report.allocated_at_start = allocated_before
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}_memory_peak.json").write_text(json.dumps(asdict(report)))
    print(f"{name}: {cuda_snapshot.format_peak(report)}", flush=True)  # first: the dump may meet the cap
    path = cuda_snapshot.dump_snapshot(snap, folder / f"{name}_memory.pickle.gz")
    print(f"{name}: allocator trace in {path}", flush=True)
    return {"trace": str(path), "trace_s": round(time.perf_counter() - t0, 1)}


def child_command(name: str, args: argparse.Namespace, snapshot: bool, cap: float | None = None,
                  counts: list[int] | None = None) -> list[str]:  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--preset", args.preset, "--precision",
           args.precision, "--cycles", str(args.cycles), "--device", args.device]  # fmt: skip
    if counts is not None:
        cmd += ["--counts", *map(str, counts)]
    for flag, value in (("--out", args.out), ("--compile-cache", args.compile_cache),
                        ("--activation-checkpointing", args.activation_checkpointing),
                        ("--memory-snapshot", args.memory_snapshot if snapshot else None),
                        ("--child-cap", f"{cap:.0f}" if cap else None)):  # fmt: skip
        if value:
            cmd += [flag, str(value)]
    return cmd + (["--keep-trace"] if args.keep_trace else [])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                    help="which configurations (always run in priority order: " + ", ".join(hp.PRIORITY) + ")")
    ap.add_argument("--preset", default="mlperf")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the rehearsal (what needs CUDA is skipped)")
    ap.add_argument("--card", default=os.environ.get("CARD", "h100"), help="--dry-run: the card to plan for (h100, h200)")
    ap.add_argument("--cycles", type=int, default=1, help="timed cycles of recycling counts 0..R-1 (default 1)")
    ap.add_argument("--no-estimate", action="store_true", help="skip the memory model and the FLOP count")
    ap.add_argument("--estimate-cap", type=float, help="seconds each CPU estimate may take (default: the deadline)")
    ap.add_argument("--estimate-reuse", metavar="DIR", help="keep the estimates' answers in DIR and reuse a matching one")
    ap.add_argument("--estimates-only", action="store_true", help="compute the estimates into --estimate-reuse and "
                    "stop (on a CPU machine, before a window: carry DIR; no CUDA needed)")  # fmt: skip
    ap.add_argument("--activation-checkpointing", help="recompute policy on|off|N (default: the preset's); the "
                    "memory model and the FLOP count use it too")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the plan with expected seconds (no CUDA needed)")
    ap.add_argument("--deadline", type=float, default=465.0, help="seconds for everything (default 465)")
    ap.add_argument("--out", help="folder for rows.jsonl, headline.json, estimates/ and the profiles")
    ap.add_argument("--keep-trace", action="store_true", help="also keep the Chrome traces (<config>_trace.json.gz)")
    ap.add_argument("--compile-cache", default=os.environ.get("SCALEFOLD_COMPILE_CACHE"),
                    help="persistent inductor/Triton cache (default $SCALEFOLD_COMPILE_CACHE, else ~/.cache/scalefold/compile)")
    ap.add_argument("--memory-snapshot", metavar="DIR", help="record the allocator's trace of one more step of the "
                    "first configuration after its row and profile, write it to DIR/<config>_memory.pickle.gz, print "
                    "what is live at its peak by allocating line (scalefold.perf.cuda_snapshot) and, at the end, that "
                    "against the memory model's sites (DIR/<config>_memory_compare.json; scalefold.perf.memory_sites)")  # fmt: skip
    ap.add_argument("--counts", type=int, nargs="+", help=argparse.SUPPRESS)  # the child's recycling counts (plan)
    ap.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--child-cap", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.configs = [n for n in hp.PRIORITY if n in args.configs]
    if hp.card_key(args.card) is None:
        ap.exit(3, f"step_headline: unknown --card {args.card!r} (h100, h200 or a scalefold.perf.devices key)\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, args)
    if args.dry_run:
        print("\n".join(plan(args)))
        return 0
    if args.estimates_only:
        return estimates_only(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/step_headline.py: needs CUDA (the headline is a GPU figure); no CUDA device here -- nothing "
              "measured (--dry-run prints the plan; --device cpu rehearses it)", file=sys.stderr)  # fmt: skip
        return 2
    return run_all(args)


def estimates_only(args: argparse.Namespace) -> int:
    """``--estimates-only``: run the estimates (each capped by ``--estimate-cap``, default 1 hour) into
    ``--estimate-reuse``, where the headline's next run -- on a GPU machine, the folder carried -- takes them.
    The same options as that run make the same commands (``--memory-snapshot ANY``: the headline's, whose traced
    kernels' estimate lists its allocating sites)."""
    if not args.estimate_reuse:
        print("step_headline: --estimates-only needs --estimate-reuse DIR (where the answers go)", file=sys.stderr)
        return 3
    reuse = Path(args.estimate_reuse)
    est = Estimates({**estimate_commands(args), "flops": flops_command(args)}, reuse / "runs", cap=args.estimate_cap or 3600,
                    reuse=reuse)  # fmt: skip
    est.poll(until=time.monotonic() + (args.estimate_cap or 3600))
    for key, why in est.late.items():
        print(f"estimate {key}: {why}", file=sys.stderr)
    return 0 if not est.late else 1


def run_all(args: argparse.Namespace) -> int:
    """Every configuration in priority order, each only if its expected seconds fit; then the table."""
    import torch

    t_start = time.monotonic()
    cuda = args.device == "cuda"
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    card = hp.card_key(device_name) if cuda else None
    out = Path(args.out) if args.out else None
    folder = (out or Path(os.environ.get("TMPDIR", "/tmp")) / f"step_headline.{os.getpid()}") / "estimates"
    est = None if args.no_estimate else Estimates({**estimate_commands(args), "flops": flops_command(args)}, folder,
                                                  cap=args.estimate_cap or args.deadline,
                                                  reuse=Path(args.estimate_reuse) if args.estimate_reuse else None)  # fmt: skip
    print(f"=== headline on {device_name} (plan: {card or ('the CPU rehearsal' if not cuda else 'unknown card, H100 figures')}); "
          f"order {', '.join(args.configs)}; deadline {args.deadline:.0f} s", flush=True)  # fmt: skip
    rows: list[dict] = []
    measured, seen = None, set()

    def emit(row: dict) -> None:
        publish(row, est, card, out, first=row["config"] not in seen)
        seen.add(row["config"])

    for i, name in enumerate(args.configs):
        left = args.deadline - (time.monotonic() - t_start)
        row = run_one(name, args, card, measured, left, traced=bool(args.memory_snapshot) and i == 0 and cuda,
                      publish=emit)  # fmt: skip
        rows.append(row)
        if name not in seen or any(k in row for k in ("profile", "trace", "cut")):
            emit(row)  # a row the child never printed, or what its extras added
        if name == "eager" and "step_s" in row:
            measured = row["step_s"]  # the last measured row: the rest's expected seconds on this card
        late_mfu(rows, est, card, out)
    results = est.poll(until=t_start + args.deadline - 2) if est else {}
    if est:
        est.stop()
    return finish(args, rows, results, est.late if est else {}, card, out)


def late_mfu(rows: list[dict], est: Estimates | None, card: str | None, out: Path | None) -> None:
    """MFU of the rows measured before the FLOP count came in, printed (and written) once it is in."""
    if est is None or "flops" not in est.poll():
        return
    for row in rows:
        if "step_s" in row and row.get("peak_flops") and row.get("mfu") is None:
            publish(row, est, card, out, first=False)
            print(f"--- {row['config']}: MFU {row['mfu']} (the FLOP count came in after its row)", flush=True)


def run_one(name: str, args: argparse.Namespace, card: str | None, measured: float | None, left: float,
            traced: bool, publish) -> dict:  # fmt: skip
    """One configuration: skipped (needs CUDA, or its expected seconds do not fit ``left``) or run capped."""
    rehearsal = args.device != "cuda"
    why = CONFIGS[name].needs_cuda() if rehearsal else None
    if why:
        return {"config": name, "skipped": why}
    counts, expected, why = hp.fit_counts(name, card, left, args.cycles, rehearsal, measured, traced)
    if counts is None:
        return {"config": name, "skipped": why}
    scale = float(os.environ.get("SCALEFOLD_HEADLINE_CAP_SCALE", "1") or 1)
    cap = min(hp.cap_s(expected, traced, scale), left - hp.RESERVE_S)
    print(f"=== {name} (expected ~{expected:.0f} s, cap {cap:.0f} s, {left:.0f} s left{'; ' + why if why else ''})", flush=True)
    reshaped = counts if why else None  # the child's default: every recycling count
    row, status = run_capped(child_command(name, args, traced, cap, reshaped), cap, on_row=publish)
    row = row or {"config": name, "error": f"no result: {status} (cap {cap:.0f} s)"}
    if why and "step_s_by_recycling" in row:
        row["reshaped"] = why
        full = hp.REHEARSAL["recycling"] if rehearsal else 4
        row["step_s_all_counts_est"] = all_counts_estimate(row["step_s_by_recycling"], full)
    if status != "ok" and "error" not in row:
        row["cut"] = f"cap {cap:.0f} s reached after the row: extras cut"
    return row


def publish(row: dict, est: Estimates | None, card: str | None, out: Path | None, first: bool = True) -> None:
    """Print a row the moment it exists (with MFU where the FLOP count is in; ``first``: with a line for people
    too) and append it to rows.jsonl (a later line of the same configuration: what its extras added)."""
    results = est.poll() if est else {}
    if "step_s_by_recycling" in row:
        per_n = {int(n): t for n, t in row["step_s_by_recycling"].items()}
        row["mfu"] = mfu(per_n, flops_by_recycling(results.get("flops")), row.get("peak_flops"))
        set_predicted(row, results.get("flops"), card)
    if "step_s_by_recycling" in row and first:
        peak = f"{row['peak_bytes'] / 2**30:.2f} GiB" if row.get("peak_bytes") else "- (no CUDA)"
        print(f"--- {row['config']}: {row['step_s']:.3f} s/step (recycling 0..{len(per_n) - 1}: "
              f"{'/'.join(f'{t:.2f}' for t in per_n.values())}), MFU {row['mfu'] if row['mfu'] is not None else '-'}, "
              f"peak {peak}" + (f", {predicted_note(row)}" if row.get("predicted_s") else ""), flush=True)  # fmt: skip
    print(json.dumps(row), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "rows.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")


def finish(args: argparse.Namespace, rows: list[dict], results: dict, late: dict, card: str | None,
           out: Path | None) -> int:  # fmt: skip
    """MFU from the FLOP count (where it came in time), the memory comparison, the table, headline.json."""
    flops = flops_by_recycling(results.get("flops"))
    for row in rows:
        if "step_s_by_recycling" in row:
            per_n = {int(n): t for n, t in row["step_s_by_recycling"].items()}
            row["mfu"] = mfu(per_n, flops, row.get("peak_flops"))
            set_predicted(row, results.get("flops"), card)
    predicted = {k: v for k, v in results.items() if k != "flops"}
    if args.memory_snapshot and args.device == "cuda":
        compare_memory(args, rows, predicted)
    summary = {"rows": rows, "late_estimates": late,
               "predicted": {k: {"peak_bytes": v.get("peak_bytes"), "step_peak_bytes": v.get("step_peak_bytes")}
                             for k, v in predicted.items()}}  # fmt: skip
    print(json.dumps(summary), flush=True)
    if out is not None:
        (out / "headline.json").write_text(json.dumps(summary, indent=1))
    print("\n" + format_table(rows, predicted))
    for key, why in late.items():
        print(f"estimate {key}: {why}" + (" -- MFU left out" if key == "flops" else " -- its prediction left out"))
    measured = [f"{r['config']} {r['step_s']:.3f} s" for r in rows if "step_s" in r]
    failed = [r["config"] for r in rows if "error" in r]
    print(f"step_headline: measured {', '.join(measured) or 'nothing'}; skipped "
          f"{', '.join(r['config'] for r in rows if 'skipped' in r) or 'none'}; failed {', '.join(failed) or 'none'}"
          + (f"; late estimates {', '.join(late)}" if late else ""), flush=True)  # fmt: skip
    return 0 if not failed else 1

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


def predicted_note(row: dict) -> str:
    """The step-time model beside a measured row: ``step model <mode> P s, miss +M%`` (measured over predicted - 1)."""
    pred, mode = row["predicted_s"], row.get("predicted_mode") or "eager"
    return f"step model {mode} {pred:.2f} s, miss {100 * (row['step_s'] / pred - 1):+.0f}%"


def all_counts_estimate(by_n: dict, recycling: int) -> float:
    """A reshaped row's mean step over every recycling count 0..``recycling``-1, estimated from the counts it timed
    by their kernel-launch shares (``headline_plan.count_step_s``): for the bar, which is the uniform draw's mean."""
    timed = {int(n): t for n, t in by_n.items()}
    share = sum(hp.count_step_s(1.0, n, recycling) for n in timed) / len(timed)
    return round(statistics.mean(timed.values()) / share, 4)


def eager_over(rows: list[dict], row: dict) -> float | None:
    """The eager row's mean step over ``row``'s recycling counts (a reshaped row times fewer than eager's)."""
    eager = next((r for r in rows if r.get("config") == "eager" and "step_s" in r), None)
    if eager is None:
        return None
    by_n = {int(n): t for n, t in eager["step_s_by_recycling"].items()}
    counts = [int(n) for n in row.get("step_s_by_recycling", {}) if int(n) in by_n]
    return statistics.mean(by_n[n] for n in counts) if counts else eager["step_s"]


def format_table(rows: list[dict], predicted: dict) -> str:
    """The headline table: s/step per recycling count and mean, speed-up, MFU, peak vs predicted, profile; a
    skipped configuration with why, a failed one with its error."""
    eager = next((r["step_s"] for r in rows if r.get("config") == "eager" and "step_s" in r), None)
    lines = [f"{'config':<11} {'s/step by recycling 0..R-1':<28} {'mean':>7} {'vs eager':>8} {'MFU':>6} {'peak GiB':>8} "
             f"{'model':>6} {'error':>7} {'busy':>5} {'launch/step':>11}  notes"]  # fmt: skip
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"{r['config']:<11} {r.get('error') or r['skipped']}")
            continue
        est = predicted.get(r["kernels"])
        pred = (est.get("peak_bytes") if r["cuda_graphs"] else est.get("step_peak_bytes")) if est else None
        by_n = "/".join(f"{t:.2f}" for t in r["step_s_by_recycling"].values())
        prof = r.get("profile") or {}
        peak = r.get("peak_bytes")
        err = f"{100 * (pred / peak - 1):+.1f}%" if pred and peak else "-"
        notes = [f"setup {r['setup_s']} s"] + ([f"breaks {r.get('graph_breaks')}, recompiles {r.get('recompiles')}"]
                                               if r["compile"] else [])  # fmt: skip
        notes += [predicted_note(r)] if r.get("predicted_s") else []
        notes += [r["cut"]] if r.get("cut") else []
        notes += [f"ran {r['ran']}"] if r.get("ran") else []
        ratio = f"{eager_over(rows, r) / r['step_s']:.2f}x" if eager else "-"
        notes += [f"{r['reshaped']}; all counts ~{r['step_s_all_counts_est']:.3f} s by launch shares"] if r.get("reshaped") else []
        util = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
        model = f"{pred / 2**30:.2f}" if pred else "-"
        peak_s = f"{peak / 2**30:.2f}" if peak else "-"
        lines.append(f"{r['config']:<11} {by_n:<28} {r['step_s']:>7.3f} {ratio:>8} {util:>6} {peak_s:>8} "
                     f"{model:>6} {err:>7} {prof.get('busy_fraction') or '-':>5} {prof.get('launches_per_step') or '-':>11}  "
                     f"{', '.join(notes)}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
