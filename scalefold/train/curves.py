"""PNG of the training curves (loss and evaluation lDDT-Cα against step) from ``metrics.jsonl``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Union

from scalefold.diskspace import atomic_output

PathLike = Union[str, Path]


def read_metrics(path: PathLike) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a ``metrics.jsonl`` (or of its gzip, ``metrics.jsonl.gz``,
    as the curves under ``bench/curves/`` are committed)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    train, evals = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        (evals if "eval_lddt_ca" in record else train).append(record)
    return train, evals


def plot_metrics(
    metrics_path: PathLike,
    out_png: PathLike,
    title: str = "ScaleFold training",
    target: float | None = None,
    start_label: str = "untrained model",
) -> Path:
    """Two panels: training loss per step, evaluation lDDT-Cα per step with the run's ``target`` (a
    dashed line) and its starting point (the step-0 evaluation, labelled ``start_label``). Returns
    ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(metrics_path)
    fig, (ax_loss, ax_lddt) = plt.subplots(1, 2, figsize=(10, 4))
    steps, losses = [r["step"] for r in train], [r["loss"] for r in train]
    ax_loss.plot(steps, losses, lw=0.6, alpha=0.5, label="per step")
    window = max(1, min(50, len(losses) // 10))
    if window > 1:  # one sample a step is noisy: the running mean shows the trend
        kept = [(s, v) for s, v in zip(steps, losses) if v is not None]
        mean = [sum(v for _, v in kept[i - window + 1 : i + 1]) / window for i in range(window - 1, len(kept))]
        ax_loss.plot([s for s, _ in kept[window - 1 :]], mean, lw=1.5, color="tab:blue",
                     label=f"mean of {window} steps")  # fmt: skip
        ax_loss.legend(loc="best", fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_lddt.plot([r["step"] for r in evals], [r["eval_lddt_ca"] for r in evals], "o-", ms=3, label="SWA weights")
    start = next((r for r in evals if r["step"] == 0), None)
    if start is not None:
        ax_lddt.plot([0], [start["eval_lddt_ca"]], "s", color="tab:green", ms=8,
                     label=f"start: {start_label} ({start['eval_lddt_ca']:.3f})")  # fmt: skip
    if target is not None and 0.0 < target <= 1.0:
        ax_lddt.axhline(target, color="tab:red", ls="--", lw=1, label=f"target {target:g}")
        reached = next((r for r in evals if r["eval_lddt_ca"] >= target), None)
        if reached is not None:
            ax_lddt.plot([reached["step"]], [reached["eval_lddt_ca"]], "*", color="tab:red", ms=12,
                         label=f"reached at step {reached['step']}")  # fmt: skip
    if start is not None or target is not None:
        ax_lddt.legend(loc="best", fontsize=8)
    ax_lddt.set_xlabel("step")
    ax_lddt.set_ylabel("lDDT-Cα (SWA weights)")
    ax_lddt.set_ylim(0.0, 1.0)
    ax_lddt.set_title("evaluation lDDT-Cα")
    fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    try:
        with atomic_output(out_png) as tmp:  # a full disk leaves the previous picture, never a torn one
            fig.savefig(tmp, dpi=100, format=out_png.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return out_png


__all__ = ["plot_metrics", "read_metrics"]
