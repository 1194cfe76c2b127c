"""How fast can the AlphaFold structure module learn when its pair input is *perfect*?

The built-in demo (``scalefold train``: 150 steps, 2 CPU cores) lifts the validation lDDT-Cα only from
~0.02 to ~0.07: its structure module stays collapsed. This probe separates the structure module from
the trunk. It trains the demo preset's structure module alone (reference code: IPA, backbone update
with the rotation stop-gradient, angle resnet; backbone FAPE clamped on 90 % of the steps, Adam
lr 1e-3 eps 1e-6) on the demo store's training crops, with inputs no trunk could beat:

* pair: a learned linear embedding of the one-hot *true* Cα distance bin (3.25-50.75 Å, 39 edges)
  and of the clipped relative residue index (±32);
* single: a learned linear embedding of the residue type.

It prints the training FAPE and the validation lDDT-Cα (the MLPerf metric, full chains) every
``--eval-every`` steps. If the structure module cannot reach a score from perfect distances within a
step budget, the full model, whose pair representation must be learned first, cannot either.

    python bench/structure_module_probe.py --steps 2000        # ~1.5 min on 2 CPU cores
    python bench/structure_module_probe.py --sm-blocks 8 --json probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from scalefold.config.training import TrainConfig
from scalefold.data.dataset import StoreSample
from scalefold.data.pipeline import FeatureConfig
from scalefold.data.store import Store
from scalefold.lddt import validation_lddt_ca
from scalefold.losses.distogram import distogram_bin_index
from scalefold.losses.fape import backbone_fape_loss
from scalefold.model.config import StructureModuleConfig
from scalefold.model.factory import build_model_config
from scalefold.model.structure_module import StructureModule
from scalefold.train.run_directory import ensure_store
from scalefold.train.training_data import split_chains

DISTANCE_BINS = (3.25, 50.75, 40)  # 39 evenly spaced edges (the template distogram's), 40 bins
MAX_RELPOS = 32


class PerfectInputs(torch.nn.Module):
    """Single and pair inputs of the structure module from the ground truth of a batch."""

    def __init__(self, c_s: int, c_z: int) -> None:
        super().__init__()
        self.single = torch.nn.Linear(21, c_s)
        self.pair = torch.nn.Linear(DISTANCE_BINS[2] + 2 * MAX_RELPOS + 1, c_z)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        aatype = batch["aatype"][..., -1]
        ca = batch["all_atom_positions"][..., -1][..., 1, :]  # [1, N, 3]
        ca_mask = batch["all_atom_mask"][..., -1][..., 1]
        distance = F.one_hot(distogram_bin_index(ca, *DISTANCE_BINS), DISTANCE_BINS[2]).float()
        distance = distance * (ca_mask[..., :, None] * ca_mask[..., None, :])[..., None]  # unknown: all zero
        index = batch["residue_index"][..., -1]
        relpos = (index[..., :, None] - index[..., None, :]).clamp(-MAX_RELPOS, MAX_RELPOS) + MAX_RELPOS
        pair = torch.cat([distance, F.one_hot(relpos, 2 * MAX_RELPOS + 1).float()], dim=-1)
        return self.single(F.one_hot(aatype.clamp(max=20), 21).float()), self.pair(pair)


def structure_module(sm_cfg: dict, num_blocks: int | None, dropout: float | None = None) -> StructureModule:
    """The model config's structure module (as :class:`~scalefold.model.AlphaFold` builds it), with
    optional iteration count and dropout overrides."""
    sm_cfg = dict(sm_cfg)
    if num_blocks:
        sm_cfg["num_blocks"] = num_blocks
    if dropout is not None:
        sm_cfg["dropout_rate"] = dropout
    return StructureModule(StructureModuleConfig(**sm_cfg))


def validation_score(sm: StructureModule, inputs: PerfectInputs, batches: list[dict[str, torch.Tensor]]) -> float:
    sm.eval()
    scores = []
    with torch.no_grad():
        for batch in batches:
            single, pair = inputs(batch)
            out = sm(single, pair, batch["seq_mask"][..., -1], batch["aatype"][..., -1])
            ca = out["sm_positions"][:, -1][..., 1, :]  # last iteration, atom14 index 1 = CA
            pred = ca.new_zeros(ca.shape[:-1] + (37, 3))
            pred[..., 1, :] = ca  # only the CA enters lDDT-Cα
            target = batch["all_atom_positions"][..., -1].float()
            scores.append(float(validation_lddt_ca(pred, target, batch["all_atom_mask"][..., -1].float()).mean()))
    sm.train()
    return float(np.mean(scores))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default=None, help="store (default: the demo's, synthesised if absent)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sm-blocks", type=int, default=None, help="structure-module iterations (demo: 2)")
    parser.add_argument("--sm-dropout", type=float, default=None, help="structure-module dropout (demo: 0.1)")
    parser.add_argument("--clamped-fraction", type=float, default=0.9, help="steps with clamped FAPE")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-chains", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the curve here")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    overrides = {"store": args.store, "eval_max_chains": args.eval_chains}
    cfg = TrainConfig.from_preset("demo", overrides=overrides, env={})
    ensure_store(cfg)
    model_cfg = build_model_config(cfg).to_dict()
    features = FeatureConfig.from_reference_config(model_cfg)
    with Store.open(cfg.store) as store:
        train_ids, _, val_ids = split_chains(store, cfg)
    sm_cfg = model_cfg["structure_module_config"]
    sm = structure_module(sm_cfg, args.sm_blocks, args.sm_dropout)
    inputs = PerfectInputs(sm_cfg["c_s"], sm_cfg["c_z"])
    opt = torch.optim.Adam([*sm.parameters(), *inputs.parameters()], lr=args.lr, eps=1e-6)
    train_sample = StoreSample(cfg.store, train_ids, features, mode="train")
    val_sample = StoreSample(cfg.store, val_ids, features, mode="eval")
    val_batches = [val_sample(i, 0) for i in range(len(val_ids))]
    rng = np.random.default_rng(args.seed)

    curve = [{"step": 0, "val_lddt_ca": validation_score(sm, inputs, val_batches), "seconds": 0.0}]
    print(f"structure module {sum(p.numel() for p in sm.parameters()):,} parameters, {sm.num_blocks} iterations; "
          f"{len(train_ids)} training / {len(val_batches)} validation chains (crop {features.train_sequence_crop_size})")  # fmt: skip
    print(f"{'step':>6} {'train FAPE':>11} {'val lDDT-Cα':>12} {'seconds':>8}")
    print(f"{0:>6} {'':>11} {curve[0]['val_lddt_ca']:>12.3f} {0:>8.0f}")
    t0, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        batch = train_sample(int(rng.integers(len(train_ids))), int(rng.integers(1 << 30)))
        single, pair = inputs(batch)
        out = sm(single, pair, batch["seq_mask"][..., -1], batch["aatype"][..., -1])
        clamped = torch.tensor([float(rng.random() < args.clamped_fraction)])
        loss = backbone_fape_loss(
            batch["backbone_rigid_tensor"][..., -1], batch["backbone_rigid_mask"][..., -1], out["sm_frames"], clamped
        ).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            row = {"step": step, "train_fape": float(np.mean(losses[-args.eval_every :])),
                   "val_lddt_ca": validation_score(sm, inputs, val_batches), "seconds": time.perf_counter() - t0}  # fmt: skip
            curve.append(row)
            print(f"{step:>6} {row['train_fape']:>11.3f} {row['val_lddt_ca']:>12.3f} {row['seconds']:>8.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}, indent=1))


if __name__ == "__main__":
    main()
