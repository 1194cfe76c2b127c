"""Data-pipeline benchmark: preprocessing throughput and per-sample feature-building time.

    python bench/data_pipeline.py [--mmcif-dir DIR] [--workers 2] [--length 256 400] [--msa-depth 5000]
                                  [--templates 4] [--compare-reference]

1. ``scalefold preprocess`` throughput (chains/s) over a directory of mmCIF files (default: the
   shared test PDB entries beside the checkout, without alignments).
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
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        report = preprocess(
            mmcif_dir, None, Path(tmp) / "bench.h5", workers=workers, require_alignments=False, progress=False
        )
        seconds = time.perf_counter() - start
    chains = int(report.get("chains_written", 0))
    return {
        "files": len(list(mmcif_dir.glob("*.cif"))),
        "chains": chains,
        "seconds": seconds,
        "chains_per_s": chains / seconds,
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
    p.add_argument("--mmcif-dir", type=Path, default=REPO.parent / "shared" / "data" / "mmcif")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--length", type=int, nargs="+", default=[256, 400])
    p.add_argument("--msa-depth", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--templates", type=int, default=4, help="random templates per chain (MLPerf keeps up to 4)")
    p.add_argument("--compare-reference", action="store_true", help="also time the plain reference transforms")
    args = p.parse_args()

    result: dict = {
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}".strip()
    }
    if args.mmcif_dir.is_dir():
        result["preprocess"] = bench_preprocess(args.mmcif_dir, args.workers)
        pre = result["preprocess"]
        print(
            f"preprocess: {pre['chains']} chains from {pre['files']} files in {pre['seconds']:.2f} s "
            f"= {pre['chains_per_s']:.1f} chains/s ({args.workers} workers)"
        )
    else:
        print(f"preprocess: skipped ({args.mmcif_dir} not found)")
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
