"""State-dict adapters: the MLPerf reference checkpoint layout and upstream OpenFold names.

* :func:`load_reference_state_dict` -- strict load of reference parameter names into a model,
  with an error that lists missing / unexpected / mis-shaped names.
* :func:`load_reference_checkpoint` -- the reference's resumable checkpoint
  ``{"alphafold_state_dict", "optimizer_state_dict", "iteration"}`` (Adam state indexed in
  parameter order), and :func:`save_reference_checkpoint`, its inverse.
* :func:`load_swa_checkpoint` -- the reference's SWA file (``averaged_model.n_averaged``,
  ``averaged_model.module.<name>``), and :func:`swa_state_dict`, its inverse.
* :func:`upstream_openfold_to_reference` / :func:`reference_to_upstream_openfold` -- rename
  between upstream OpenFold (aqlaboratory/openfold) and reference parameter names; the tensors
  themselves are identical (same shapes, same layout).

ScaleFold's model uses the reference names and layout directly (no fused projections), so the
reference checkpoint needs no tensor conversion and the Adam state maps one-to-one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.nn as nn

from scalefold.checkpoint.files import CheckpointError, check_checkpoint_file, load_checkpoint

StateDict = dict[str, torch.Tensor]
PathOrObj = Union[str, "os.PathLike[str]", Mapping[str, Any]]

MODEL_KEY = "alphafold_state_dict"
OPTIMIZER_KEY = "optimizer_state_dict"
ITERATION_KEY = "iteration"
SWA_PREFIX = "averaged_model."
SWA_N_AVERAGED = "averaged_model.n_averaged"
SWA_MODULE_PREFIX = "averaged_model.module."
DDP_PREFIX = "module."

MAX_LISTED_NAMES = 10  # names shown per category in a mismatch error


class StateDictMismatchError(CheckpointError):
    """Names or shapes of a state dict disagree with the model; see :class:`LoadReport`."""

    def __init__(self, report: LoadReport) -> None:
        self.report = report
        super().__init__(report.describe())


@dataclass
class LoadReport:
    """Which names were missing from the state dict, unexpected in it, or of the wrong shape."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        parts = ["state dict does not match the model:"]
        for title, items in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("mis-shaped (checkpoint vs model)", [f"{n} {tuple(a)} vs {tuple(b)}" for n, a, b in self.mismatched]),
        ):
            if items:
                shown = "\n    ".join(items[:MAX_LISTED_NAMES])
                more = f"\n    ... and {len(items) - MAX_LISTED_NAMES} more" if len(items) > MAX_LISTED_NAMES else ""
                parts.append(f"  {len(items)} {title}:\n    {shown}{more}")
        return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Model state dict
# --------------------------------------------------------------------------------------------


def compare_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> LoadReport:
    """Compare ``state_dict``'s names and shapes with ``model.state_dict()``."""
    own = model.state_dict()
    report = LoadReport()
    report.missing = [n for n in own if n not in state_dict]
    report.unexpected = [n for n in state_dict if n not in own]
    report.mismatched = [
        (n, tuple(state_dict[n].shape), tuple(own[n].shape))
        for n in own
        if n in state_dict and tuple(state_dict[n].shape) != tuple(own[n].shape)
    ]
    return report


