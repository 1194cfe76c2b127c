"""How good is one prediction: lDDT-Cα against a true structure, and the Cα geometry of any prediction.

``scalefold predict --reference TRUE.pdb|cif`` prints both. The geometry needs no reference and tells a
collapsed or exploded prediction at a glance:

* consecutive Cα–Cα distance (mean / min / max): 3.80 Å in real proteins (3.0 Å for the rare
  cis-proline); a structure module that has not learned yet puts residues on top of each other;
* radius of gyration of the Cα atoms against ``2.2 · N^0.38`` Å, the value of real globular proteins
  of ``N`` residues (Skolnick et al.); the synthetic demo store folds chains to ~1.25x that.

The true structure is read with gemmi (PDB or mmCIF): its first model's first polymer chain, matched
to the prediction residue by residue (the residue numbers 1..N when they fit, else in order); a
sequence that differs from the prediction's is refused naming the first difference. Residues
without a Cα in the true structure are left out of the lDDT (the metric's mask).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from scalefold.errors import UserError

#: Radius of gyration of real globular proteins: ``RG_PREFACTOR * N ** RG_EXPONENT`` Å.
RG_PREFACTOR = 2.2
RG_EXPONENT = 0.38
#: Consecutive Cα distance of a trans peptide bond (Å).
CA_CA_TRANS = 3.80


@dataclasses.dataclass
class CaGeometry:
    """Cα geometry of one chain (Å)."""

    num_residues: int
    ca_ca_mean: float
    ca_ca_min: float
    ca_ca_max: float
    radius_of_gyration: float

    @property
    def expected_radius_of_gyration(self) -> float:
        return RG_PREFACTOR * self.num_residues**RG_EXPONENT

    def describe(self) -> list[str]:
        rg_ratio = self.radius_of_gyration / self.expected_radius_of_gyration
        return [
            f"consecutive Cα distance: mean {self.ca_ca_mean:.2f} Å, min {self.ca_ca_min:.2f}, max {self.ca_ca_max:.2f} "
            f"(real proteins: {CA_CA_TRANS:.2f})",
            f"radius of gyration: {self.radius_of_gyration:.2f} Å ({rg_ratio:.2f}x the "
            f"{self.expected_radius_of_gyration:.2f} Å of a real protein of {self.num_residues} residues, "
            f"{RG_PREFACTOR}·N^{RG_EXPONENT})",
        ]


def ca_geometry(ca: np.ndarray, mask: np.ndarray | None = None) -> CaGeometry:
    """Geometry of Cα positions ``[N, 3]`` (``mask`` ``[N]``: present atoms; consecutive pairs need both)."""
    ca = np.asarray(ca, np.float64)
    mask = np.ones(len(ca), bool) if mask is None else np.asarray(mask) > 0
    pairs = mask[1:] & mask[:-1]
    steps = np.linalg.norm(ca[1:] - ca[:-1], axis=-1)[pairs]
    present = ca[mask]
    rg = float(np.sqrt(np.mean(np.sum((present - present.mean(0)) ** 2, axis=-1)))) if len(present) else math.nan
    nan = math.nan
    return CaGeometry(
        num_residues=int(len(ca)),
        ca_ca_mean=float(steps.mean()) if steps.size else nan,
        ca_ca_min=float(steps.min()) if steps.size else nan,
        ca_ca_max=float(steps.max()) if steps.size else nan,
        radius_of_gyration=rg,
    )


def read_reference_ca(path: str | os.PathLike[str], sequence: str) -> tuple[np.ndarray, np.ndarray]:
    """Cα positions ``[N, 3]`` and mask ``[N]`` of the true structure, aligned to ``sequence``."""
    import gemmi

    path = Path(path)
    try:
        structure = gemmi.read_structure(str(path))
    except (RuntimeError, ValueError) as exc:
        raise UserError(f"--reference {path}: not a readable PDB / mmCIF file ({str(exc).splitlines()[0]})") from exc
    structure.setup_entities()
    if len(structure) == 0:
        raise UserError(f"--reference {path}: no model (no atoms) in the file")
    chains = [chain for chain in structure[0] if len(chain.get_polymer()) > 0]
    if not chains:
        raise UserError(f"--reference {path}: no protein chain in the file")
    residues = list(chains[0].get_polymer())
    numbers = [r.seqid.num for r in residues]
    by_number = all(1 <= n <= len(sequence) for n in numbers) and len(set(numbers)) == len(numbers)
    if not by_number and len(residues) != len(sequence):
        raise UserError(
            f"--reference {path}: chain {chains[0].name} has {len(residues)} residues, the prediction "
            f"{len(sequence)} (and its residue numbers are not 1..{len(sequence)})"
        )
    ca = np.zeros((len(sequence), 3))
    mask = np.zeros(len(sequence), bool)
    for k, residue in enumerate(residues):
        i = residue.seqid.num - 1 if by_number else k
        info = gemmi.find_tabulated_residue(residue.name)
        letter = info.one_letter_code.upper() if info is not None and info.one_letter_code.strip() else "X"
        if "X" not in (letter, sequence[i]) and letter != sequence[i]:
            raise UserError(
                f"--reference {path}: residue {i + 1} is {residue.name} ({letter}), the prediction's is "
                f"{sequence[i]}: the true structure is of another sequence"
            )
        atom = residue.find_atom("CA", "*")
        if atom is not None:
            ca[i] = (atom.pos.x, atom.pos.y, atom.pos.z)
            mask[i] = True
    if not mask.any():
        raise UserError(f"--reference {path}: no Cα atom matches the prediction's residues")
    return ca, mask


def lddt_ca_against(predicted_ca: np.ndarray, true_ca: np.ndarray, true_mask: np.ndarray) -> float:
    """The MLPerf lDDT-Cα of one prediction against the true Cα positions (masked residues left out)."""
    import torch

    from scalefold.lddt import CA_ATOM37_INDEX, validation_lddt_ca

    n = len(predicted_ca)
    pred = torch.zeros(n, 37, 3, dtype=torch.float64)
    true = torch.zeros(n, 37, 3, dtype=torch.float64)
    mask = torch.zeros(n, 37, dtype=torch.float64)
    pred[:, CA_ATOM37_INDEX] = torch.as_tensor(np.asarray(predicted_ca, np.float64))
    true[:, CA_ATOM37_INDEX] = torch.as_tensor(np.asarray(true_ca, np.float64))
    mask[:, CA_ATOM37_INDEX] = torch.as_tensor(np.asarray(true_mask, np.float64))
    return float(validation_lddt_ca(pred, true, mask))


__all__ = ["CaGeometry", "ca_geometry", "lddt_ca_against", "read_reference_ca"]
