"""Data subcommands: ``scalefold preprocess``, ``scalefold data-stats`` and ``scalefold export-chain``.

Heavy imports (gemmi, h5py) happen inside the handlers so ``scalefold --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

from scalefold.errors import UserError

# Length-histogram bin edges used by data-stats (residues).
LENGTH_BINS = (0, 50, 100, 200, 300, 400, 500, 700, 1000, 1500, 2000, 10**9)


def add_preprocess_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``preprocess`` and ``data-stats``."""
    from scalefold.data.pickle_policy import PICKLE_RISK

    p = subparsers.add_parser(
        "preprocess",
        help="build a dataset store from mmCIF files + alignments (or from the MLPerf processed layout)",
        description=(
            "Parse mmCIF files (and per-chain alignment directories <pdb_id>_<chain>/ with *.a3m, *.sto, *.hhr) "
            "into one HDF5 store. Bad files/chains are skipped; STORE.report.json lists them by reason. "
            "Exits 0 when the run finished, even if chains were skipped."
        ),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--mmcif-dir", help="directory searched recursively for *.cif / *.cif.gz")
    source.add_argument(
        "--mlperf-dir",
        help="root of the MLPerf processed layout (pdb_mmcif/processed, open_protein_set/processed); needs --allow-pickle",
    )
    p.add_argument("--alignments-dir", help="per-chain alignment directories (<pdb_id>_<chain>/)")
    p.add_argument(
        "--out", required=True,
        help="output store (.h5); the report goes to OUT.report.json, the per-file warnings to OUT.log",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--cluster-file", help="RCSB clusters-by-entity file for cluster ids (optional)")
    p.add_argument(
        "--allow-missing-alignments",
        action="store_true",
        help="keep chains that have no alignment directory (without MSA) instead of skipping them",
    )
    p.add_argument(
        "--template-mmcif-dir",
        help="mmCIF directory of the template structures (default: --mmcif-dir); featurised into the store",
    )
    p.add_argument("--no-templates", action="store_true", help="store template hits without featurising them")
    p.add_argument(
        "--kalign", help="kalign binary for template realignment (default: from PATH, else a Python aligner)"
    )
    p.add_argument("--allow-pickle", action="store_true", help=f"with --mlperf-dir: {PICKLE_RISK}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_run_preprocess)

    s = subparsers.add_parser("data-stats", help="summarise a dataset store (chains, lengths, MSA depth, templates)")
    s.add_argument("store", help="store file")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.set_defaults(handler=_run_data_stats)


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Entry point used by ``scalefold.cli``: preprocess, data-stats, synth, export-chain and bench."""
    from scalefold.commands.bench import add_bench_parser
    from scalefold.commands.synthesize import add_synth_parser

    add_preprocess_parser(subparsers)
    add_synth_parser(subparsers)
    add_export_parser(subparsers)
    add_bench_parser(subparsers)


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export-chain",
        help="write one chain of a store as target.fasta, target.a3m and target_true.pdb (inputs of predict)",
        description="Export one chain of a dataset store as the inputs of `scalefold predict` plus its true "
        "structure. Default chain: the first held-out validation chain of the demo preset's split.",
    )
    p.add_argument("--store", required=True, help="dataset store (HDF5)")
    p.add_argument("--chain", help="chain id (default: the first validation chain of the demo split)")
    p.add_argument("--out-dir", required=True, help="directory to write the three files into")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from scalefold.data.store import check_store_file
    from scalefold.inference.export import export_chain

    check_store_file(args.store)
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out-dir {out} is a file (expected a directory to write into)")
    paths = export_chain(args.store, out, args.chain)
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def _check_preprocess_inputs(args: argparse.Namespace) -> None:
    """Every input directory/file exists with the right kind, the store can be written: before any work."""
    import os
    import shutil

    from scalefold.errors import UserError, require_dir, require_file, require_range, require_writable_output

    if args.mlperf_dir:
        require_dir(args.mlperf_dir, "--mlperf-dir", "the MLPerf processed layout's root directory")
    else:
        require_dir(args.mmcif_dir, "--mmcif-dir", "a directory of *.cif / *.cif.gz files")
        if not _has_mmcif_file(args.mmcif_dir):
            raise UserError(f"--mmcif-dir {args.mmcif_dir}: no *.cif / *.cif.gz / *.mmcif file in it or below")
        if args.alignments_dir:
            require_dir(args.alignments_dir, "--alignments-dir", "a directory of <pdb_id>_<chain>/ alignment directories")
        if args.template_mmcif_dir:
            require_dir(args.template_mmcif_dir, "--template-mmcif-dir", "a directory of template mmCIF files")
        if args.cluster_file:
            require_file(args.cluster_file, "--cluster-file", "an RCSB clusters-by-entity text file")
        if args.kalign and not (shutil.which(args.kalign) or (os.path.isfile(args.kalign) and os.access(args.kalign, os.X_OK))):
            raise UserError(f"--kalign {args.kalign}: not an executable file (expected the kalign binary)")
    require_range(args.workers, "--workers", 0)
    require_writable_output(args.out, "--out")


def _has_mmcif_file(root: str) -> bool:
    """Whether ``root`` holds at least one mmCIF file (stops at the first: cheap on a full PDB mirror)."""
    import os

    from scalefold.data.preprocess import MMCIF_SUFFIXES

    return any(name.lower().endswith(MMCIF_SUFFIXES) for _, _, names in os.walk(root) for name in names)


class _CountingHandler(logging.Handler):
    """Counts the records it sees (the warnings that went to the log file instead of the screen)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _preprocess_logging(log_path: str) -> tuple[_CountingHandler, list[logging.Handler]]:
    """Per-file and per-chain warnings go to ``log_path`` (they would scroll through the progress bar,
    one line per skipped chain); the screen gets errors only, plus the count in the summary."""
    file_handler = logging.FileHandler(log_path, mode="w")
    file_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    file_handler.setLevel(logging.INFO)
    screen = logging.StreamHandler()
    screen.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    screen.setLevel(logging.ERROR)
    counter = _CountingHandler()
    handlers: list[logging.Handler] = [file_handler, screen, counter]
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in handlers:
        root.addHandler(handler)
    return counter, handlers


def _preprocess_summary(report: dict[str, Any], log_path: str, warnings: int, allow_missing: bool) -> list[str]:
    from scalefold.data.preprocess import report_path

    skipped = report["skipped"]
    lines = [f"wrote {report['chains_written']} chains to {report['store']}"]
    if skipped:
        reasons = ", ".join(f"{reason}: {g['count']}" for reason, g in skipped.items())
        lines.append(f"skipped ({reasons}): every file and chain with its reason in {report_path(report['store'])}")
    if warnings:
        lines.append(f"{warnings} warning{'s' if warnings != 1 else ''} logged to {log_path}")
    missing = skipped.get("missing_alignment", {}).get("count", 0)
    if missing and not allow_missing:
        lines.append(f"{missing} chain{'s' if missing != 1 else ''} had no alignment directory: "
                     "--allow-missing-alignments keeps such chains (without MSA)")  # fmt: skip
    return lines


def _run_preprocess(args: argparse.Namespace) -> int:
    import sys

    if args.mlperf_dir and not args.allow_pickle:
        from scalefold.data.pickle_policy import PICKLE_RISK

        print(f"scalefold preprocess: error: --mlperf-dir needs --allow-pickle: {PICKLE_RISK}", file=sys.stderr)
        return 2  # a usage error: an option is missing
    _check_preprocess_inputs(args)
    log_path = f"{args.out}.log"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    counter, handlers = _preprocess_logging(log_path)
    try:
        if args.mlperf_dir:
            from scalefold.data.mlperf_layout import convert_to_store

            report = convert_to_store(args.mlperf_dir, args.out, allow_pickle=True, progress=not args.no_progress)
        else:
            from scalefold.data.preprocess import preprocess

            report = preprocess(
                args.mmcif_dir,
                args.alignments_dir,
                args.out,
                workers=args.workers,
                require_alignments=not args.allow_missing_alignments,
                cluster_file=args.cluster_file,
                progress=not args.no_progress,
                templates=not args.no_templates,
                template_mmcif_dir=args.template_mmcif_dir,
                kalign_binary_path=args.kalign,
            )
    finally:
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()
    for line in _preprocess_summary(report, log_path, counter.count, args.allow_missing_alignments):
        print(line)
    return 0


def store_stats(path: str) -> dict[str, Any]:
    """Summary numbers of a store: chain count, length histogram, MSA depth, templates."""
    import numpy as np

    from scalefold.data.store import Store

    with Store.open(path) as store:
        table = store.chain_table()
        version = store.schema_version
    lengths = table["length"].astype(np.int64)
    depths = table["msa_depth"].astype(np.int64)
    templates = table["num_templates"].astype(np.int64)
    resolution = table["resolution"].astype(np.float64)

    def summary(values: np.ndarray) -> dict[str, float]:
        if values.size == 0:
            return {}
        return {
            "min": int(values.min()),
            "median": float(np.median(values)),
            "mean": round(float(values.mean()), 2),
            "max": int(values.max()),
        }

    counts, _ = np.histogram(lengths, bins=LENGTH_BINS)
    histogram = {
        f"{a}-{b - 1 if b < 10**9 else 'inf'}": int(c)
        for a, b, c in zip(LENGTH_BINS[:-1], LENGTH_BINS[1:], counts)
        if c
    }
    return {
        "store": str(path),
        "schema_version": version,
        "chains": int(lengths.size),
        "entries": len(set(table["pdb_id"])),
        "residues": int(lengths.sum()),
        "length": summary(lengths),
        "length_histogram": histogram,
        "msa_depth": summary(depths),
        "chains_without_msa": int((depths == 0).sum()),
        "templates_per_chain": summary(templates),
        "chains_with_templates": int((templates > 0).sum()),
        "chains_without_resolution": int(np.isnan(resolution).sum()),
        "clustered_chains": int((table["cluster_id"] >= 0).sum()),
    }


def _run_data_stats(args: argparse.Namespace) -> int:
    stats = store_stats(args.store)
    if args.json:
        print(json.dumps(stats))
        return 0
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        elif isinstance(value, float) and math.isnan(value):
            value = "-"
        print(f"{key:>26}: {value}")
    return 0
