"""Data-pipeline benchmark: preprocessing throughput and per-sample feature-building time.

    python bench/data_pipeline.py [--data-dir DIR] [--workers 2] [--preprocess-mode both]
                                  [--query-copies 16] [--length 256 400] [--msa-depth 5000]
                                  [--templates 4] [--compare-reference]

1. ``scalefold preprocess`` throughput (chains/s), in two modes (``--preprocess-mode``):

   * ``structures``: every mmCIF file of ``DATA/mmcif`` (the shared test PDB entries beside the
     checkout), no alignments -- mmCIF parsing and the store write only.
   * ``alignments``: chains *with* their real alignments and template hits: ``2q2k`` (chains A and
     B with ``DATA/alignments/2q2k_{A,B}``: a3m + two Stockholm files, no templates) plus
     ``--query-copies`` entries ``9q00``, ``9q01``, ... generated for the 73-residue ``query`` of
     ``DATA/alignments/query`` (a CA-only mmCIF with its sequence, released 2022-01-01), each
     linked to that real alignment directory: 1,024-row a3m, uniref90 + mgnify Stockholm files
     and 10 HHsearch hits whose template structures (all but 1hf9) are in ``DATA/mmcif`` and are
     featurised (prefilter, realignment, atom37 coordinates) into the store. The time includes
     the scan of the template directory (release dates, chain ids); it is also reported alone.
     Template mmCIFs are kept in a per-worker LRU cache (``TemplateHitFeaturizer``), so repeated
     copies of one query re-use parsed templates; ``--query-copies 1 --workers 1`` gives the
     cold cost of one chain.

2. Training-feature time per sample at the MLPerf shapes (crop 256, 124 clusters, 1,024 extra
   rows, 4 templates, 4 recycling ensembles) for random chains of the given lengths and MSA depth.
   ``--compare-reference`` also times the plain reference transforms (one-hot matmul cluster
   assignment, one-hot-mean MSA profile) in the same run, for a before/after on the same box.
Prints a table and, last, one JSON line. Report figures with the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import contextlib  # noqa: E402

from scalefold import residue_constants as rc  # noqa: E402
from scalefold.data import transforms as T  # noqa: E402
from scalefold.data.pipeline import FeatureConfig, process_training_features  # noqa: E402
from scalefold.data.preprocess import preprocess  # noqa: E402
from scalefold.data.raw_features import make_sequence_features  # noqa: E402
from scalefold.data.templates import empty_template_features  # noqa: E402


def random_raw_features(length: int, depth: int, seed: int, templates: int = 0) -> dict:
    """A random chain with a random MSA (HHblits ids, ~10 % gaps, sparse deletions) and ``templates``
    random templates (one-hot residues, coordinates, ~80 % of residues aligned)."""
    rng = np.random.default_rng(seed)
    sequence = "".join(rng.choice(list(rc.restypes), size=length))
    raw = make_sequence_features(sequence, "bench", length)
    msa = rng.integers(0, 21, size=(depth, length), dtype=np.int32)
    msa[rng.random((depth, length)) < 0.1] = 21
    raw["msa"] = msa
    raw["deletion_matrix_int"] = (rng.random((depth, length)) < 0.02).astype(np.int32) * rng.integers(
        1, 5, (depth, length)
    )
    raw["num_alignments"] = np.full((length,), depth, dtype=np.int32)
    raw.update(empty_template_features(length))
    if templates:
        ids = rng.integers(0, 22, size=(templates, length))
        aligned = rng.random((templates, length)) < 0.8
        ids[~aligned] = 21  # gap
        raw["template_aatype"] = np.eye(22, dtype=np.float32)[ids]  # [T, L, 22]
        mask = np.repeat(aligned[..., None], 37, axis=-1).astype(np.float32)  # [T, L, 37]
        raw["template_all_atom_positions"] = rng.normal(scale=10.0, size=(templates, length, 37, 3)).astype(np.float32)
        raw["template_all_atom_positions"] *= mask[..., None]
        raw["template_all_atom_masks"] = mask
        raw["template_sum_probs"] = rng.random((templates, 1)).astype(np.float32) * 100
    raw["all_atom_positions"] = rng.normal(scale=10.0, size=(length, 37, 3)).astype(np.float32)
    raw["all_atom_mask"] = np.ones((length, 37), np.float32)
    raw["resolution"] = np.array(2.0, dtype=np.float32)
    return raw


def bench_preprocess(mmcif_dir: Path, workers: int) -> dict:
    """Mode ``structures``: every mmCIF file of ``mmcif_dir``, no alignments."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        report = preprocess(
            mmcif_dir, None, Path(tmp) / "bench.h5", workers=workers, require_alignments=False, progress=False
        )
        seconds = time.perf_counter() - start
    chains = int(report.get("chains_written", 0))
    return {
        "mode": "structures",
        "files": len(list(mmcif_dir.glob("*.cif"))),
        "chains": chains,
        "seconds": seconds,
        "chains_per_s": chains / seconds,
        "skipped": {reason: group["count"] for reason, group in report["skipped"].items()},
    }


