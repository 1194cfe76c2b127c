"""``scalefold estimate-memory`` (argument parsing; the work is in :mod:`scalefold.perf.memory`) and
``scalefold estimate-step`` (:mod:`scalefold.commands.estimate_step`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scalefold.commands.estimate_step import add_common_arguments, check_arguments, resolve, train_config
from scalefold.commands.estimate_step import add_parser as add_step_parser


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate-memory",
        help="predict the peak memory per rank of one training step (no GPU needed)",
        description="Run one training step (recycling passes, grad pass, loss, backward, Adam + SWA) on fake "
        "tensors and report its peak memory per rank, with what is live at the peak. See scalefold/perf/memory.py "
        "for the method and what it leaves out.",
    )  # fmt: skip
    add_common_arguments(p)
    p.add_argument("--recycling", type=int, help="no-grad recycling passes to run (default 1 where the run recycles)")
    p.add_argument("--device-memory-gib", type=float,
                   help="also check the prediction against a device of this size (names a DAP size that fits)")  # fmt: skip
    p.add_argument("--table", action="store_true",
                   help="the README table instead: crop 256 and 384 x DAP 1/2/4/8 x bf16/fp32 (slow)")  # fmt: skip
    p.add_argument("--origins", action="store_true",
                   help="also list what is live at the peak by category, module and the operator that created it "
                   "(debugging)")  # fmt: skip
    p.add_argument("--sites", action="store_true",
                   help="also list what is live at the peak by allocating line (scalefold/<file>:<line> <function>, "
                   "the keys of a CUDA allocator trace: bench/memory_model.py --compare-snapshot)")  # fmt: skip
    p.set_defaults(handler=_run)
    add_step_parser(subparsers)


def _config(args: argparse.Namespace, **extra: Any) -> Any:
    return train_config(args, **extra)


def _run(args: argparse.Namespace) -> int:
    from scalefold.perf import memory

    problem = check_arguments(args)
    if problem:
        return _bad(problem)
    if args.table:
        return _table(args)
    try:
        cfg = _config(args)
        choice = None
        if args.activation_checkpointing == "auto":  # the fewest recomputing blocks that fit (scalefold.perf.recompute)
            cfg, choice = resolve(args, cfg, estimate=lambda c: memory.estimate_memory(
                c, target=args.target, kernels=args.kernels, recycling=args.recycling))  # fmt: skip
        est = choice.probe.estimate if choice and not (args.origins or args.sites) else memory.estimate_memory(
            cfg, target=args.target, kernels=args.kernels, recycling=args.recycling, origins=args.origins,
            sites=args.sites)  # fmt: skip
    except ValueError as exc:  # a layout DAP cannot take (crop not divisible, ...), a bad option value
        return _bad(str(exc))
    out = est.to_json()
    if args.device_memory_gib:
        verdict = memory.check_fits(cfg, capacity_bytes=int(args.device_memory_gib * memory.GiB),
                                    estimate=lambda c: est if c.dap == cfg.dap else memory.estimate_memory(
                                        c, target=args.target, kernels=args.kernels, recycling=args.recycling))  # fmt: skip
        out["fits"] = verdict is None
        out["fit_message"] = verdict or f"fits a {args.device_memory_gib:g} GiB device"
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(memory.format_estimate(est))
        if "fit_message" in out:
            print(out["fit_message"])
    return 0


def _table(args: argparse.Namespace) -> int:
    from scalefold.perf import memory

    rows = []
    combos = [(crop, dap, prec) for crop in (256, 384) for prec in ("bf16", "fp32") for dap in memory.DAP_SIZES]
    for i, (crop, dap, prec) in enumerate(combos, 1):
        print(f"[{i}/{len(combos)}] crop {crop} DAP {dap} {prec} ...", file=sys.stderr, flush=True)
        args.crop, args.dap, args.precision = crop, dap, prec
        try:
            est = memory.estimate_memory(_config(args), target=args.target, kernels=args.kernels, recycling=args.recycling)
        except ValueError as exc:
            rows.append({"crop": crop, "dap": dap, "precision": prec, "error": str(exc)})
            continue
        rows.append({"crop": crop, "dap": dap, "precision": prec, **est.to_json()})
        print(f"    {est.peak_bytes / memory.GiB:.2f} GiB ({est.seconds:.0f} s)", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else memory.format_table(rows))
    return 0


def _bad(message: str) -> int:
    from scalefold.errors import UserError

    raise UserError(message, label="")  # scalefold estimate-memory: <message>, exit 3


__all__ = ["add_parsers"]
