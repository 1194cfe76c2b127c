"""``scalefold model-info``: parameter counts and names of a model preset, in about 2 s (2.4 s wall, 1.8 s user for mlperf on the 2-core dev box at load 3).

The model is built on PyTorch's ``meta`` device (tensors with shapes, no storage), and the weight
initialisers are skipped while it is built: on ``meta`` they compute nothing, but each one still goes
through PyTorch's reference implementations (``torch._refs``), which made the meta build of the
``mlperf`` model take several seconds. Skipping in-place operations on meta tensors changes no shape,
so the counts and names are exactly those of the real model.
"""

from __future__ import annotations

import argparse
import json

from scalefold.model.config import PRESETS as _MODEL_PRESET_BUILDERS  # torch-free: --help stays fast

MODEL_PRESETS = tuple(_MODEL_PRESET_BUILDERS)

# In-place methods that change a tensor's shape or metadata: these must still run while building.
_SHAPE_CHANGING = frozenset(
    {"resize_", "resize_as_", "set_", "as_strided_", "requires_grad_", "share_memory_", "transpose_", "t_",
     "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_", "retain_grad"}
)  # fmt: skip


def meta_model(preset: str):
    """The preset's :class:`~scalefold.model.AlphaFold` on the meta device, weight initialisation skipped."""
    import torch
    from torch.overrides import TorchFunctionMode

    from scalefold.model import AlphaFold, AlphaFoldConfig

    class _SkipInPlaceOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if (
                name.endswith("_") and not name.endswith("__") and name not in _SHAPE_CHANGING
                and args and isinstance(args[0], torch.Tensor) and args[0].is_meta
            ):  # fmt: skip
                return args[0]  # an initialiser (normal_, uniform_, zero_, ...): nothing to compute on meta
            return func(*args, **(kwargs or {}))

    with torch.device("meta"), _SkipInPlaceOnMeta():
        return AlphaFold(AlphaFoldConfig.from_preset(preset))


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "model-info",
        help="print the parameter count of a model preset per top-level module (shapes only, no weights)",
        description="Build a preset's AlphaFold on PyTorch's meta device (shapes only: no weights are allocated "
        "or initialised) and print its parameter count per top-level module.",
    )
    p.add_argument("--preset", default="mlperf", choices=MODEL_PRESETS)
    p.add_argument("--names", action="store_true", help="also list every parameter name and shape")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    model = meta_model(args.preset)
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


__all__ = ["add_parsers", "meta_model"]
