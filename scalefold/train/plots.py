"""PNG of the training curves (loss and evaluation lDDT-Cα against step) from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]


def read_metrics(path: PathLike) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a ``metrics.jsonl``."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        (evals if "eval_lddt_ca" in record else train).append(record)
    return train, evals


def plot_metrics(metrics_path: PathLike, out_png: PathLike, title: str = "ScaleFold training") -> Path:
    """Two panels: training loss per step, evaluation lDDT-Cα per step. Returns ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(metrics_path)
    fig, (ax_loss, ax_lddt) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_lddt.plot([r["step"] for r in evals], [r["eval_lddt_ca"] for r in evals], "o-")
    ax_lddt.set_xlabel("step")
    ax_lddt.set_ylabel("lDDT-Cα (SWA weights)")
    ax_lddt.set_ylim(0.0, 1.0)
    ax_lddt.set_title("evaluation lDDT-Cα")
    fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


__all__ = ["plot_metrics", "read_metrics"]
