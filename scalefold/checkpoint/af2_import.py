"""Import the weights people have: AlphaFold2's released JAX parameters and OpenFold's checkpoints.

* :func:`import_af2` -- an AlphaFold2 monomer ``.npz`` (``params_model_1.npz`` ... ``params_model_5_ptm.npz``)
  through the mapping of :mod:`scalefold.checkpoint.af2_mapping`;
* :func:`import_openfold` -- an OpenFold checkpoint (``.pt``: a bare state dict, or its training wrapper:
  Lightning ``state_dict`` with ``model.`` names, the ``ema`` weights preferred when present), renamed by
  :func:`scalefold.checkpoint.adapters.upstream_name_to_reference` (same tensors, other names);
* :func:`import_weights` -- either, the format found from the file when not given;
  :func:`imported_checkpoint` -- the result as a reference-layout checkpoint (what ``--init-from``,
  ``evaluate`` and ``predict`` take), :func:`write_imported` writes it atomically.

The target is a model preset (given, or the first of :data:`PRESETS` whose names and shapes the file fits)
or a given model (``scalefold train --init-from params_model_1.npz`` passes its own). What differs is said
in one line and refused: a multimer file, a file of another network, ``model_3``-``model_5`` (no templates)
against a model that embeds templates, a ``_ptm`` file's PAE head against a model without the TM head
(``drop_pae_head`` imports the rest), missing and extra keys (the first few and the count), a key of the
wrong shape (the file, the key, the shapes found and needed), an unreadable or truncated file. Every check
runs before anything is converted; nothing is written unless everything fits.
"""

from __future__ import annotations

import functools
import os
import time
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
import torch.nn as nn

from scalefold.checkpoint import af2_mapping as mapping
from scalefold.checkpoint.adapters import (
    ITERATION_KEY,
    MODEL_KEY,
    extract_model_state_dict,
    read_checkpoint,
    upstream_name_to_reference,
)
from scalefold.checkpoint.files import CheckpointError, save_atomic, sha256sum
from scalefold.model import AlphaFold, AlphaFoldConfig

PathLike = Union[str, "os.PathLike[str]"]
FORMATS = ("af2", "openfold")
#: Presets tried, smallest first, when none is given.
PRESETS = ("tiny", "demo", "demo-wide", "mlperf")
SHOWN = 5  # names listed per problem
IMPORT_KEY = "imported_from"

#: Key fragments only AlphaFold-Multimer files have (relative position encoding, per-feature template
#: embeddings, fused triangle projections).
MULTIMER_MARKERS = ("~_relative_encoding", "/template_pair_embedding_", "/query_embedding_norm",
                    "/left_norm_input", "/triangle_multiplication_outgoing/projection",
                    "/triangle_multiplication_incoming/projection")  # fmt: skip
#: OpenFold names only its multimer model has.
OPENFOLD_MULTIMER_MARKERS = ("linear_ab_p", "linear_ab_g", "dgram_linear", "template_single_embedder.template_")


class WeightsImportError(CheckpointError):
    """A parameter file that cannot be imported; the message names the file and what differs."""

    label = "import error"


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _listed(names: list[str]) -> str:
    more = f", ... ({len(names):,} in all)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


@dataclass
class ImportedWeights:
    """A state dict with ScaleFold names, where it came from and what was left out."""

    state_dict: dict[str, torch.Tensor]
    source: str
    source_format: str
    preset: str | None
    description: str
    notes: list[str] = field(default_factory=list)
    entries: list[mapping.Entry] | None = None  # AlphaFold2 files: the mapping used, one entry per parameter
    seconds: float = 0.0

    @property
    def num_values(self) -> int:
        return sum(t.numel() for t in self.state_dict.values())

    def summary(self) -> str:
        """One line: what was imported, into what, how long it took."""
        target = f"preset {self.preset}" if self.preset else "the run's model"
        notes = "; " + "; ".join(self.notes) if self.notes else ""
        return (f"imported {self.source} ({self.description}): {_plural(len(self.state_dict), 'parameter')}, "
                f"{self.num_values:,} values for {target} in {self.seconds:.1f} s{notes}")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------


