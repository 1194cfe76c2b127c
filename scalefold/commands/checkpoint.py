"""``scalefold export-init-checkpoint``: make the demo's shipped initial checkpoint (or any other).

A checkpoint of a from-scratch training run (``scalefold train --preset demo-scratch``) becomes a
reference-layout file (weights + Adam state + iteration, what ``--init-from`` loads) with a manifest
beside it. The lDDT-Cα written into the manifest is measured here, on the exported file itself, on
the store's validation chains of the training preset (the chains training evaluates), so the
manifest states what the shipped weights score, not what somebody typed.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export-init-checkpoint",
        help="turn a training checkpoint into a shipped initial checkpoint (+ manifest with its measured lDDT-Cα)",
        description="Export a ScaleFold training checkpoint to the reference layout that --init-from loads, "
        "evaluate the exported weights on the store's validation chains and write the manifest (command, "
        "commit, step, lDDT-Cα, sha256) beside it. Default output: the package's demo checkpoint.",
    )
    p.add_argument("--from", dest="source", required=True, help="training checkpoint (checkpoints/checkpoint_*.pt)")
    p.add_argument("--store", required=True, help="dataset store whose validation chains score the export")
    p.add_argument("--out", help="output file (default: the package's scalefold/assets/demo_init.pt)")
    p.add_argument("--weights", choices=("swa", "model"), default="swa",
                   help="ship the SWA average (default; what training evaluates) or the raw weights")  # fmt: skip
    p.add_argument("--source-command", default="", help="the training command that produced --from (for the manifest)")
    p.add_argument("--max-chains", type=int, help="validation chains scored (0 = all; default: the preset's)")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from scalefold.checkpoint.adapters import check_checkpoint_file
    from scalefold.checkpoint.shipped import export_init_checkpoint, manifest_path, shipped_demo_checkpoint
    from scalefold.data.store import check_store_file
    from scalefold.inference.evaluate import evaluate

    check_checkpoint_file(args.source)
    check_store_file(args.store)
    out = args.out or str(shipped_demo_checkpoint())
    command = "scalefold export-init-checkpoint " + shlex.join(
        ["--from", args.source, "--store", args.store, "--weights", args.weights]
        + (["--out", args.out] if args.out else []) + (["--max-chains", str(args.max_chains)] if args.max_chains is not None else [])
    )  # the canonical form (the source run's command is recorded on its own)
    manifest = export_init_checkpoint(args.source, out, eval_lddt_ca=float("nan"), eval_chains=[],
                                      weights=args.weights, source_command=args.source_command,
                                      export_command=command)  # fmt: skip
    report = evaluate(args.store, out, weights="model", max_chains=args.max_chains, progress=False)
    manifest = dataclasses.replace(manifest, eval_lddt_ca=report.mean_lddt_ca,
                                   eval_chains=[t.chain_id for t in report.targets])  # fmt: skip
    manifest.write(manifest_path(out))
    print(f"wrote {out} (sha256 {manifest.sha256}, step {manifest.step}, {args.weights} weights)")
    print(f"lDDT-Cα {manifest.eval_lddt_ca:.4f} on {len(manifest.eval_chains)} validation chains of {args.store}")
    print(f"manifest: {manifest_path(out)}")
    return 0


__all__ = ["add_parsers"]
