"""Write the AlphaFold2-layout parameter files the import-weights figures of bench/RESULTS.md use.

    python bench/import_weights.py --preset mlperf --out /tmp/params_model_1.npz     # 93,229,082 values, 373 MB
    python bench/import_weights.py --preset demo-wide --out /tmp/demo_af2.npz        # the demo model's size

The values are fixed-seed Gaussians (scalefold.checkpoint.af2_synthetic, ``values="random"``): DeepMind's
files cannot be downloaded here; the layout, names, shapes and file size are theirs. Then time the import
with ``farm-bench -- .venv/bin/scalefold import-weights /tmp/params_model_1.npz --out /tmp/imported.pt``.
"""

from __future__ import annotations

import argparse
import os
import time

from scalefold.checkpoint.af2_synthetic import write_af2_params
from scalefold.model import AlphaFoldConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mlperf", help="model preset whose sizes the file has (default mlperf)")
    parser.add_argument("--out", required=True, help="the .npz to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ptm", action="store_true", help="add the _ptm files' predicted-aligned-error head")
    args = parser.parse_args()
    start = time.perf_counter()
    arrays = write_af2_params(args.out, AlphaFoldConfig.from_preset(args.preset), ptm=args.ptm, seed=args.seed)
    values = sum(a.size for a in arrays.values())
    print(f"wrote {args.out}: {len(arrays)} keys, {values:,} values, {os.path.getsize(args.out) / 1e6:.0f} MB "
          f"in {time.perf_counter() - start:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
