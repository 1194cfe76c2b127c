"""Data-pipeline benchmark: preprocessing throughput and per-sample feature-building time.

    python bench/data_pipeline.py [--mmcif-dir DIR] [--workers 2] [--length 256 400] [--msa-depth 5000]

1. ``scalefold preprocess`` throughput (chains/s) over a directory of mmCIF files (default: the
   shared test PDB entries beside the checkout, without alignments).
2. Training-feature time per sample at the MLPerf shapes (crop 256, 124 clusters, 1,024 extra
   rows, 4 templates, 4 recycling ensembles) for random chains of the given lengths and MSA depth.
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

from scalefold import residue_constants as rc  # noqa: E402
from scalefold.data.pipeline import FeatureConfig, process_training_features  # noqa: E402
from scalefold.data.preprocess import preprocess  # noqa: E402
from scalefold.data.raw_features import make_sequence_features  # noqa: E402
from scalefold.data.templates import empty_template_features  # noqa: E402


def random_raw_features(length: int, depth: int, seed: int) -> dict:
    """A random chain with a random MSA (HHblits ids, ~10 % gaps, sparse deletions) and no templates."""
    rng = np.random.default_rng(seed)
    sequence = "".join(rng.choice(list(rc.restypes), size=length))
    raw = make_sequence_features(sequence, "bench", length)
    msa = rng.integers(0, 21, size=(depth, length), dtype=np.int32)
    msa[rng.random((depth, length)) < 0.1] = 21
    raw["msa"] = msa
    raw["deletion_matrix_int"] = (rng.random((depth, length)) < 0.02).astype(np.int32) * rng.integers(1, 5, (depth, length))
    raw["num_alignments"] = np.full((length,), depth, dtype=np.int32)
    raw.update(empty_template_features(length))
    raw["all_atom_positions"] = rng.normal(scale=10.0, size=(length, 37, 3)).astype(np.float32)
    raw["all_atom_mask"] = np.ones((length, 37), np.float32)
    raw["resolution"] = np.array(2.0, dtype=np.float32)
    return raw


def bench_preprocess(mmcif_dir: Path, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        report = preprocess(mmcif_dir, None, Path(tmp) / "bench.h5", workers=workers, require_alignments=False, progress=False)
        seconds = time.perf_counter() - start
    chains = int(report.get("chains_written", 0))
    return {"files": len(list(mmcif_dir.glob("*.cif"))), "chains": chains, "seconds": seconds, "chains_per_s": chains / seconds}


def bench_features(length: int, depth: int, repeats: int) -> dict:
    cfg = FeatureConfig.mlperf()
    raw = random_raw_features(length, depth, seed=0)
    process_training_features(raw, cfg, seed=0)  # warm-up
    times = []
    for seed in range(1, repeats + 1):
        start = time.perf_counter()
        process_training_features(raw, cfg, seed=seed)
        times.append(time.perf_counter() - start)
    return {"length": length, "msa_depth": depth, "median_s": float(np.median(times)), "max_s": float(np.max(times))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mmcif-dir", type=Path, default=REPO.parent / "shared" / "data" / "mmcif")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--length", type=int, nargs="+", default=[256, 400])
    p.add_argument("--msa-depth", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    result: dict = {"machine": f"{platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}".strip()}
    if args.mmcif_dir.is_dir():
        result["preprocess"] = bench_preprocess(args.mmcif_dir, args.workers)
        pre = result["preprocess"]
        print(f"preprocess: {pre['chains']} chains from {pre['files']} files in {pre['seconds']:.2f} s "
              f"= {pre['chains_per_s']:.1f} chains/s ({args.workers} workers)")
    else:
        print(f"preprocess: skipped ({args.mmcif_dir} not found)")
    result["features"] = [bench_features(n, args.msa_depth, args.repeats) for n in args.length]
    for row in result["features"]:
        print(f"features: L={row['length']:>4} MSA={row['msa_depth']:>5} -> median {row['median_s']:.2f} s, max {row['max_s']:.2f} s "
              "per training sample (crop 256 / 124 clusters / 1024 extra / 4 ensembles)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
