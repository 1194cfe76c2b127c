"""``scalefold evaluate``: per-target and mean lDDT-Cα of a checkpoint on a store's validation chains.

The targets are the validation split training uses (:func:`scalefold.train.training_data.validation_chain_ids`:
chains released in the CAMEO window, at most ``val_max_sequence_length`` residues, the training
preset's ``eval_max_chains``) or an explicit list of chain ids. Each target goes through the
validation data pipeline with the reference's per-target seed
(:class:`scalefold.data.dataset.StoreSample` in ``eval`` mode), the model runs all recycling
passes without autograd and the score is the MLPerf metric
(:func:`scalefold.lddt.validation_lddt_ca`). With the training preset's settings and the SWA
weights of a checkpoint this reproduces the training run's ``eval_lddt_ca`` at that step.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from scalefold.evaluation.scoring import target_lddt_ca
from scalefold.inference.predict import run_model
from scalefold.inference.weights import InferenceError, LoadedModel, default_device, load_model

PathLike = Union[str, os.PathLike]
REPORT_SUFFIXES = (".json", ".csv")


@dataclass
class TargetScore:
    chain_id: str
    length: int
    lddt_ca: float
    mean_plddt: float
    seconds: float


@dataclass
class EvaluationReport:
    store: str
    checkpoint: str
    preset: str
    weights: str
    iteration: int | None
    num_recycling_iters: int
    targets: list[TargetScore] = field(default_factory=list)

    @property
    def mean_lddt_ca(self) -> float:
        return float(sum(t.lddt_ca for t in self.targets) / len(self.targets)) if self.targets else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_lddt_ca"] = self.mean_lddt_ca
        out["num_targets"] = len(self.targets)
        return out

    def to_csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["chain_id", "length", "lddt_ca", "mean_plddt", "seconds"])
        for t in self.targets:
            writer.writerow([t.chain_id, t.length, f"{t.lddt_ca:.6f}", f"{t.mean_plddt:.3f}", f"{t.seconds:.3f}"])
        writer.writerow(["mean", "", f"{self.mean_lddt_ca:.6f}", "", ""])
        return buffer.getvalue()

    def table(self) -> str:
        """A plain-text table of the targets and the mean."""
        width = max([len("chain"), *(len(t.chain_id) for t in self.targets)])
        lines = [f"{'chain':<{width}}  {'length':>6}  {'lDDT-Cα':>8}  {'pLDDT':>6}  {'seconds':>7}"]
        for t in self.targets:
            lines.append(
                f"{t.chain_id:<{width}}  {t.length:>6}  {t.lddt_ca:>8.4f}  {t.mean_plddt:>6.2f}  {t.seconds:>7.2f}"
            )
        lines.append(f"{'mean':<{width}}  {'':>6}  {self.mean_lddt_ca:>8.4f}  ({len(self.targets)} targets)")
        return "\n".join(lines)

    def write(self, path: PathLike) -> Path:
        """JSON or CSV by suffix."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in REPORT_SUFFIXES:
            raise InferenceError(f"report {path}: use a .json or .csv suffix")
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2) + "\n" if suffix == ".json" else self.to_csv()
        path.write_text(text)
        return path


def validation_chains(store_path: PathLike, preset: str, max_chains: int | None = None) -> list[str]:
    """The validation chains training with ``preset`` uses (``max_chains``: 0 = all, None = the preset's)."""
    from scalefold.config.training import TrainConfig
    from scalefold.data.store import Store
    from scalefold.inference.weights import TRAINING_PRESET_OF
    from scalefold.train.training_data import validation_chain_ids

    cfg = TrainConfig.from_preset(TRAINING_PRESET_OF[preset], overrides={"eval_max_chains": max_chains})
    with Store.open(store_path) as store:
        val_ids = validation_chain_ids(store, cfg)
    if not val_ids:
        raise InferenceError(
            f"{store_path}: no validation chains released in [{cfg.val_min_date}, {cfg.val_max_date}] "
            f"with at most {cfg.val_max_sequence_length} residues; name them with --chains"
        )
    return val_ids


def _check_chains(store_path: PathLike, chains: Sequence[str]) -> list[str]:
    from scalefold.data.store import Store

    with Store.open(store_path) as store:
        known = set(store.chain_ids)
    unknown = [c for c in chains if c not in known]
    if unknown:
        raise InferenceError(f"{store_path}: unknown chain ids {unknown[:10]} ({len(known)} chains in the store)")
    if not chains:
        raise InferenceError("no chains to evaluate")
    return list(dict.fromkeys(chains))  # drop repeats, keep order


def score_target(loaded: LoadedModel, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """``(lDDT-Cα, mean pLDDT)`` of one validation batch ``[1, ..., R]``."""
    outputs = run_model(loaded, batch)
    return target_lddt_ca(outputs, batch), float(outputs["plddt"].mean())


def evaluate(
    store: PathLike,
    checkpoint: PathLike,
    chains: Sequence[str] | None = None,
    preset: str | None = None,
    weights: str = "auto",
    num_recycling: int | None = None,
    max_chains: int | None = None,
    progress: bool = True,
    device: Union[str, torch.device, None] = None,
) -> EvaluationReport:
    """Score ``checkpoint`` on ``chains`` of ``store`` (default: the training validation split)."""
    from scalefold.data.dataset import StoreSample
    from scalefold.data.pipeline import FeatureConfig

    if not Path(store).is_file():
        raise InferenceError(f"store not found: {store}")
    loaded = load_model(checkpoint, preset=preset, weights=weights, num_recycling=num_recycling,
                        device=device or default_device())  # fmt: skip
    if chains:
        chain_ids = _check_chains(store, chains)
    else:
        chain_ids = validation_chains(store, loaded.preset, max_chains)
    features = FeatureConfig.from_reference_config(loaded.config.to_dict())
    sample = StoreSample(os.fspath(store), chain_ids, features, mode="eval")
    report = EvaluationReport(
        store=os.fspath(store), checkpoint=os.fspath(checkpoint), preset=loaded.preset, weights=loaded.weights,
        iteration=loaded.iteration, num_recycling_iters=loaded.config.num_recycling_iters,
    )  # fmt: skip
    from tqdm import tqdm

    bar = tqdm(total=len(chain_ids), desc="evaluate", unit="target", disable=not progress, dynamic_ncols=True)
    try:
        for index, chain_id in enumerate(chain_ids):
            t0 = time.perf_counter()
            batch = sample(index, 0)
            lddt, plddt = score_target(loaded, batch)
            if not math.isfinite(lddt):
                raise InferenceError(f"{chain_id}: non-finite lDDT-Cα (is the checkpoint's training diverged?)")
            length = int(batch["seq_length"][0, -1])
            report.targets.append(TargetScore(chain_id, length, lddt, plddt, time.perf_counter() - t0))
            bar.update(1)
            bar.set_postfix(lddt_ca=f"{report.mean_lddt_ca:.4f}")
    finally:
        bar.close()
    return report


__all__ = ["EvaluationReport", "TargetScore", "evaluate", "score_target", "validation_chains"]
