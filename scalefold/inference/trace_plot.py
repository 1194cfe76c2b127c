"""Predicted Cα traces against the true one, after optimal superposition (a picture to look at).

The MLPerf metric (lDDT-Cα) is superposition-free; a picture is not. Each prediction is rotated
and translated onto the true structure with the Kabsch algorithm over the resolved Cα atoms, then
drawn as a 3-D line beside the true trace, one panel per prediction (e.g. the initial checkpoint
and the trained SWA weights). The panel title carries the lDDT-Cα and the Cα RMSD after
superposition, so the picture and the numbers can be read together.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

PathLike = Union[str, os.PathLike]

CA_INDEX = 1  # atom37 order: N, CA, C, ...


def kabsch_superpose(mobile: np.ndarray, target: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """``mobile`` [N, 3] moved by the proper rotation + translation that minimises its RMSD to
    ``target`` over the rows where ``mask`` is set (all rows without a mask)."""
    mobile = np.asarray(mobile, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    keep = np.ones(len(mobile), bool) if mask is None else np.asarray(mask, bool)
    if keep.sum() < 3:
        raise ValueError("superposition needs at least 3 resolved positions")
    mu_m, mu_t = mobile[keep].mean(0), target[keep].mean(0)
    h = (mobile[keep] - mu_m).T @ (target[keep] - mu_t)  # [3, 3] covariance
    u, _, vt = np.linalg.svd(h)
    d = np.sign(np.linalg.det(vt.T @ u.T))  # no reflections
    rot = vt.T @ np.diag([1.0, 1.0, d]) @ u.T
    return (mobile - mu_m) @ rot.T + mu_t


def rmsd(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    keep = np.asarray(mask, bool)
    return float(np.sqrt(((np.asarray(a)[keep] - np.asarray(b)[keep]) ** 2).sum(-1).mean()))


@dataclass
class Trace:
    """One predicted Cα trace of a chain: what it is, its coordinates [N, 3] and its lDDT-Cα."""

    label: str
    ca: np.ndarray
    lddt_ca: float


def predict_ca_trace(checkpoint: PathLike, store: PathLike, chain_id: str, weights: str = "auto"):
    """``(Trace, true Cα [N, 3], Cα mask [N])`` of ``checkpoint``'s prediction of ``chain_id`` (the
    evaluation features of the store, as validation builds them)."""
    from scalefold.data.dataset import StoreSample
    from scalefold.data.pipeline import FeatureConfig
    from scalefold.inference.predict import run_model
    from scalefold.inference.weights import load_model
    from scalefold.lddt import validation_lddt_ca

    loaded = load_model(checkpoint, weights=weights)
    features = FeatureConfig.from_reference_config(loaded.config.to_dict())
    batch = StoreSample(os.fspath(store), [chain_id], features, mode="eval")(0, 0)
    outputs = run_model(loaded, batch)
    true_pos = batch["all_atom_positions"][..., -1].float()  # [1, N, 37, 3]
    mask = batch["all_atom_mask"][..., -1].float()  # [1, N, 37]
    score = float(validation_lddt_ca(outputs["final_atom_positions"], true_pos, mask).mean())
    pred_ca = outputs["final_atom_positions"][0, :, CA_INDEX].double().numpy()
    true_ca = true_pos[0, :, CA_INDEX].double().numpy()
    ca_mask = mask[0, :, CA_INDEX].numpy() > 0
    return Trace(label=str(checkpoint), ca=pred_ca, lddt_ca=score), true_ca, ca_mask


def plot_ca_traces(
    true_ca: np.ndarray, mask: np.ndarray, traces: Sequence[Trace], out_png: PathLike, title: str = ""
) -> Path:
    """One 3-D panel per trace: the true Cα trace (grey) and the superposed prediction (colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keep = np.asarray(mask, bool)
    fig = plt.figure(figsize=(5 * len(traces), 5))
    for i, trace in enumerate(traces, start=1):
        moved = kabsch_superpose(trace.ca, true_ca, keep)
        ax = fig.add_subplot(1, len(traces), i, projection="3d")
        t, p = true_ca[keep], moved[keep]
        ax.plot(t[:, 0], t[:, 1], t[:, 2], color="0.55", lw=2, label="true")
        ax.plot(p[:, 0], p[:, 1], p[:, 2], color="tab:red", lw=1.5, label="predicted")
        ax.scatter(*t[0], color="0.3", s=20)
        ax.scatter(*p[0], color="tab:red", s=20)  # the N-terminus of each
        ax.set_title(f"{trace.label}\nlDDT-Cα {trace.lddt_ca:.3f}, Cα RMSD {rmsd(moved, true_ca, keep):.1f} Å")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_xticklabels([])
        ax.set_yticklabels([])
        ax.set_zticklabels([])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def plot_checkpoints_on_chain(
    store: PathLike,
    chain_id: str,
    checkpoints: Sequence[tuple[str, PathLike]],
    out_png: PathLike,
    weights: Sequence[str] | None = None,
) -> tuple[Path, list[Trace]]:
    """Predict ``chain_id`` with each ``(label, checkpoint)`` and draw them against the true trace."""
    traces, true_ca, ca_mask = [], None, None
    for i, (label, path) in enumerate(checkpoints):
        trace, true_ca, ca_mask = predict_ca_trace(path, store, chain_id, (weights or ["auto"] * len(checkpoints))[i])
        trace.label = label
        traces.append(trace)
    out = plot_ca_traces(true_ca, ca_mask, traces, out_png, title=f"validation chain {chain_id}: Cα trace")
    return out, traces


__all__ = ["Trace", "kabsch_superpose", "plot_ca_traces", "plot_checkpoints_on_chain", "predict_ca_trace", "rmsd"]
