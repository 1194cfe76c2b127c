"""The shipped initial checkpoint of the demo: MLPerf's "start from a checkpoint" in miniature.

MLPerf HPC OpenFold does not train from scratch: every run starts from the reference checkpoint
and is timed to a target lDDT-Cα. The built-in demo does the same with a checkpoint that ships in
the package (``scalefold/assets/demo_init.pt``, reference layout: ``alphafold_state_dict`` +
``optimizer_state_dict`` + ``iteration``, so it loads through the same ``--init-from`` path as the
MLPerf checkpoint) and a manifest beside it (``demo_init.json``): the exact command that produced
the source run, the commit, the step, the lDDT-Cα of the shipped weights on the demo validation
chains, and the file's sha256 (which goes into the MLPerf log's ``init_checkpoint_sha256sum``).

:func:`export_init_checkpoint` turns a training checkpoint of a from-scratch demo run into such a
file + manifest (``scalefold export-init-checkpoint``); :func:`verify_shipped` refuses a missing or
corrupted file with the expected sha256 and the command that regenerates it.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

from scalefold.errors import UserError

PathLike = Union[str, os.PathLike]

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets"
DEMO_INIT_NAME = "demo_init.pt"
MANIFEST_SUFFIX = ".json"


class ShippedCheckpointError(UserError):
    """The shipped checkpoint (or its manifest) is missing or does not match its sha256."""


@dataclass
class Manifest:
    """What a shipped initial checkpoint is and how to make it again."""

    file: str  # name of the checkpoint beside the manifest
    sha256: str
    step: int  # training step of the source run
    eval_lddt_ca: float  # lDDT-Cα of the shipped weights on the demo validation chains
    eval_chains: list[str] = field(default_factory=list)
    weights: str = "swa"  # which weights of the source checkpoint became alphafold_state_dict
    source_command: str = ""  # the from-scratch training run the checkpoint comes from
    export_command: str = ""  # the command that turned it into this file
    commit: str = ""
    created: str = ""

    @classmethod
    def read(cls, path: PathLike) -> Manifest:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ShippedCheckpointError(f"{path}: manifest not found") from None
        except (OSError, ValueError) as exc:
            raise ShippedCheckpointError(f"{path}: unreadable manifest ({exc})") from None
        known = set(cls.__dataclass_fields__)
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise ShippedCheckpointError(f"{path}: incomplete manifest ({exc})") from None

    def write(self, path: PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def manifest_path(checkpoint: PathLike) -> Path:
    return Path(checkpoint).with_suffix(MANIFEST_SUFFIX)


def shipped_demo_checkpoint() -> Path:
    """Where the demo's initial checkpoint ships (it may be absent in a source tree without assets)."""
    return ASSET_DIR / DEMO_INIT_NAME


def regenerate_hint(manifest: Manifest | None) -> str:
    if manifest is None or not manifest.source_command:
        return "see README 'The shipped initial checkpoint' for the commands that regenerate it"
    return f"regenerate it with:\n  {manifest.source_command}\n  {manifest.export_command}"


def verify_shipped(checkpoint: PathLike) -> Manifest:
    """The manifest of ``checkpoint`` after checking that the file exists and has its sha256."""
    from scalefold.checkpoint.files import sha256sum

    checkpoint = Path(checkpoint)
    manifest = Manifest.read(manifest_path(checkpoint))
    if not checkpoint.is_file():
        raise ShippedCheckpointError(
            f"{checkpoint}: the shipped initial checkpoint is missing (expected sha256 {manifest.sha256}); "
            + regenerate_hint(manifest)
        )
    actual = sha256sum(checkpoint)
    if actual != manifest.sha256:
        raise ShippedCheckpointError(
            f"{checkpoint}: sha256 {actual} does not match the manifest's {manifest.sha256} (corrupted or "
            "replaced); " + regenerate_hint(manifest)
        )
    return manifest


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def export_init_checkpoint(
    source: PathLike,
    out: PathLike,
    eval_lddt_ca: float,
    eval_chains: list[str],
    weights: str = "swa",
    source_command: str = "",
    export_command: str = "",
) -> Manifest:
    """Write ``out`` (reference layout: weights + Adam state + iteration) from the training checkpoint
    ``source`` and its manifest beside it. ``weights="swa"`` ships the SWA average of the source
    run (what its evaluation scored), ``"model"`` the raw weights; the Adam moments are the run's."""
    from scalefold.checkpoint.files import load_checkpoint, save_atomic, sha256sum

    ckpt = load_checkpoint(source, map_location="cpu")
    if weights == "swa":
        from scalefold.checkpoint.adapters import load_swa_checkpoint

        if not isinstance(ckpt.get("swa_state_dict"), dict):
            raise ShippedCheckpointError(f"{source}: no SWA weights to export (use weights='model')")
        state, _ = load_swa_checkpoint(ckpt["swa_state_dict"])
    elif weights == "model":
        state = dict(ckpt["alphafold_state_dict"])
    else:
        raise ValueError(f"weights must be 'swa' or 'model', got {weights!r}")
    shipped: dict[str, Any] = {
        "alphafold_state_dict": {k: v.detach().clone().contiguous() for k, v in state.items()},
        "optimizer_state_dict": ckpt["optimizer_state_dict"],
        "iteration": int(ckpt["iteration"]),
    }
    for key in ("model_preset", "model_options"):  # which model the weights belong to
        if key in ckpt:
            shipped[key] = ckpt[key]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(shipped, out)
    manifest = Manifest(
        file=out.name, sha256=sha256sum(out), step=int(ckpt["iteration"]), eval_lddt_ca=float(eval_lddt_ca),
        eval_chains=list(eval_chains), weights=weights, source_command=source_command,
        export_command=export_command, commit=_git_commit(),
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )  # fmt: skip
    manifest.write(manifest_path(out))
    return manifest


__all__ = [
    "ASSET_DIR", "Manifest", "ShippedCheckpointError", "export_init_checkpoint", "manifest_path",
    "regenerate_hint", "shipped_demo_checkpoint", "verify_shipped",
]  # fmt: skip