def extract_model_state_dict(obj: Mapping[str, Any]) -> StateDict:
    """The model weights of a raw state dict or of a reference checkpoint dict.

    A DDP ``module.`` prefix on every name is removed.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"expected a state dict or checkpoint dict, got {type(obj).__name__}")
    sd = obj[MODEL_KEY] if MODEL_KEY in obj else obj
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{MODEL_KEY!r} is a {type(sd).__name__}, expected a state dict")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"not a model state dict: entries {bad[:MAX_LISTED_NAMES]} are not tensors "
            f"(top-level keys: {list(obj)[:MAX_LISTED_NAMES]})"
        )
    if sd and all(k.startswith(DDP_PREFIX) for k in sd):
        sd = {k[len(DDP_PREFIX) :]: v for k, v in sd.items()}
    return dict(sd)


def load_reference_state_dict(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> LoadReport:
    """Load reference-named weights (a raw state dict or a checkpoint with ``alphafold_state_dict``).

    ``strict``: any missing, unexpected or mis-shaped name raises :class:`StateDictMismatchError`
    listing them (nothing is loaded). Otherwise the matching tensors are loaded and the report
    of the rest is returned.
    """
    sd = extract_model_state_dict(state_dict)
    report = compare_state_dict(model, sd)
    if strict and not report.ok:
        raise StateDictMismatchError(report)
    skip = set(report.unexpected) | {n for n, _, _ in report.mismatched}
    model.load_state_dict({k: v for k, v in sd.items() if k not in skip}, strict=False)
    return report


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


# torch.save writes a zip archive (PyTorch >= 1.6) or, in the legacy format, a pickle (protocol 2+).
def read_checkpoint(path_or_obj: PathOrObj, map_location: Union[str, torch.device] = "cpu") -> Mapping[str, Any]:
    """A checkpoint dict: a dict passes through, a path is read by the one loader,
    :func:`scalefold.checkpoint.files.load_checkpoint` (:class:`CheckpointError` naming the file)."""
    if isinstance(path_or_obj, Mapping):
        return path_or_obj
    return load_checkpoint(path_or_obj, map_location=map_location)


def load_reference_checkpoint(
    path_or_obj: PathOrObj,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: Union[str, torch.device] = "cpu",
) -> int:
    """Load the reference's resumable checkpoint into ``model`` (strict) and ``optimizer``.

    The Adam state is indexed in ``model.parameters()`` order; its moments are checked against
    the parameter shapes before loading. Returns the stored ``iteration``.
    """
    ckpt = read_checkpoint(path_or_obj, map_location)
    missing = [
        k for k in (MODEL_KEY, ITERATION_KEY) + ((OPTIMIZER_KEY,) if optimizer is not None else ()) if k not in ckpt
    ]
    if missing:
        raise CheckpointError(
            f"not a reference checkpoint: missing {missing}; found keys {sorted(ckpt)[:MAX_LISTED_NAMES]} "
            f"(expected {MODEL_KEY!r}, {OPTIMIZER_KEY!r}, {ITERATION_KEY!r})"
        )
    load_reference_state_dict(model, ckpt[MODEL_KEY], strict=True)
    if optimizer is not None:
        _check_adam_state(ckpt[OPTIMIZER_KEY], list(model.parameters()))
        optimizer.load_state_dict(ckpt[OPTIMIZER_KEY])
    return int(ckpt[ITERATION_KEY])


def save_reference_checkpoint(
    path: Union[str, os.PathLike[str]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    iteration: int,
) -> None:
    """Write the reference's resumable checkpoint layout."""
    torch.save(
        {ITERATION_KEY: int(iteration), MODEL_KEY: model.state_dict(), OPTIMIZER_KEY: optimizer.state_dict()},
        os.fspath(path),
    )


def _check_adam_state(opt_state: Any, params: Sequence[torch.Tensor]) -> None:
    if not isinstance(opt_state, Mapping) or "state" not in opt_state or "param_groups" not in opt_state:
        raise CheckpointError("optimizer_state_dict is not a torch.optim state dict (needs 'state' and 'param_groups')")
    indices = [i for g in opt_state["param_groups"] for i in g.get("params", [])]
    if len(indices) != len(params):
        raise CheckpointError(f"optimizer_state_dict covers {len(indices)} parameters, the model has {len(params)}")
    bad = []
    for index, param in zip(indices, params):
        state = opt_state["state"].get(index, {})
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state.get(key)
            if moment is not None and tuple(moment.shape) != tuple(param.shape):
                bad.append(f"param {index} {key} {tuple(moment.shape)} vs {tuple(param.shape)}")
    if bad:
        more = f" ... and {len(bad) - MAX_LISTED_NAMES} more" if len(bad) > MAX_LISTED_NAMES else ""
        raise CheckpointError("Adam state does not match the parameters: " + "; ".join(bad[:MAX_LISTED_NAMES]) + more)


