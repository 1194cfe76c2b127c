"""How much a checkpoint's score rests on its templates, and how good the templates are.

    python bench/template_diagnostics.py --store runs/demo-store.h5 --checkpoint CKPT [--train-sample 40]

1. lDDT-Cα of ``CKPT`` (SWA weights when present) on the training preset's validation chains, as
   ``scalefold evaluate`` scores it, and again with every ``template_*`` feature zeroed (no templates);
2. the templates themselves: per chain, how many it gets and the lDDT-Cα of its best template's Cα trace
   against the true structure (unaligned template residues count as wrong), for the validation chains and a
   sample of training chains (the evaluation pipeline: all templates, no subsampling).

bench/RESULTS.md, section 5c (the demo models' gains come from template use; the synthetic families'
templates are near-copies of the answer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scalefold.data.dataset import StoreSample  # noqa: E402
from scalefold.data.pipeline import FeatureConfig  # noqa: E402
from scalefold.data.store import Store  # noqa: E402
from scalefold.inference import evaluate as ev  # noqa: E402

CUTOFF = 15.0  # lDDT inclusion radius (Å)
THRESHOLDS = (0.5, 1.0, 2.0, 4.0)


def template_lddt_ca(batch: dict[str, torch.Tensor], t: int) -> float:
    """lDDT-Cα of template ``t``'s Cα trace against the truth (last recycling slice of an eval batch)."""
    truth = batch["all_atom_positions"][0, :, 1, :, -1]
    true_mask = batch["all_atom_mask"][0, :, 1, -1] > 0
    pos = batch["template_all_atom_positions"][0, t, :, 1, :, -1]
    aligned = batch["template_all_atom_mask"][0, t, :, 1, -1] > 0
    d_true, d_templ = torch.cdist(truth, truth), torch.cdist(pos, pos)
    eye = torch.eye(len(truth), dtype=torch.bool)
    pairs = (d_true < CUTOFF) & true_mask[:, None] & true_mask[None, :] & ~eye
    ok = aligned[:, None] & aligned[None, :]
    diff = (d_true - d_templ).abs()
    kept = sum(((diff < c) & ok & pairs).float() for c in THRESHOLDS) / len(THRESHOLDS)
    return float(kept.sum() / pairs.float().sum().clamp_min(1))


def template_stats(store: str, chains: list[str], features: FeatureConfig) -> tuple[dict[int, int], list[float]]:
    sample = StoreSample(os.fspath(store), chains, features, mode="eval")
    counts: dict[int, int] = {}
    best = []
    for i in range(len(chains)):
        batch = sample(i, 0)
        n = int((batch["template_mask"][0, :, -1] > 0).sum())
        counts[n] = counts.get(n, 0) + 1
        best.append(max((template_lddt_ca(batch, t) for t in range(n)), default=0.0))
    return dict(sorted(counts.items())), best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--max-chains", type=int, default=None, help="validation chains (default: the preset's)")
    ap.add_argument("--train-sample", type=int, default=40, help="training chains sampled for template quality")
    args = ap.parse_args(argv)

    loaded = ev.load_model(args.checkpoint, device="cpu")
    chains = ev.validation_chains(args.store, loaded.preset, args.max_chains)
    features = FeatureConfig.from_reference_config(loaded.config.to_dict())
    sample = StoreSample(os.fspath(args.store), chains, features, mode="eval")
    with_t, without_t = [], []
    print(f"{args.checkpoint}: preset {loaded.preset}, {loaded.weights} weights")
    print(f"{'chain':<10} {'lDDT-Cα':>8} {'no templates':>13}")
    for i, chain in enumerate(chains):
        batch = sample(i, 0)
        score, _ = ev.score_target(loaded, batch)
        bare = {k: torch.zeros_like(v) if k.startswith("template_") else v for k, v in batch.items()}
        score_bare, _ = ev.score_target(loaded, bare)
        with_t.append(score)
        without_t.append(score_bare)
        print(f"{chain:<10} {score:>8.4f} {score_bare:>13.4f}", flush=True)
    print(f"{'mean':<10} {statistics.mean(with_t):>8.4f} {statistics.mean(without_t):>13.4f}")

    with Store.open(args.store) as store:
        others = [c for c in store.chain_ids if c not in set(chains)]
    step = max(1, len(others) // max(1, args.train_sample))
    for name, ids in (("validation", chains), ("training sample", others[::step][: args.train_sample])):
        if not ids:  # --train-sample 0
            continue
        counts, best = template_stats(args.store, ids, features)
        print(f"{name}: {len(ids)} chains, templates per chain {counts}; best template's lDDT-Cα against the truth: "
              f"median {statistics.median(best):.2f}, mean {statistics.mean(best):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
