"""``scalefold model-info``: parameter counts and names of a model preset."""

from __future__ import annotations

import argparse
import json


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "model-info",
        help="print parameter counts of a model preset (built on the meta device: no memory, no time)",
        description="Build a preset's AlphaFold on the meta device and print its parameter count per top-level module.",
    )
    p.add_argument("--preset", default="mlperf", choices=("mlperf", "initial_training", "demo", "tiny"))
    p.add_argument("--names", action="store_true", help="also list every parameter name and shape")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import torch

    from scalefold.model import AlphaFold, AlphaFoldConfig

    with torch.device("meta"):
        model = AlphaFold(AlphaFoldConfig.from_preset(args.preset))
    per_module: dict[str, int] = {}
    for name, p in model.named_parameters():
        top = name.split(".", 1)[0]
        per_module[top] = per_module.get(top, 0) + p.numel()
    total = sum(per_module.values())
    tensors = sum(1 for _ in model.parameters())
    if args.json:
        print(json.dumps({"preset": args.preset, "parameters": total, "tensors": tensors, "per_module": per_module}))
        return 0
    print(f"preset {args.preset}: {total:,} parameters in {tensors:,} tensors")
    for top, n in per_module.items():
        print(f"  {top:<32} {n:>12,}")
    if args.names:
        for name, p in model.named_parameters():
            print(f"{name}\t{tuple(p.shape)}")
    return 0