@functools.cache
def _preset_shapes(preset: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = AlphaFold(AlphaFoldConfig.from_preset(preset), activation_checkpointing=False)
    return tuple(model_shapes(model).items())


def preset_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a preset's model (built once on the meta device: no memory)."""
    return dict(_preset_shapes(preset))


def model_shapes(model: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    return {name: tuple(t.shape) for name, t in sd.items()}


def _targets(preset: str | None, model: nn.Module | None) -> list[tuple[str | None, dict[str, tuple[int, ...]]]]:
    if model is not None:
        return [(None, model_shapes(model))]
    if preset is not None:
        from scalefold.model.config import PRESETS as KNOWN

        if preset not in KNOWN:
            raise WeightsImportError(f"unknown preset {preset!r}; expected one of {sorted(KNOWN)}")
        return [(preset, preset_shapes(preset))]
    return [(p, preset_shapes(p)) for p in PRESETS]


def _target_name(preset: str | None) -> str:
    return f"preset {preset!r}" if preset else "the run's model"


def _groups(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, bool]:
    """Which optional parameter groups a target model has."""
    return {g: any(n.startswith(marker) for n in shapes) for g, marker in mapping.GROUP_MARKERS.items()}


def _choose(path: str, targets, family: Mapping[str, bool], drop_pae: bool, pae_names: list[str], plan):
    """(preset, plan's result, notes) for the first target ``plan(shapes, target name, skipped keys)`` finds
    no problem with; else an error naming the (closest) target's first problem. An architecture difference
    every target shares is said once, for all of them."""
    kinds = {tuple(sorted(_groups(shapes).items())) for _, shapes in targets}
    notes: list[str] = []
    if len(kinds) == 1:
        everyone = "every ScaleFold preset" if len(targets) > 1 else _target_name(targets[0][0])
        problems, notes = _architecture_problems(family, dict(next(iter(kinds))), everyone, drop_pae,
                                                 _listed(pae_names))  # fmt: skip
        if problems:
            raise WeightsImportError(f"{path}: {problems[0]}")
    tried = []
    for preset, shapes in targets:
        target = _target_name(preset)
        problems, own_notes = _architecture_problems(family, _groups(shapes), target, drop_pae, _listed(pae_names))
        skipped = pae_names if family["pae_head"] and not _groups(shapes)["pae_head"] else []
        result, more_problems = plan(shapes, target, skipped) if not problems else (None, [])
        problems += more_problems
        if not problems:
            return preset, result, notes or own_notes
        tried.append((len(problems), preset, problems))
    count, preset, problems = min(tried, key=lambda t: t[0])
    more = f" (and {_plural(count - 1, 'more problem')})" if count > 1 else ""
    if len(tried) > 1:
        raise WeightsImportError(f"{path}: fits no preset of {list(PRESETS)}; against the closest, {preset!r}: "
                                 f"{problems[0]}{more}")  # fmt: skip
    raise WeightsImportError(f"{path}: {problems[0]}{more}")


# --------------------------------------------------------------------------------------------
# AlphaFold2 (.npz)
# --------------------------------------------------------------------------------------------


def read_npz(path: PathLike) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` (no pickles), float arrays only, all finite; errors name the file and key."""
    path = os.fspath(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, OSError) and exc.filename is not None and not Path(path).is_file():
            raise
        raise WeightsImportError(f"{path}: not a readable .npz file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise WeightsImportError(f"{path}: a single .npy array, not an .npz of named parameters")
    arrays: dict[str, np.ndarray] = {}
    with archive:
        for key in archive.files:
            try:
                array = archive[key]
            except Exception as exc:  # noqa: BLE001 -- zlib/zip/format errors of a damaged member
                damaged = isinstance(exc, (zipfile.BadZipFile, EOFError, zlib.error)) or "CRC" in str(exc)
                why = "the file is truncated or corrupt " if damaged else ""
                raise WeightsImportError(f"{path}: key {key!r} cannot be read: {why}({type(exc).__name__}: "
                                         f"{exc})") from exc  # fmt: skip
            if array.dtype.kind != "f":
                raise WeightsImportError(f"{path}: key {key!r} holds {array.dtype} values, expected floating point")
            bad = array.size - int(np.count_nonzero(np.isfinite(array)))
            if bad:
                raise WeightsImportError(f"{path}: key {key!r} {tuple(array.shape)} has {_plural(bad, 'non-finite value')}")
            arrays[key] = array
    if not arrays:
        raise WeightsImportError(f"{path}: an empty .npz (no parameters)")
    return arrays


def af2_family(path: str, keys: Iterable[str]) -> dict[str, bool]:
    """``{"templates": ..., "pae_head": ...}`` of an AlphaFold2 monomer file; other files refused in one line."""
    keys = list(keys)
    if not any("//" in k for k in keys):
        raise WeightsImportError(f"{path}: not a haiku parameter file (no 'module//parameter' keys; first keys: "
                           f"{_listed(keys)})")  # fmt: skip
    foreign = [k for k in keys if not k.startswith(mapping.AF2_PREFIX)]
    if foreign:
        raise WeightsImportError(f"{path}: not AlphaFold2 parameters: {_plural(len(foreign), 'key')} outside "
                           f"{mapping.AF2_PREFIX}: {_listed(foreign)}")  # fmt: skip
    multimer = [k for k in keys if any(m in k for m in MULTIMER_MARKERS)]
    if multimer:
        raise WeightsImportError(f"{path}: AlphaFold-Multimer parameters ({_listed(multimer)}); ScaleFold trains the "
                           f"monomer model: use params_model_1.npz ... params_model_5_ptm.npz")  # fmt: skip
    return {"templates": any(k.startswith(mapping.AF2_PREFIX + mapping.TEMPLATE) for k in keys),
            "pae_head": any(k.startswith(mapping.AF2_PREFIX + "predicted_aligned_error_head/") for k in keys)}  # fmt: skip


def describe_af2(family: Mapping[str, bool]) -> str:
    """Which released model a file of this family is."""
    models = "model_1/model_2" if family["templates"] else "model_3/4/5"
    return f"AlphaFold2 {models}{'_ptm' if family['pae_head'] else ''}"


def _architecture_problems(family: Mapping[str, bool], has: Mapping[str, bool], target: str, drop_pae: bool,
                           pae_names: str) -> tuple[list[str], list[str]]:  # fmt: skip
    """(problems, notes) of an architecture difference between the file and the target model."""
    problems, notes = [], []
    if has["templates"] and not family["templates"]:
        problems.append(f"no template parameters (model_3 ... model_5 were trained without templates), but {target} "
                        "embeds templates: use params_model_1 or params_model_2 (or their _ptm)")  # fmt: skip
    if family["templates"] and not has["templates"]:
        problems.append(f"has template parameters (model_1/model_2) that {target} lacks (it embeds no templates)")
    if family["pae_head"] and not has["pae_head"]:
        if drop_pae:
            notes.append(f"left out the predicted-aligned-error head ({pae_names}): the ScaleFold model has no TM head")
        else:
            problems.append(f"has the predicted-aligned-error head of the _ptm models ({pae_names}), which {target} "
                            "lacks (no TM head); `scalefold import-weights --drop-pae-head` imports the rest")  # fmt: skip
    if has["pae_head"] and not family["pae_head"]:
        problems.append(f"has no predicted-aligned-error head, but {target} has a TM head: use a _ptm file")
    return problems, notes


def _plan_af2(arrays: Mapping[str, np.ndarray], shapes, target: str, skipped: list[str]) -> tuple[Any, list[str]]:
    """(the entries, problems) of importing ``arrays`` (less ``skipped``) into a model of ``shapes``."""
    has = _groups(shapes)
    groups = ["core"] + [g for g in ("templates", "pae_head") if has[g]]
    entries, uncovered = mapping.expand(shapes, groups)
    problems = []
    if uncovered:
        problems.append(f"{_plural(len(uncovered), 'parameter')} of {target} the mapping does not cover: "
                        f"{_listed(uncovered)}")  # fmt: skip
    by_key = mapping.source_keys(entries)
    missing = [k for k in by_key if k not in arrays]
    extra = [k for k in arrays if k not in by_key and k not in skipped]
    if missing:
        problems.append(f"missing {_plural(len(missing), 'key')} that {target} needs: {_listed(missing)}")
    if extra:
        problems.append(f"{_plural(len(extra), 'key')} that no parameter of {target} takes: {_listed(extra)}")
    return entries, problems + _shape_problems(arrays, by_key, shapes, target)


def _shape_problems(arrays, by_key, shapes, target: str) -> list[str]:
    problems = []
    for key, entries in by_key.items():
        if key not in arrays:
            continue
        found = tuple(arrays[key].shape)
        first = entries[0]
        layout = mapping.TRANSFORMS[first.transform]
        if first.block is not None and (len(found) < 1 or found[0] != len(entries)):
            blocks = found[0] if found else 0
            problems.append(f"key {key!r} {found}: {blocks} stacked blocks on axis 0, {target} has {len(entries)}")
            continue
        for entry in entries:
            got = mapping.converted_shape(entry, found)
            if got != shapes[entry.target]:
                stacked = "[blocks] + " if entry.block is not None else ""
                problems.append(f"key {key!r} has shape {found} ({stacked}{layout.source_layout}), which gives "
                                f"{got if got else 'nothing (wrong rank)'}; {entry.target} of {target} needs "
                                f"{shapes[entry.target]} ({layout.target_layout})")  # fmt: skip
                break
    return problems


def import_af2(path: PathLike, preset: str | None = None, model: nn.Module | None = None,
               drop_pae_head: bool = False) -> ImportedWeights:  # fmt: skip
    """An AlphaFold2 monomer ``.npz`` -> ScaleFold weights for ``preset`` / ``model`` (default: the first
    preset it fits)."""
    start = time.perf_counter()
    path = os.fspath(path)
    arrays = read_npz(path)
    family = af2_family(path, arrays)
    pae = [k for k in arrays if k.startswith(mapping.AF2_PREFIX + "predicted_aligned_error_head/")]
    chosen, entries, notes = _choose(path, _targets(preset, model), family, drop_pae_head, pae,
                                     lambda shapes, target, skipped: _plan_af2(arrays, shapes, target, skipped))
    state = {e.target: torch.from_numpy(mapping.convert(e, arrays[e.source]).astype(np.float32)) for e in entries}
    return ImportedWeights(state, path, "af2", chosen, describe_af2(family), notes, entries,
                           time.perf_counter() - start)  # fmt: skip


# --------------------------------------------------------------------------------------------
# OpenFold (.pt)
# --------------------------------------------------------------------------------------------


def unwrap_openfold(path: str, obj: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """(the model weights with OpenFold's names, which weights) of an OpenFold checkpoint or its wrapper."""
    if isinstance(obj.get("ema"), Mapping) and isinstance(obj["ema"].get("params"), Mapping):
        sd, which = obj["ema"]["params"], "EMA weights"
    elif isinstance(obj.get("state_dict"), Mapping):  # PyTorch Lightning: the module's attributes
        sd, which = obj["state_dict"], "training weights"
        if sd and all(k.startswith("model.") for k in sd):
            sd = {k[len("model.") :]: v for k, v in sd.items()}
        else:
            sd = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")} or sd
    else:
        sd, which = obj, "weights"
    try:
        return extract_model_state_dict(sd), which
    except CheckpointError as exc:
        raise WeightsImportError(f"{path}: {exc}") from exc


def looks_like_reference(names: Iterable[str]) -> bool:
    return any(n.startswith(("evoformer_stack.", "auxiliary_heads.")) for n in names)


def _plan_openfold(sd: Mapping[str, torch.Tensor], shapes, target: str, skipped: list[str]) -> tuple[Any, list[str]]:
    """(the weights kept, problems) of loading ``sd`` (less ``skipped``) into a model of ``shapes``."""
    kept = {k: v for k, v in sd.items() if k not in skipped}
    missing = [n for n in shapes if n not in kept]
    extra = [n for n in kept if n not in shapes]
    wrong = [f"{n} {tuple(kept[n].shape)} vs {shapes[n]}" for n in shapes if n in kept and tuple(kept[n].shape) != shapes[n]]
    problems = []
    if missing:
        problems.append(f"missing {_plural(len(missing), 'parameter')} that {target} needs: {_listed(missing)}")
    if extra:
        problems.append(f"{_plural(len(extra), 'parameter')} that {target} lacks: {_listed(extra)}")
    if wrong:
        problems.append(f"{_plural(len(wrong), 'parameter')} of the wrong shape (file vs {target}): {_listed(wrong)}")
    return kept, problems


def import_openfold(path: PathLike, preset: str | None = None, model: nn.Module | None = None,
                    drop_pae_head: bool = False, obj: Mapping[str, Any] | None = None) -> ImportedWeights:  # fmt: skip
    """An OpenFold checkpoint (``obj``: its contents, already read) -> ScaleFold weights (renamed; the
    tensors are the same)."""
    start = time.perf_counter()
    path = os.fspath(path)
    if obj is None:
        try:
            obj = read_checkpoint(path)
        except CheckpointError as exc:
            raise WeightsImportError(str(exc)) from exc
    upstream, which = unwrap_openfold(path, obj)
    if looks_like_reference(upstream):
        raise WeightsImportError(f"{path}: already a ScaleFold / MLPerf reference checkpoint (reference names); "
                           "--init-from, evaluate and predict take it as it is")  # fmt: skip
    multimer = [n for n in upstream if any(m in n for m in OPENFOLD_MULTIMER_MARKERS)]
    if multimer:
        raise WeightsImportError(f"{path}: an OpenFold multimer checkpoint ({_listed(multimer)}); ScaleFold trains the "
                           "monomer model")  # fmt: skip
    try:
        sd = {upstream_name_to_reference(n): t for n, t in upstream.items()}
    except CheckpointError as exc:
        raise WeightsImportError(f"{path}: {exc}") from exc
    if len(sd) != len(upstream):
        raise WeightsImportError(f"{path}: two OpenFold names map to one ScaleFold parameter")
    bad = [n for n, t in sd.items() if not t.is_floating_point()]
    if bad:
        raise WeightsImportError(f"{path}: {_plural(len(bad), 'parameter')} not floating point: {_listed(bad)}")
    family = {"templates": any(n.startswith("template_") for n in sd),
              "pae_head": any(n.startswith("auxiliary_heads.tm.") for n in sd)}  # fmt: skip
    pae = [n for n in sd if n.startswith("auxiliary_heads.tm.")]
    chosen, kept, notes = _choose(path, _targets(preset, model), family, drop_pae_head, pae,
                                  lambda shapes, target, skipped: _plan_openfold(sd, shapes, target, skipped))
    state = {n: t.detach().to(torch.float32).contiguous() for n, t in kept.items()}
    templ = "templates" if family["templates"] else "no templates"
    description = f"OpenFold checkpoint, {which}, {templ}{', TM head' if family['pae_head'] else ''}"
    return ImportedWeights(state, path, "openfold", chosen, description, notes, None, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------
# Either
# --------------------------------------------------------------------------------------------


def detect_format(path: PathLike) -> str | None:
    """``"af2"`` (an ``.npz``), ``"openfold"`` (a torch checkpoint), or ``None`` when neither."""
    path = os.fspath(path)
    with open(path, "rb"):  # a missing or unreadable file: its OSError, naming it
        pass
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError):
            names = []
        if any(n.endswith(".npy") for n in names):
            return "af2"
        if any(n.endswith("data.pkl") for n in names):
            return "openfold"
    if path.lower().endswith(".npz"):
        return "af2"  # a damaged one: the reader says what is wrong with it
    with open(path, "rb") as handle:
        head = handle.read(2)
    if head[:1] == b"\x80" or path.lower().endswith((".pt", ".pth", ".ckpt")):
        return "openfold"
    return None


def looks_like_openfold(obj: Mapping[str, Any]) -> bool:
    """Whether a torch checkpoint's contents are OpenFold's (not a reference-layout or ScaleFold checkpoint)."""
    if MODEL_KEY in obj or "averaged_model.n_averaged" in obj:
        return False
    try:
        names = list(unwrap_openfold("", obj)[0])
    except WeightsImportError:
        return False
    return any(n.startswith(("evoformer.", "aux_heads.", "template_embedder.")) for n in names)


def read_init_source(path: PathLike, model: nn.Module, say=None) -> dict[str, Any]:
    """The reference-layout checkpoint ``--init-from path`` starts ``model`` from: an AlphaFold2 ``.npz`` or an
    OpenFold checkpoint imported on the way (``say`` gets the one-line summary), anything else read as it is."""
    if Path(path).is_file() and detect_format(path) == "af2":
        result = import_af2(path, model=model)
    else:
        ckpt = read_checkpoint(os.fspath(path))
        if not looks_like_openfold(ckpt):
            return dict(ckpt)
        result = import_openfold(path, model=model, obj=ckpt)
    if say is not None:
        say(result.summary())
    return imported_checkpoint(result, with_hash=False)


def import_weights(path: PathLike, source_format: str | None = None, preset: str | None = None,
                   model: nn.Module | None = None, drop_pae_head: bool = False) -> ImportedWeights:  # fmt: skip
    """Import an AlphaFold2 ``.npz`` or an OpenFold checkpoint (``source_format`` found from the file when
    ``None``) for ``preset`` or ``model``."""
    fmt = source_format or detect_format(path)
    if fmt is None:
        raise WeightsImportError(f"{os.fspath(path)}: neither an AlphaFold2 .npz nor a PyTorch checkpoint; "
                           "give --from af2 or --from openfold")  # fmt: skip
    if fmt not in FORMATS:
        raise WeightsImportError(f"unknown source format {fmt!r}; expected one of {list(FORMATS)}")
    fn = import_af2 if fmt == "af2" else import_openfold
    return fn(path, preset=preset, model=model, drop_pae_head=drop_pae_head)


def imported_checkpoint(result: ImportedWeights, with_hash: bool = True) -> dict[str, Any]:
    """The reference-layout checkpoint of ``result``: weights, iteration 0, no optimizer state (Adam
    starts fresh), and where the weights came from."""
    provenance = {"file": os.path.basename(result.source), "format": result.source_format,
                  "description": result.description, "notes": list(result.notes)}  # fmt: skip
    if with_hash:
        provenance["sha256"] = sha256sum(result.source)
    ckpt: dict[str, Any] = {MODEL_KEY: result.state_dict, ITERATION_KEY: 0, IMPORT_KEY: provenance}
    if result.preset:
        ckpt["model_preset"] = result.preset
    return ckpt


def write_imported(result: ImportedWeights, out: PathLike) -> Path:
    """Write :func:`imported_checkpoint` to ``out`` atomically (a failure leaves no partial file)."""
    if Path(out).resolve() == Path(result.source).resolve():
        raise WeightsImportError(f"--out {out} is the source file itself")
    return save_atomic(imported_checkpoint(result), out)


__all__ = [
    "FORMATS", "WeightsImportError", "ImportedWeights", "PRESETS", "af2_family", "describe_af2", "detect_format",
    "import_af2", "import_openfold", "import_weights", "imported_checkpoint", "looks_like_openfold",
    "model_shapes", "preset_shapes", "read_init_source", "read_npz", "unwrap_openfold", "write_imported",
]  # fmt: skip
