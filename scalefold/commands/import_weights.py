"""``scalefold import-weights``: AlphaFold2's released JAX parameters or an OpenFold checkpoint -> a ScaleFold
checkpoint (reference layout: what ``train --init-from``, ``evaluate`` and ``predict`` take).

``--mapping`` prints the whole AlphaFold2 mapping for a preset (one line per ScaleFold parameter: its
name, the haiku key and block it comes from, the transform) and the count of each transform kind;
``--check`` prints the per-parameter summary of an import and runs a forward pass of the imported model
on the shipped example target (``examples/demo_target``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

EXAMPLE_TARGET = Path(__file__).resolve().parents[2] / "examples" / "demo_target"


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import-weights",
        help="import AlphaFold2 JAX parameters (.npz) or an OpenFold checkpoint (.pt) as a ScaleFold checkpoint",
        description="Convert AlphaFold2's released parameters (params_model_1.npz ... params_model_5_ptm.npz) or "
        "an OpenFold checkpoint into a ScaleFold checkpoint that train --init-from, evaluate and predict take. "
        "The model preset is found from the parameter shapes unless given. Nothing is written unless every "
        "parameter of the preset is found with the right shape.",
    )
    p.add_argument("source", nargs="?", metavar="SOURCE", help="the .npz (AlphaFold2) or .pt (OpenFold) file")
    p.add_argument("--out", help="the ScaleFold checkpoint to write (.pt)")
    p.add_argument("--from", dest="source_format", choices=("af2", "openfold"),
                   help="the source's format (default: found from the file)")  # fmt: skip
    p.add_argument("--preset", help="model preset to import into (default: the first preset the file fits)")
    p.add_argument("--drop-pae-head", action="store_true",
                   help="import a _ptm file without its predicted-aligned-error head (no ScaleFold preset has a TM head)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="print the per-parameter summary and run a forward pass "
                   "of the imported model on the shipped example target")  # fmt: skip
    p.add_argument("--mapping", action="store_true",
                   help="print the AlphaFold2 -> ScaleFold mapping of --preset (default mlperf) and its coverage, then exit")  # fmt: skip
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from scalefold.errors import UserError, require_writable_output

    if args.mapping:
        return _print_mapping(args.preset or "mlperf")
    if not args.source or not args.out:
        raise UserError("give SOURCE and --out (or --mapping to print the mapping)")
    require_writable_output(args.out, "--out", suffixes=(".pt", ".pth"))
    from scalefold.checkpoint.af2_import import import_weights, write_imported

    result = import_weights(args.source, source_format=args.source_format, preset=args.preset,
                            drop_pae_head=args.drop_pae_head)  # fmt: skip
    write_imported(result, args.out)
    print(result.summary())
    print(f"wrote {args.out}")
    if args.check:
        _print_parameters(result)
        _forward_check(args.out, result.preset)
    return 0


def _print_mapping(preset: str) -> int:
    from scalefold.checkpoint import af2_mapping as mapping
    from scalefold.checkpoint.af2_import import preset_shapes

    shapes = preset_shapes(preset)
    entries, uncovered = mapping.expand(shapes)
    print("# ScaleFold parameter\tAlphaFold2 key[block]\ttransform\tshape")
    for entry in entries:
        print(f"{entry.describe()}\t{shapes[entry.target]}")
    _print_coverage(entries, shapes, preset, uncovered)
    return 0


def _print_coverage(entries, shapes, preset: str, uncovered: list[str]) -> None:
    from scalefold.checkpoint import af2_mapping as mapping

    total = sum(math.prod(s) for s in shapes.values())
    mapped = {e.target for e in entries}
    print(f"# preset {preset}: {len(mapped):,} of {len(shapes):,} parameters mapped exactly once "
          f"({total:,} values), {len(uncovered)} uncovered; {len(mapping.source_keys(entries))} AlphaFold2 keys")  # fmt: skip
    for kind, count in mapping.coverage(entries, shapes).items():
        print(f"#   {kind:<11} {count['parameters']:>6,} parameters {count['values']:>14,} values")


def _print_parameters(result) -> None:
    """One line per imported parameter: name, shape, where it came from, RMS / min / max."""
    sources = {e.target: (f"{e.source}" + (f"[{e.block}]" if e.block is not None else ""), e.transform)
               for e in result.entries or []}  # fmt: skip
    print("# parameter\tshape\tsource\ttransform\trms\tmin\tmax")
    for name, tensor in result.state_dict.items():
        source, transform = sources.get(name, ("(same name in the OpenFold file)", "rename"))
        t = tensor.double()
        print(f"{name}\t{tuple(tensor.shape)}\t{source}\t{transform}\t{t.pow(2).mean().sqrt():.4g}\t"
              f"{t.min():.4g}\t{t.max():.4g}")  # fmt: skip


def _forward_check(checkpoint: str, preset: str | None) -> None:
    """A forward pass (no recycling) of the written checkpoint on the example target: every output finite, the
    mean pLDDT."""
    from scalefold.errors import UserError
    from scalefold.inference.predict import predict

    fasta, a3m = EXAMPLE_TARGET / "target.fasta", EXAMPLE_TARGET / "target.a3m"
    if not fasta.is_file():
        print(f"forward check skipped: no example target here ({EXAMPLE_TARGET})")
        return
    result = predict(fasta, checkpoint, a3m=[a3m] if a3m.is_file() else [], preset=preset, weights="model",
                     num_recycling=0, device="cpu")  # fmt: skip
    import numpy as np

    finite = bool(np.isfinite(result.structure.atom_positions).all() and np.isfinite(result.structure.plddt).all())
    if not finite:
        raise UserError(f"forward check: the imported model's outputs on {fasta} are not finite")
    print(f"forward check on {fasta.parent.name}: {len(result.record.sequence)} residues, outputs finite, "
          f"mean pLDDT {result.mean_plddt:.2f}")  # fmt: skip


__all__ = ["add_parsers"]