def swa_state_dict(model: nn.Module, n_averaged: int) -> dict[str, torch.Tensor]:
    """The reference SWA file layout for the averaged weights held in ``model``."""
    sd: dict[str, torch.Tensor] = {SWA_N_AVERAGED: torch.tensor(int(n_averaged), dtype=torch.long)}
    sd.update({SWA_MODULE_PREFIX + k: v for k, v in model.state_dict().items()})
    return sd


def load_swa_checkpoint(
    path_or_obj: PathOrObj,
    model: nn.Module | None = None,
    map_location: Union[str, torch.device] = "cpu",
) -> tuple[StateDict, int]:
    """Read the reference SWA file; load its weights into ``model`` (strict) when given.

    Returns ``(weights with reference names, n_averaged)``.
    """
    obj = read_checkpoint(path_or_obj, map_location)
    if SWA_N_AVERAGED not in obj:
        raise CheckpointError(
            f"not a reference SWA checkpoint: no {SWA_N_AVERAGED!r}; found keys {sorted(obj)[:MAX_LISTED_NAMES]}"
        )
    others = [k for k in obj if k != SWA_N_AVERAGED and not k.startswith(SWA_MODULE_PREFIX)]
    if others:
        raise CheckpointError(f"unexpected entries in SWA checkpoint: {others[:MAX_LISTED_NAMES]}")
    weights = {k[len(SWA_MODULE_PREFIX) :]: v for k, v in obj.items() if k.startswith(SWA_MODULE_PREFIX)}
    n_averaged = int(obj[SWA_N_AVERAGED])
    if model is not None:
        load_reference_state_dict(model, weights, strict=True)
    return weights, n_averaged


# --------------------------------------------------------------------------------------------
# Upstream OpenFold <-> reference names
# --------------------------------------------------------------------------------------------
# (reference pattern, upstream pattern); groups are carried over. Applied in order, all that match.
_BLOCK = r"(evoformer|extra_msa_stack)\.blocks\.(\d+)\."
_PAIR_OPS = r"(tri_mul_out|tri_mul_in|tri_att_start|tri_att_end|pair_transition)"
_RENAMES: list[tuple[str, str, str, str]] = [
    # (reference regex, reference replacement, upstream regex, upstream replacement)
    (r"^evoformer_stack\.", "evoformer_stack.", r"^evoformer\.", "evoformer."),
    (r"^auxiliary_heads\.", "auxiliary_heads.", r"^aux_heads\.", "aux_heads."),
    (
        r"^template_angle_embedder\.",
        "template_angle_embedder.",
        r"^template_embedder\.template_single_embedder\.",
        "template_embedder.template_single_embedder.",
    ),
    (
        r"^template_pair_embedder\.",
        "template_pair_embedder.",
        r"^template_embedder\.template_pair_embedder\.",
        "template_embedder.template_pair_embedder.",
    ),
    (
        r"^template_pair_stack\.",
        "template_pair_stack.",
        r"^template_embedder\.template_pair_stack\.",
        "template_embedder.template_pair_stack.",
    ),
    (
        r"^template_pointwise_attention\.",
        "template_pointwise_attention.",
        r"^template_embedder\.template_pointwise_att\.",
        "template_embedder.template_pointwise_att.",
    ),
]


