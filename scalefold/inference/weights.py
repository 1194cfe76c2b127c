"""Checkpoint -> an AlphaFold in eval mode, for ``scalefold predict`` and ``scalefold evaluate``.

Accepted files (all read with ``torch.load(weights_only=True)``):

* ScaleFold's own checkpoints (:mod:`scalefold.checkpoint.files`): ``alphafold_state_dict`` and,
  when SWA ran, ``swa_state_dict`` (``averaged_model.n_averaged`` + ``averaged_model.module.<name>``);
* the MLPerf reference's resumable checkpoint (``alphafold_state_dict``, ``optimizer_state_dict``,
  ``iteration``) and its SWA file (the ``averaged_model.*`` entries at top level);
* a bare model state dict (reference parameter names, optionally with a DDP ``module.`` prefix).

Which weights: ``"swa"`` (the averaged weights; an error when the file has none), ``"model"`` (the
raw training weights) or ``"auto"`` (SWA when present and averaged at least once, else the model
weights) -- the SWA weights are what MLPerf evaluates.

The model preset is not stored in a checkpoint: it is given (``preset``) or found by comparing the
checkpoint's parameter names and shapes with each preset built on the meta device (no memory, no
time). A checkpoint that matches no preset is refused with the list of mismatched names.

The data-pipeline sizes and the recycling count are those the training preset uses
(:func:`scalefold.model.factory.build_model_config`), so that ``scalefold evaluate`` reproduces the
training run's evaluation; ``num_recycling`` overrides the recycling count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

from scalefold.checkpoint import adapters
from scalefold.checkpoint import files as checkpoint_io
from scalefold.errors import UserError
from scalefold.model import AlphaFold, AlphaFoldConfig

PathLike = Union[str, os.PathLike]

WEIGHT_CHOICES = ("auto", "swa", "model")
#: Model presets tried, cheapest first, when the checkpoint's preset is not given.
DETECTABLE_PRESETS = ("tiny", "demo", "demo-wide", "mlperf")
#: Model preset -> the training preset that trains it (``initial_training`` is ``mlperf``'s model;
#: ``demo-wide`` is what the demo presets train; the narrow ``demo`` needs SCALEFOLD_MODEL_PRESET=demo).
TRAINING_PRESET_OF = {"tiny": "tiny", "demo": "demo", "demo-wide": "demo", "mlperf": "mlperf",
                      "initial_training": "mlperf"}  # fmt: skip
MODEL_PRESETS = tuple(TRAINING_PRESET_OF)


def plural(count: int, noun: str) -> str:
    """``"1 recycling iteration"``, ``"3 recycling iterations"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


class InferenceError(UserError, ValueError):
    """Bad input to ``predict`` / ``evaluate``: the message says what and where."""


@dataclass
class LoadedModel:
    """An eval-mode model and where its weights came from."""

    model: AlphaFold
    config: AlphaFoldConfig
    preset: str
    weights: str  # "swa" or "model"
    iteration: int | None
    n_averaged: int | None
    path: str

    def describe(self) -> str:
        step = f", iteration {self.iteration}" if self.iteration is not None else ""
        averaged = f", {plural(self.n_averaged, 'SWA update')}" if self.weights == "swa" and self.n_averaged is not None else ""
        return (
            f"{self.path}: preset {self.preset}, {self.weights} weights{step}{averaged}, "
            f"{plural(self.config.num_recycling_iters, 'recycling iteration')}"
        )


def inference_config(preset: str, num_recycling: int | None = None, precision: str = "fp32",
                     model_options: Mapping[str, int] | None = None) -> AlphaFoldConfig:  # fmt: skip
    """The model config the training preset of ``preset`` builds (data sizes, recycling), fp32, with the
    training run's ``model_options`` (recorded in its checkpoints) and ``num_recycling`` over them."""
    from scalefold.config.training import TrainConfig
    from scalefold.model.factory import build_model_config

    if preset not in TRAINING_PRESET_OF:
        raise InferenceError(f"unknown model preset {preset!r}; expected one of {sorted(TRAINING_PRESET_OF)}")
    if num_recycling is not None and num_recycling < 0:
        raise InferenceError(f"the number of recycling iterations must be >= 0, got {num_recycling}")
    from scalefold.model.factory import MODEL_OPTIONS

    options = {k: v for k, v in (model_options or {}).items() if k in MODEL_OPTIONS}
    train_cfg = TrainConfig.from_preset(
        TRAINING_PRESET_OF[preset],
        overrides={**options, "num_recycling_iters": num_recycling, "precision": precision, "model_preset": preset},
    )
    # Structure-module iterations are a run's choice, recorded in its checkpoints when it made one: absent,
    # the run used the model preset's, whatever the training preset sets today (the demo preset's 4 is
    # stage 2 of its recipe; stage-1 and narrow-demo checkpoints ran the model preset's 2).
    train_cfg = train_cfg.replace(structure_module_iterations=options.get("structure_module_iterations"))
    return build_model_config(train_cfg)


