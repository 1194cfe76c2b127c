"""``scalefold predict``: one single-chain target from a FASTA (+ a3m alignments) -> PDB / mmCIF.

Features are AlphaFold's raw features (:func:`scalefold.data.raw_features.build_raw_features`:
sequence + MSAs, no templates) run through the validation data pipeline
(:func:`scalefold.data.pipeline.process_validation_features`: full chain, no crop, one ensemble per
recycling iteration). The model runs every recycling pass without autograd; the structure is the
last pass's ``final_atom_positions`` / ``final_atom_mask`` and the per-residue pLDDT comes from the
lDDT head (:func:`scalefold.model.heads.compute_plddt`, already in the model outputs as ``plddt``).

Input rules (AlphaFold's): letters other than the 20 amino acids become ``X`` (unknown residue);
anything that is not a letter is an error; an alignment's first row is its query and must be the
FASTA sequence (unknown residues may be written as any letter on either side).
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

from scalefold import residue_constants as rc
from scalefold.data.parsers import MsaError
from scalefold.data.parsers.msa import GAP, Msa, merge_msas, parse_fasta, parse_msa_file
from scalefold.inference.structure_io import PredictedStructure, structure_format, write_structure
from scalefold.inference.weights import InferenceError, LoadedModel, default_device, load_model
from scalefold.model import AlphaFoldConfig

PathLike = Union[str, os.PathLike]

_STANDARD = frozenset(rc.restypes)
_ALLOWED = frozenset(string.ascii_uppercase)


@dataclass
class FastaRecord:
    description: str
    sequence: str  # normalised: upper case, non-standard letters -> X
    num_unknown: int

    @property
    def name(self) -> str:
        """First word of the header (AlphaFold's target name), ``query`` when blank."""
        return self.description.split()[0] if self.description.strip() else "query"


def normalize_sequence(sequence: str, where: str = "sequence") -> tuple[str, int]:
    """Upper-case ``sequence``; letters outside the 20 amino acids become ``X``.

    Returns ``(sequence, number of residues mapped to X)``; whitespace is dropped, any other
    non-letter character is an :class:`InferenceError`.
    """
    seq = "".join(sequence.split()).upper()
    if not seq:
        raise InferenceError(f"{where}: empty sequence")
    bad = sorted(set(seq) - _ALLOWED)
    if bad:
        position = min(seq.index(c) for c in bad) + 1
        raise InferenceError(
            f"{where}: characters {''.join(bad)!r} are not amino-acid letters (first at residue {position})"
        )
    unknown = sum(1 for c in seq if c not in _STANDARD)
    return "".join(c if c in _STANDARD else "X" for c in seq), unknown


def read_fasta(path: PathLike) -> FastaRecord:
    """The single record of a FASTA file (one single-chain target)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise InferenceError(f"FASTA file not found: {path}") from exc
    except IsADirectoryError as exc:
        raise InferenceError(f"{path} is a directory, not a FASTA file") from exc
    except UnicodeDecodeError as exc:
        raise InferenceError(f"{path} is not a text FASTA file ({exc.reason})") from exc
    try:
        sequences, descriptions = parse_fasta(text)
    except MsaError as exc:
        raise InferenceError(f"{path}: not a FASTA file: {exc.detail}") from exc
    if not sequences:
        raise InferenceError(f"{path}: no FASTA record (no '>' header line)")
    if len(sequences) > 1:
        raise InferenceError(
            f"{path}: {len(sequences)} records; predict takes one single-chain target (one '>' record)"
        )
    sequence, unknown = normalize_sequence(sequences[0], where=f"{path} record {descriptions[0][:40]!r}")
    return FastaRecord(descriptions[0].strip(), sequence, unknown)


def read_alignment(path: PathLike, sequence: str) -> Msa:
    """Parse an a3m / Stockholm file and check that its query row is ``sequence``."""
    msa = parse_msa_file(path)
    if len(msa) == 0:
        raise InferenceError(f"{path}: the alignment has no sequences")
    query = msa.sequences[0]
    if GAP in query:
        raise InferenceError(f"{path}: the first row (the query) has gaps; it must be the FASTA sequence")
    if len(query) != len(sequence):
        raise InferenceError(
            f"{path}: the query row has {len(query)} residues, the FASTA sequence {len(sequence)}; "
            "the alignment belongs to another sequence"
        )
    normalized, _ = normalize_sequence(query, where=f"{path} query row")
    mismatches = [i for i, (a, b) in enumerate(zip(normalized, sequence)) if a != b and "X" not in (a, b)]
    if mismatches:
        i = mismatches[0]
        raise InferenceError(
            f"{path}: the query row differs from the FASTA sequence at {len(mismatches)} positions "
            f"(first: residue {i + 1}, {normalized[i]} vs {sequence[i]}); the alignment belongs to another sequence"
        )
    return msa


def build_features(
    record: FastaRecord, msas: Sequence[Msa], config: AlphaFoldConfig, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The model batch ``[1, ..., R]`` of one target (validation pipeline, no templates)."""
    from scalefold.data.dataset import add_batch_dim
    from scalefold.data.pipeline import FeatureConfig, process_validation_features
    from scalefold.data.raw_features import build_raw_features

    # Alignment query rows may spell unknown residues differently: the FASTA sequence is row 0.
    rows = [Msa([record.sequence] + m.sequences[1:], m.deletion_matrix, m.descriptions) for m in msas]
    raw = build_raw_features(record.sequence, record.name, rows)
    num_res = len(record.sequence)
    # The validation pipeline also derives the supervised features; there is no structure to give.
    raw["all_atom_positions"] = np.zeros((num_res, rc.atom_type_num, 3), dtype=np.float32)
    raw["all_atom_mask"] = np.zeros((num_res, rc.atom_type_num), dtype=np.float32)
    features = FeatureConfig.from_reference_config(config.to_dict())
    return add_batch_dim(process_validation_features(raw, features, seed=seed))


@torch.no_grad()
def run_model(loaded: LoadedModel, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All recycling passes without autograd; outputs on the CPU."""
    device = next(loaded.model.parameters()).device
    batch = {
        k: v.to(device=device, dtype=torch.float32 if v.is_floating_point() else v.dtype) for k, v in batch.items()
    }
    outputs = loaded.model(batch)
    keys = ("final_atom_positions", "final_atom_mask", "plddt")
    return {k: outputs[k].detach().float().cpu() for k in keys}


@dataclass
class Prediction:
    structure: PredictedStructure
    record: FastaRecord
    loaded: LoadedModel
    num_alignment_rows: int
    out: Path | None = None

    @property
    def mean_plddt(self) -> float:
        return self.structure.mean_plddt


def predict(
    fasta: PathLike,
    checkpoint: PathLike,
    a3m: Sequence[PathLike] = (),
    out: PathLike | None = None,
    preset: str | None = None,
    weights: str = "auto",
    num_recycling: int | None = None,
    seed: int = 0,
    device: Union[str, torch.device, None] = None,
) -> Prediction:
    """Predict the structure of the FASTA's target; write it to ``out`` (``.pdb`` / ``.cif``) when given."""
    if out is not None:
        try:
            structure_format(out)
        except ValueError as exc:
            raise InferenceError(str(exc)) from exc
    record = read_fasta(fasta)
    msas = [read_alignment(path, record.sequence) for path in a3m]
    loaded = load_model(checkpoint, preset=preset, weights=weights, num_recycling=num_recycling,
                        device=device or default_device())  # fmt: skip
    batch = build_features(record, msas, loaded.config, seed=seed)
    outputs = run_model(loaded, batch)
    structure = PredictedStructure(
        sequence=record.sequence,
        atom_positions=outputs["final_atom_positions"][0].numpy(),  # [N_res, 37, 3]
        atom_mask=outputs["final_atom_mask"][0].numpy(),  # [N_res, 37]
        plddt=outputs["plddt"][0].numpy(),  # [N_res]
        name=record.name,
    )
    prediction = Prediction(structure, record, loaded, num_alignment_rows=len(merge_msas(msas)) or 1)
    if out is not None:
        prediction.out = write_structure(structure, out)
    return prediction


__all__ = [
    "FastaRecord",
    "Prediction",
    "build_features",
    "normalize_sequence",
    "predict",
    "read_alignment",
    "read_fasta",
]
