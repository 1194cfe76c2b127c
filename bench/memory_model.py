"""Validation of the memory model (``scalefold estimate-memory``) against the real CPU peak.

For each configuration, the same training step (first step, 1 no-grad recycling pass + grad pass +
loss + backward + Adam/SWA) is (a) predicted on fake tensors with CPU rules
(``estimate_memory(target="cpu")``: exact storage sizes, CPU autocast) and (b) run for real on CPU
under ``torch.profiler(profile_memory=True)``, whose allocation records carry the CPU allocator's
running total (every allocation, op-internal scratch included): ``measure_cpu_peak``. Prints one
row per configuration and a JSON list last.

    python bench/memory_model.py [--presets tiny demo] [--precisions fp32 bf16] [--checkpointing off on]

On CUDA (``--cuda``) it compares ``estimate_memory(target="cuda")`` with
``torch.cuda.max_memory_allocated`` of the same step instead.

Against a real CUDA run's allocator trace, line by line (``--compare-snapshot``; no GPU needed): the model
runs with ``sites=True`` (CUDA rules) and its bytes at the peak per allocating line are printed beside the
trace's bytes at its peak per line, largest difference first (:mod:`scalefold.perf.memory_sites`):

    python bench/memory_model.py --compare-snapshot DIR/eager_memory.pickle.gz --preset mlperf --precision bf16 \
        --kernels torch [--activation-checkpointing on] [--json OUT.json]

(``DIR/eager_memory_peak.json``, the trace's peak summary ``bench/step_headline.py`` writes beside it, works too;
``--sites-json DIR/memory_model_torch.json``, the model's output the headline keeps, skips running the model.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scalefold.config.training import TrainConfig  # noqa: E402
from scalefold.perf.memory import estimate_memory, measure_cpu_peak  # noqa: E402


def measure_cuda_peak(cfg: TrainConfig) -> dict[str, int]:
    """``torch.cuda.max_memory_allocated`` over the first training step of ``cfg`` (everything built on
    the GPU first; the peak counter reset after the build, so it covers what the step adds on top)."""
    import torch

    from scalefold.train.step import TrainingStep

    step = TrainingStep.build(cfg, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step.run(min(1, step.num_ensembles - 1))
    torch.cuda.synchronize()
    return {"peak_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved()}


def compare_snapshot(args: argparse.Namespace) -> int:
    """``--compare-snapshot``: the model's sites against the trace's, as a table (and JSON with ``--json``)."""
    from scalefold.perf.memory_sites import compare, format_comparison, read_peak

    try:
        report = read_peak(args.compare_snapshot)  # first: a bad path fails in a second, not after the model
    except ValueError as exc:
        print(f"bench/memory_model.py: --compare-snapshot: {exc}", file=sys.stderr)
        return 2
    if args.sites_json:  # the model's sites as `scalefold estimate-memory --sites --json` wrote them
        try:
            est = json.loads(Path(args.sites_json).read_text())
            sites, settings = est["sites"], {**est["settings"], "sites_json": args.sites_json}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"bench/memory_model.py: --sites-json {args.sites_json}: not estimate-memory --sites --json output "
                  f"({type(exc).__name__})", file=sys.stderr)  # fmt: skip
            return 2
    else:
        overrides = {"precision": args.precisions[0], "crop_size": args.crop,
                     "activation_checkpointing": args.activation_checkpointing}  # fmt: skip
        cfg = TrainConfig.from_preset(args.presets[0], overrides={k: v for k, v in overrides.items() if v is not None},
                                      env={})  # fmt: skip
        run = estimate_memory(cfg, target="cuda", kernels=args.kernels, cuda_graphs=False, sites=True)
        sites, settings = run.sites, {**run.settings, "seconds": round(run.seconds, 1)}
    cmp = compare(report, sites, extra={"settings": {**settings, "snapshot": str(args.compare_snapshot)}})
    print(f"predicted (memory model, sites) vs measured (allocator trace {args.compare_snapshot}), "
          f"{settings['preset']} {settings['precision']} kernels {settings['kernels']}, checkpointing "
          f"{settings['activation_checkpointing']}:")  # fmt: skip
    print(format_comparison(cmp, top=args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(cmp.to_json(), indent=1))
        print(f"comparison as JSON: {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", "--preset", nargs="+", default=["tiny", "demo"])
    ap.add_argument("--precisions", "--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], help="activation checkpointing off/on")
    ap.add_argument("--cuda", action="store_true", help="compare with torch.cuda.max_memory_allocated instead")
    ap.add_argument("--crop", type=int, help="crop size override")
    ap.add_argument("--compare-snapshot", metavar="SNAPSHOT", help="compare the model's allocating sites with this "
                    "CUDA allocator trace (*.pickle.gz, or the *_memory_peak.json beside it); first preset/precision")  # fmt: skip
    ap.add_argument("--kernels", choices=("torch", "triton"), default="torch", help="--compare-snapshot: kernel path")
    ap.add_argument("--activation-checkpointing", help="--compare-snapshot: policy on|off|N (default: the preset's)")
    ap.add_argument("--sites-json", help="--compare-snapshot: the model's sites from this `scalefold estimate-memory "
                    "--sites --json` output (the headline's DIR/memory_model_<kernels>.json) instead of running it")  # fmt: skip
    ap.add_argument("--top", type=int, default=40, help="--compare-snapshot: rows printed (default 40)")
    ap.add_argument("--json", help="--compare-snapshot: also write the comparison here")
    args = ap.parse_args(argv)
    if args.compare_snapshot:
        return compare_snapshot(args)
    rows = []
    print(f"{'preset':<7} {'prec':<5} {'AC':<4} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8} {'s':>5}", flush=True)
    for preset in args.presets:
        for precision in args.precisions:
            for ac in args.checkpointing:
                overrides = {"precision": precision, "activation_checkpointing": ac == "on", "crop_size": args.crop}
                cfg = TrainConfig.from_preset(preset, overrides={k: v for k, v in overrides.items() if v is not None},
                                              env={})  # fmt: skip
                t0 = time.perf_counter()
                if args.cuda:
                    measured = measure_cuda_peak(cfg)
                    est = estimate_memory(cfg, target="cuda", kernels=None, cuda_graphs=False)
                else:
                    measured = measure_cpu_peak(cfg)
                    est = estimate_memory(cfg, target="cpu", cuda_graphs=False)
                err = est.peak_bytes / measured["peak_bytes"] - 1
                row = {"preset": preset, "precision": precision, "activation_checkpointing": ac == "on",
                       "predicted_bytes": est.peak_bytes, "measured": measured, "relative_error": round(err, 4),
                       "breakdown": est.breakdown}  # fmt: skip
                rows.append(row)
                print(f"{preset:<7} {precision:<5} {ac:<4} {est.peak_bytes / 2**20:>14.2f} "
                      f"{measured['peak_bytes'] / 2**20:>13.2f} {100 * err:>7.2f}% {time.perf_counter() - t0:>5.0f}",
                      flush=True)  # fmt: skip
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