QUERY_RELEASE_DATE = "2022-01-01"  # after every template of the query's hits (prefilter: >= 60 days)


def query_mmcif(pdb_id: str, sequence: str) -> str:
    """A minimal CA-only mmCIF of one protein chain ``A`` with ``sequence`` (an ideal helix)."""
    rows = []
    for i, aa in enumerate(sequence):
        name = rc.restype_1to3.get(aa, "UNK")
        angle = np.deg2rad(100.0 * i)
        x, y, z = 2.3 * np.cos(angle), 2.3 * np.sin(angle), 1.5 * i
        rows.append(f"ATOM {i + 1} C CA . {name} A 1 {i + 1} ? {x:.3f} {y:.3f} {z:.3f} 1.00 20.00 {i + 1} A 1")
    names = sorted({rc.restype_1to3.get(aa, "UNK") for aa in sequence})
    return "\n".join(
        [
            f"data_{pdb_id.upper()}",
            f"_entry.id {pdb_id.upper()}",
            "_exptl.method 'X-RAY DIFFRACTION'",
            "_refine.ls_d_res_high 2.0",
            f"_pdbx_audit_revision_history.revision_date {QUERY_RELEASE_DATE}",
            "loop_\n_entity_poly_seq.entity_id\n_entity_poly_seq.num\n_entity_poly_seq.mon_id",
            *(f"1 {i + 1} {rc.restype_1to3.get(aa, 'UNK')}" for i, aa in enumerate(sequence)),
            "loop_\n_chem_comp.id\n_chem_comp.type",
            *(f"{n} 'L-peptide linking'" for n in names),
            "loop_\n_struct_asym.id\n_struct_asym.entity_id\nA 1",
            "loop_",
            *(
                f"_atom_site.{tag}"
                for tag in (
                    "group_PDB id type_symbol label_atom_id label_alt_id label_comp_id label_asym_id "
                    "label_entity_id label_seq_id pdbx_PDB_ins_code Cartn_x Cartn_y Cartn_z occupancy "
                    "B_iso_or_equiv auth_seq_id auth_asym_id pdbx_PDB_model_num"
                ).split()
            ),
            *rows,
            "#",
            "",
        ]
    )


def _link(src: Path, dst: Path) -> None:
    try:
        dst.symlink_to(src, target_is_directory=src.is_dir())
    except OSError:
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)


def bench_preprocess_alignments(data_dir: Path, workers: int, query_copies: int) -> dict:
    """Mode ``alignments``: real alignments + template hits (see the module docstring)."""
    from scalefold.data.preprocess import scan_template_entries
    from scalefold.data.store import Store

    mmcif_src, aln_src = data_dir / "mmcif", data_dir / "alignments"
    sequence = "".join(
        line.strip()
        for line in (aln_src / "query" / "query.fasta").read_text().splitlines()
        if not line.startswith(">")
    )
    with tempfile.TemporaryDirectory() as tmp:
        mmcif, alignments = Path(tmp) / "mmcif", Path(tmp) / "alignments"
        mmcif.mkdir()
        alignments.mkdir()
        _link(mmcif_src / "2q2k.cif", mmcif / "2q2k.cif")
        for chain in ("2q2k_A", "2q2k_B"):
            _link(aln_src / chain, alignments / chain)
        for k in range(query_copies):
            pdb_id = f"9q{k:02d}"
            (mmcif / f"{pdb_id}.cif").write_text(query_mmcif(pdb_id, sequence))
            _link(aln_src / "query", alignments / f"{pdb_id}_A")
        scan_start = time.perf_counter()
        scan_template_entries(mmcif_src, workers)
        scan_seconds = time.perf_counter() - scan_start
        out = Path(tmp) / "bench.h5"
        start = time.perf_counter()
        report = preprocess(mmcif, alignments, out, workers=workers, progress=False, template_mmcif_dir=mmcif_src)
        seconds = time.perf_counter() - start
        with Store.open(out) as store:
            chains = [store.get(c) for c in store.chain_ids]
    written = int(report.get("chains_written", 0))
    outcomes = [o for c in chains for o in (c.get("template_outcomes") or ())]
    return {
        "mode": "alignments",
        "chains": written,
        "query_copies": query_copies,
        "seconds": seconds,
        "chains_per_s": written / seconds,
        "template_scan_s": scan_seconds,
        "msa_rows_mean": float(np.mean([c["msa"].shape[0] for c in chains])) if chains else 0.0,
        "template_hits": len(outcomes),
        "templates_featurised": sum(o.stage == "ok" for o in outcomes),
        "kalign": shutil.which("kalign") or "none (Python fallback aligner)",
        "skipped": {reason: group["count"] for reason, group in report["skipped"].items()},
    }