def select_weights(
    checkpoint: Mapping[str, Any], weights: str = "auto"
) -> tuple[dict[str, torch.Tensor], str, int | None]:
    """``(state dict with reference names, "swa" | "model", n_averaged)`` chosen from a checkpoint dict."""
    if weights not in WEIGHT_CHOICES:
        raise InferenceError(f"weights must be one of {WEIGHT_CHOICES}, got {weights!r}")
    swa: Mapping[str, Any] | None = None
    model_sd: Mapping[str, Any] | None = None
    if adapters.SWA_N_AVERAGED in checkpoint:  # the reference's SWA file
        swa = checkpoint
    else:
        if isinstance(checkpoint.get("swa_state_dict"), Mapping):
            swa = checkpoint["swa_state_dict"]
        model_sd = checkpoint  # adapters pick "alphafold_state_dict" or treat it as a bare state dict
        if adapters.MODEL_KEY not in checkpoint and swa is not None:
            model_sd = None
    n_averaged = int(swa[adapters.SWA_N_AVERAGED]) if swa is not None and adapters.SWA_N_AVERAGED in swa else None
    if weights == "auto":
        use_swa = swa is not None and (model_sd is None or (n_averaged or 0) > 0)
    else:
        use_swa = weights == "swa"
    if use_swa:
        if swa is None:
            raise InferenceError("the checkpoint holds no SWA weights (no 'swa_state_dict'); use --weights model")
        state, n_averaged = adapters.load_swa_checkpoint(swa)
        return state, "swa", n_averaged
    if model_sd is None:
        raise InferenceError("the checkpoint holds only SWA weights; use --weights swa (or auto)")
    if adapters.MODEL_KEY not in model_sd and any(not isinstance(v, torch.Tensor) for v in model_sd.values()):
        raise InferenceError(
            f"not a model checkpoint: no {adapters.MODEL_KEY!r}, no SWA weights; top-level keys: {sorted(model_sd)[:10]}"
        )
    return adapters.extract_model_state_dict(model_sd), "model", None


def _meta_model(preset: str) -> AlphaFold:
    with torch.device("meta"):
        return AlphaFold(AlphaFoldConfig.from_preset(preset), activation_checkpointing=False)


def detect_preset(state_dict: Mapping[str, torch.Tensor], presets: tuple[str, ...] = DETECTABLE_PRESETS) -> str:
    """The first preset whose parameter names and shapes equal ``state_dict``'s; else an error
    listing the mismatches against the closest preset."""
    reports = {}
    for preset in presets:
        report = adapters.compare_state_dict(_meta_model(preset), state_dict)
        if report.ok:
            return preset
        reports[preset] = report
    closest = min(
        reports, key=lambda p: len(reports[p].missing) + len(reports[p].unexpected) + len(reports[p].mismatched)
    )
    raise InferenceError(
        f"the checkpoint matches no model preset of {list(presets)}; against the closest, {closest!r}, the "
        + reports[closest].describe()
    )


def load_model(
    path: PathLike,
    preset: str | None = None,
    weights: str = "auto",
    num_recycling: int | None = None,
    device: Union[str, torch.device] = "cpu",
) -> LoadedModel:
    """Read ``path``, pick the weights, check them against the preset (given or detected), build the model."""
    adapters.check_checkpoint_file(path)  # a clear error for a missing file, a directory, another format
    checkpoint = checkpoint_io.load_checkpoint(path, map_location="cpu")
    state, used, n_averaged = select_weights(checkpoint, weights)
    if preset is None:
        preset = detect_preset(state)
    elif preset not in TRAINING_PRESET_OF:
        raise InferenceError(f"unknown model preset {preset!r}; expected one of {sorted(TRAINING_PRESET_OF)}")
    else:
        report = adapters.compare_state_dict(_meta_model(preset), state)
        if not report.ok:
            raise InferenceError(f"{os.fspath(path)} does not fit the {preset!r} preset: {report.describe()}")
    options = checkpoint.get("model_options") if isinstance(checkpoint.get("model_options"), Mapping) else None
    config = inference_config(preset, num_recycling, model_options=options)
    model = AlphaFold(config, activation_checkpointing=False)
    adapters.load_reference_state_dict(model, state, strict=True)
    model.to(device=device, dtype=torch.float32).eval()
    iteration = checkpoint.get(adapters.ITERATION_KEY)
    return LoadedModel(
        model=model, config=config, preset=preset, weights=used,
        iteration=int(iteration) if iteration is not None else None, n_averaged=n_averaged, path=os.fspath(path),
    )  # fmt: skip


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


__all__ = [
    "InferenceError",
    "LoadedModel",
    "WEIGHT_CHOICES",
    "MODEL_PRESETS",
    "default_device",
    "detect_preset",
    "inference_config",
    "load_model",
    "select_weights",
]
