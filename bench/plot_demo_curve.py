"""The demo model's from-scratch validation curve, all stages, as one picture (bench/RESULTS.md, section 5d).

    python bench/plot_demo_curve.py --out bench/curves/demo_curve.png

Reads the committed metrics (``metrics.jsonl.gz``: every step and every evaluation) of the curve's runs
under ``bench/curves/``: stage 1 (``demo-wide/``: 2 structure-module iterations, from scratch), stage 2
(``demo-stage2/``: 4 iterations from stage 1's step-26,000 SWA weights; its steps are drawn after stage 1's
26,000) and, for comparison, the first, narrow demo model (``demo-from-scratch/sm2/``). Marks the shipped
initial checkpoint (its manifest), the demo's target and 0.7.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CURVES = ROOT / "bench" / "curves"
STAGE2_START = 26000  # stage 1's step whose export starts stage 2


def eval_points(path: Path, offset: int = 0, upto: int | None = None) -> list[tuple[int, float]]:
    """(step + offset, eval lDDT-Cα) of every evaluation in a committed ``metrics.jsonl.gz``."""
    from scalefold.train.curves import read_metrics

    evals = read_metrics(path)[1]
    points = {r["step"] + offset: float(r["eval_lddt_ca"]) for r in evals if upto is None or r["step"] <= upto}
    return sorted(points.items())  # a step evaluated twice (a resumed run's repeat): the later record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(CURVES / "demo_curve.png"))
    args = p.parse_args(argv)

    from scalefold.checkpoint.shipped import Manifest, manifest_path, shipped_demo_checkpoint
    from scalefold.config.training import DEMO_TARGET_LDDT

    stage1 = eval_points(CURVES / "demo-wide" / "metrics.jsonl.gz", upto=STAGE2_START)
    stage2 = eval_points(CURVES / "demo-stage2" / "metrics.jsonl.gz", offset=STAGE2_START)
    narrow = eval_points(CURVES / "demo-from-scratch" / "sm2" / "metrics.jsonl.gz")
    manifest = Manifest.read(manifest_path(shipped_demo_checkpoint()))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.plot(*zip(*narrow), color="0.6", lw=1, label="narrow demo model (152 k), 2 SM iterations")
    ax.plot(*zip(*stage1), color="tab:blue", lw=1.4, label="demo-wide (538 k), stage 1: 2 SM iterations")
    ax.plot(*zip(*stage2), color="tab:red", lw=1.4, label="stage 2: 4 SM iterations (the demo preset)")
    ax.plot([STAGE2_START + manifest.step], [manifest.eval_lddt_ca], "k*", ms=11,
            label=f"shipped checkpoint (stage 2, step {manifest.step}: {manifest.eval_lddt_ca:.3f})")
    ax.axhline(DEMO_TARGET_LDDT, color="tab:green", ls="--", lw=1, label=f"demo target {DEMO_TARGET_LDDT}")
    ax.axhline(0.7, color="k", ls=":", lw=1, label="0.7")
    ax.axvline(STAGE2_START, color="0.3", lw=0.6)
    ax.set_xlabel("training step (batch 1; stage 2 counted after stage 1's 26,000)")
    ax.set_ylabel("validation lDDT-Cα (SWA weights, 12 chains)")
    ax.set_ylim(0, 0.8)
    ax.set_title("The demo model trained from scratch (demo store, 1 CPU thread)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: stage 1 {len(stage1)} evaluations (last {stage1[-1]}), stage 2 {len(stage2)} "
          f"(last step {stage2[-1][0] - STAGE2_START}: {stage2[-1][1]:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