@contextlib.contextmanager
def reference_transforms():
    """Swap the fast MSA transforms for their plain reference versions (for before/after timing)."""
    saved = T.nearest_neighbor_clusters, T.make_hhblits_profile

    def profile(feats):
        feats["hhblits_profile"] = T.msa.hhblits_profile_reference(feats["msa"])
        return feats

    T.nearest_neighbor_clusters, T.make_hhblits_profile = T.msa.nearest_neighbor_clusters_reference, profile
    try:
        yield
    finally:
        T.nearest_neighbor_clusters, T.make_hhblits_profile = saved


def bench_features(length: int, depth: int, repeats: int, templates: int = 4, reference: bool = False) -> dict:
    cfg = FeatureConfig.mlperf()
    raw = random_raw_features(length, depth, seed=0, templates=templates)
    with reference_transforms() if reference else contextlib.nullcontext():
        process_training_features(raw, cfg, seed=0)  # warm-up
        times = []
        for seed in range(1, repeats + 1):
            start = time.perf_counter()
            process_training_features(raw, cfg, seed=seed)
            times.append(time.perf_counter() - start)
    return {
        "length": length,
        "msa_depth": depth,
        "templates": templates,
        "transforms": "reference" if reference else "fast",
        "median_s": float(np.median(times)),
        "max_s": float(np.max(times)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data", help="mmcif/ and alignments/")
    p.add_argument("--mmcif-dir", type=Path, default=None, help="mode structures: mmCIF files (default DATA/mmcif)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--preprocess-mode", choices=("structures", "alignments", "both", "none"), default="both",
        help="structures: mmCIF only; alignments: chains with real MSAs + featurised template hits",
    )  # fmt: skip
    p.add_argument("--query-copies", type=int, default=16, help="mode alignments: generated query entries")
    p.add_argument("--length", type=int, nargs="*", default=[256, 400])
    p.add_argument("--msa-depth", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--templates", type=int, default=4, help="random templates per chain (MLPerf keeps up to 4)")
    p.add_argument("--compare-reference", action="store_true", help="also time the plain reference transforms")
    args = p.parse_args()
    mmcif_dir = args.mmcif_dir or args.data_dir / "mmcif"

    result: dict = {
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}".strip(),
        "preprocess": [],
    }
    if args.preprocess_mode in ("structures", "both"):
        if mmcif_dir.is_dir():
            pre = bench_preprocess(mmcif_dir, args.workers)
            result["preprocess"].append(pre)
            print(
                f"preprocess (structures only): {pre['chains']} chains from {pre['files']} files in "
                f"{pre['seconds']:.2f} s = {pre['chains_per_s']:.1f} chains/s ({args.workers} workers)"
            )
        else:
            print(f"preprocess (structures only): skipped ({mmcif_dir} not found)")
    if args.preprocess_mode in ("alignments", "both"):
        if (args.data_dir / "alignments" / "query").is_dir() and (args.data_dir / "mmcif").is_dir():
            pre = bench_preprocess_alignments(args.data_dir, args.workers, args.query_copies)
            result["preprocess"].append(pre)
            print(
                f"preprocess (with alignments + templates): {pre['chains']} chains in {pre['seconds']:.2f} s = "
                f"{pre['chains_per_s']:.2f} chains/s ({args.workers} workers; mean {pre['msa_rows_mean']:.0f} MSA "
                f"rows, {pre['templates_featurised']}/{pre['template_hits']} template hits featurised; template-dir "
                f"scan {pre['template_scan_s']:.2f} s; kalign: {pre['kalign']})"
            )
        else:
            print(f"preprocess (with alignments + templates): skipped ({args.data_dir} has no alignments/query)")
    modes = [False, True] if args.compare_reference else [False]
    result["features"] = [
        bench_features(n, args.msa_depth, args.repeats, args.templates, reference)
        for n in args.length
        for reference in modes
    ]
    for row in result["features"]:
        print(
            f"features ({row['transforms']}): L={row['length']:>4} MSA={row['msa_depth']:>5} T={row['templates']} -> "
            f"median {row['median_s']:.2f} s, max {row['max_s']:.2f} s "
            "per training sample (crop 256 / 124 clusters / 1024 extra / 4 ensembles)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
