"""``scalefold predict`` and ``scalefold evaluate``: argument parsing; the work is in
:mod:`scalefold.inference.predict` and :mod:`scalefold.inference.evaluate`.

Bad input (missing/corrupt FASTA, alignment of another sequence, unreadable or mismatched
checkpoint, unknown chains, an output that cannot be written) raises an error the top-level handler
(:mod:`scalefold.cli`) reports in one line with exit status 3; the paths are checked before the model
is built, so a mistake is reported in well under a second.
"""

from __future__ import annotations

import argparse
import re

from scalefold.model.config import PRESETS as _MODEL_PRESET_BUILDERS  # torch-free

MODEL_PRESETS = tuple(_MODEL_PRESET_BUILDERS)  # = weights.MODEL_PRESETS
WEIGHT_CHOICES = ("auto", "swa", "model")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="ScaleFold or MLPerf reference checkpoint (or SWA file)")
    p.add_argument(
        "--preset", "--model-preset", dest="preset", choices=MODEL_PRESETS,
        help="model preset the checkpoint was trained with (default: detected from its parameter shapes)",
    )  # fmt: skip
    p.add_argument(
        "--weights", choices=WEIGHT_CHOICES, default="auto",
        help="swa: the averaged weights; model: the raw training weights; auto (default): SWA when present and averaged at least once",
    )  # fmt: skip
    p.add_argument("--num-recycling", type=int, help="recycling iterations (default: the training preset's)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``predict`` and ``evaluate``."""
    p = subparsers.add_parser(
        "predict",
        help="predict one chain's structure from a FASTA (+ a3m) and a checkpoint; write PDB/mmCIF with pLDDT",
        description="Predict the structure of one single-chain target. Writes atom37 coordinates with the "
        "per-residue pLDDT in the B-factor column and prints the mean pLDDT. Letters other than the 20 amino "
        "acids are read as X (unknown residue). No templates are used.",
    )
    p.add_argument("--fasta", required=True, help="FASTA file with one record")
    p.add_argument(
        "--a3m", nargs="+", default=[], metavar="A3M",
        help="alignments (a3m or Stockholm) whose first row is the FASTA sequence; none: single-sequence mode",
    )  # fmt: skip
    _add_model_options(p)
    p.add_argument("--out", help="output structure, .cif (mmCIF) or .pdb (default: <target name>.cif)")
    p.add_argument("--seed", type=int, default=0, help="seed of the MSA sampling/masking of the data pipeline")
    p.add_argument(
        "--reference", metavar="TRUE.pdb|cif",
        help="the true structure: also print the prediction's lDDT-Cα against it (the Cα geometry is always printed)",
    )  # fmt: skip
    p.set_defaults(handler=_run_predict)

    e = subparsers.add_parser(
        "evaluate",
        help="per-target and mean lDDT-Cα of a checkpoint on a store's validation chains",
        description="Evaluate a checkpoint on a dataset store: per-target and mean lDDT-Cα (the MLPerf metric). "
        "By default the targets are the validation split the training preset uses.",
    )
    e.add_argument("--store", required=True, help="dataset store (HDF5)")
    _add_model_options(e)
    targets = e.add_mutually_exclusive_group()
    targets.add_argument("--chains", nargs="+", metavar="CHAIN", help="chain ids to evaluate")
    targets.add_argument(
        "--val-window", action="store_true",
        help="the training validation split (chains in the CAMEO window; the default)",
    )  # fmt: skip
    e.add_argument(
        "--max-chains", type=int, help="with the validation split: at most N targets (0 = all; default: the preset's)"
    )
    e.add_argument("--out", help="report file, .json or .csv")
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    e.set_defaults(handler=_run_evaluate)


def default_output(target_name: str) -> str:
    """``<target name>.cif`` in the working directory, the name reduced to a safe file name."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", target_name).strip("._") or "prediction"
    return f"{safe}.cif"


def _check_inputs(args: argparse.Namespace) -> None:
    """Every input path exists and has the expected kind, every output can be written: before any work."""
    from scalefold.checkpoint.adapters import check_checkpoint_file
    from scalefold.errors import require_file, require_range

    if args.command == "predict":
        require_file(args.fasta, "--fasta", "a FASTA file with one record")
        for a3m in args.a3m:
            require_file(a3m, "--a3m", "an a3m or Stockholm alignment file")
        if getattr(args, "reference", None):
            require_file(args.reference, "--reference", "the true structure as a .pdb or .cif file")
    else:
        from scalefold.data.store import check_store_file

        check_store_file(args.store)
        require_range(args.max_chains, "--max-chains", 0)
    check_checkpoint_file(args.checkpoint)
    require_range(args.num_recycling, "--num-recycling", 0)
    if args.device:
        _check_device(args.device)


def _check_device(name: str) -> None:
    import torch

    from scalefold.errors import UserError

    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name}: not a torch device (expected cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _run_predict(args: argparse.Namespace) -> int:
    from scalefold.errors import require_writable_output
    from scalefold.inference.predict import predict, read_fasta

    _check_inputs(args)
    out = args.out or default_output(read_fasta(args.fasta).name)
    require_writable_output(out, "--out", suffixes=(".cif", ".mmcif", ".pdb", ".ent"))
    result = predict(
        args.fasta, args.checkpoint, a3m=args.a3m, out=out, preset=args.preset, weights=args.weights,
        num_recycling=args.num_recycling, seed=args.seed, device=args.device,
    )  # fmt: skip
    record = result.record
    unknown = f", {record.num_unknown} unknown residues read as X" if record.num_unknown else ""
    print(f"model: {result.loaded.describe()}")
    print(f"target {record.name}: {len(record.sequence)} residues{unknown}, {result.num_alignment_rows} alignment rows")
    print(f"wrote {result.out}")
    print(f"mean pLDDT: {result.mean_plddt:.2f}")
    _print_quality(result, args.reference)
    return 0


def _print_quality(result, reference: str | None) -> None:
    """Cα geometry of the prediction and, with a reference, its lDDT-Cα (:mod:`scalefold.inference.compare`)."""
    from scalefold.inference.compare import ca_geometry, lddt_ca_against, read_reference_ca
    from scalefold.lddt import CA_ATOM37_INDEX

    structure = result.structure
    ca = structure.atom_positions[:, CA_ATOM37_INDEX]  # [N_res, 3]
    for line in ca_geometry(ca, structure.atom_mask[:, CA_ATOM37_INDEX]).describe():
        print(line)
    if reference:
        true_ca, true_mask = read_reference_ca(reference, structure.sequence)
        print(f"lDDT-Cα against {reference}: {lddt_ca_against(ca, true_ca, true_mask):.4f} "
              f"({int(true_mask.sum())} of {len(true_mask)} residues have a true Cα)")  # fmt: skip


def _run_evaluate(args: argparse.Namespace) -> int:
    from scalefold.errors import require_writable_output
    from scalefold.inference.evaluate import evaluate

    _check_inputs(args)
    if args.out:
        require_writable_output(args.out, "--out", suffixes=(".json", ".csv"))
    report = evaluate(
        args.store, args.checkpoint, chains=args.chains, preset=args.preset, weights=args.weights,
        num_recycling=args.num_recycling, max_chains=args.max_chains, progress=args.progress, device=args.device,
    )  # fmt: skip
    step = f" (iteration {report.iteration})" if report.iteration is not None else ""
    from scalefold.inference.weights import plural

    print(f"{report.checkpoint}{step}: preset {report.preset}, {report.weights} weights, "
          f"{plural(report.num_recycling_iters, 'recycling iteration')}")  # fmt: skip
    print(report.table())
    if args.out:
        print(f"wrote {report.write(args.out)}")
    print(f"mean lDDT-Cα: {report.mean_lddt_ca:.4f}")
    return 0