def _ref_to_up(name: str) -> str:
    for ref_re, _, _, up_rep in _RENAMES:
        if re.match(ref_re, name):
            name = re.sub(ref_re, up_rep, name, count=1)
            break
    name = re.sub(r"^" + _BLOCK + r"core\.(msa_transition|outer_product_mean)\.", r"\1.blocks.\2.\3.", name)
    name = re.sub(r"^" + _BLOCK + r"core\." + _PAIR_OPS + r"\.", r"\1.blocks.\2.pair_stack.\3.", name)
    name = re.sub(r"^evoformer\.blocks\.(\d+)\.msa_att_col\.", r"evoformer.blocks.\1.msa_att_col._msa_att.", name)
    name = re.sub(
        r"^structure_module\.ipa\.(linear_q_points|linear_kv_points)\.", r"structure_module.ipa.\1.linear.", name
    )
    name = re.sub(r"^structure_module\.transition\.(linear_\d)\.", r"structure_module.transition.layers.0.\1.", name)
    return name


def _up_to_ref(name: str) -> str:
    for _, ref_rep, up_re, _ in _RENAMES:
        if re.match(up_re, name):
            name = re.sub(up_re, ref_rep, name, count=1)
            break
    name = re.sub(
        r"^(evoformer_stack|extra_msa_stack)\.blocks\.(\d+)\.(msa_transition|outer_product_mean)\.",
        r"\1.blocks.\2.core.\3.",
        name,
    )
    name = re.sub(
        r"^(evoformer_stack|extra_msa_stack)\.blocks\.(\d+)\.pair_stack\." + _PAIR_OPS + r"\.",
        r"\1.blocks.\2.core.\3.",
        name,
    )
    name = re.sub(
        r"^evoformer_stack\.blocks\.(\d+)\.msa_att_col\._msa_att\.", r"evoformer_stack.blocks.\1.msa_att_col.", name
    )
    name = re.sub(
        r"^structure_module\.ipa\.(linear_q_points|linear_kv_points)\.linear\.", r"structure_module.ipa.\1.", name
    )
    match = re.match(r"^structure_module\.transition\.layers\.(\d+)\.", name)
    if match:
        if match.group(1) != "0":
            raise CheckpointError(
                f"{name}: the reference structure-module transition has one layer; "
                f"upstream layer {match.group(1)} has no counterpart"
            )
        name = re.sub(r"^structure_module\.transition\.layers\.0\.", "structure_module.transition.", name)
    return name


def _rename_all(sd: Mapping[str, torch.Tensor], fn: Callable[[str], str], what: str) -> StateDict:
    out: StateDict = {}
    for name, tensor in sd.items():
        new = fn(name)
        if new in out:
            raise CheckpointError(f"{what}: two names map to {new!r}")
        out[new] = tensor
    return out


def upstream_openfold_to_reference(state_dict: Mapping[str, torch.Tensor]) -> StateDict:
    """Rename an upstream OpenFold (aqlaboratory/openfold) state dict to reference names."""
    return _rename_all(extract_model_state_dict(state_dict), _up_to_ref, "upstream -> reference")


def reference_to_upstream_openfold(state_dict: Mapping[str, torch.Tensor]) -> StateDict:
    """Rename a reference (MLPerf / ScaleFold) state dict to upstream OpenFold names."""
    return _rename_all(extract_model_state_dict(state_dict), _ref_to_up, "reference -> upstream")


def reference_name_to_upstream(name: str) -> str:
    """Upstream OpenFold name of one reference parameter name."""
    return _ref_to_up(name)


def upstream_name_to_reference(name: str) -> str:
    """Reference name of one upstream OpenFold parameter name."""
    return _up_to_ref(name)


__all__ = [
    "CheckpointError",
    "check_checkpoint_file",
    "StateDictMismatchError",
    "LoadReport",
    "compare_state_dict",
    "extract_model_state_dict",
    "load_reference_state_dict",
    "read_checkpoint",
    "load_reference_checkpoint",
    "save_reference_checkpoint",
    "load_swa_checkpoint",
    "swa_state_dict",
    "upstream_openfold_to_reference",
    "reference_to_upstream_openfold",
    "reference_name_to_upstream",
    "upstream_name_to_reference",
]
