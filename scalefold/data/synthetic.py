"""Synthetic protein-like chains: the built-in default dataset (``scalefold synth``).

A fresh machine has no PDB and no alignments, yet ``scalefold train`` should run and visibly
learn. This module writes a deterministic store (the same HDF5 format as ``scalefold
preprocess``) of chains that look and behave like proteins:

* **Folds** — each family has a fold template: a sequence of secondary-structure segments
  (alpha helices, beta strands joined by hairpin turns, loops) with realistic (phi, psi) from
  the Ramachandran basins. Backbones are built from those torsions with ideal bond lengths and
  angles (NeRF; the per-residue-type N-CA / CA-C lengths and N-CA-C angle of the AlphaFold
  literature geometry), loops are chosen among several candidates to keep the chain compact
  and clash-free, so there are long-range contacts to learn.
* **All atoms** — backbone frames from (N, CA, C) (Alg. 21) and sampled rotamer chi angles go
  through the model's own rigid-group machinery (:mod:`scalefold.model.all_atom`, Alg. 24):
  O from psi, side chains from chi, with ideal geometry. Rotamers are packed greedily among a
  few candidates per residue to avoid clashes.
* **Sequences with a signal** — a family profile per position derived from secondary-structure
  propensities (Chou-Fasman) and burial (Kyte-Doolittle hydrophobicity; buried positions are
  hydrophobic and more conserved), glycine where phi > 0, proline only where phi ~ -65.
  Family members are mutants of a family ancestor and share the fold (template torsions plus
  a little noise).
* **MSAs with co-evolution** — per chain, rows are mutants of the query at a spread of
  divergences; residue pairs in contact in the fold (C-beta within a cut-off) mutate *together*
  between a few allowed pair states, so contacts are visible as co-variation. Rows carry
  realistic gaps (fragments, gap runs in loops) and insertions (deletion counts in loops).
* **Chain table** — release dates before the MLPerf training cut-off (a held-out fraction of
  family members gets dates in the CAMEO validation window), X-ray resolutions, cluster id =
  family, so the reference training filters keep every training chain.

Everything is drawn from ``numpy.random.Generator`` streams spawned from one seed per family,
so the output depends only on the arguments (not on worker count or timing).

Entry points: :func:`synthesize` (write a store), :func:`generate_family` (in memory), and the
geometry helpers :func:`build_backbone` / :func:`backbone_to_atom14` used by the tests.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from collections.abc import Sequence
from typing import Any, Union

import numpy as np
import torch

from scalefold import residue_constants as rc
from scalefold.model.all_atom import (
    frames_and_literature_positions_to_atom14_pos,
    rigid_group_constants,
    torsion_angles_to_frames,
)
from scalefold.model.rigid import Rigid

PathLike = Union[str, os.PathLike]

# ---------------------------------------------------------------------------------------------
# Physical constants (degrees / Angstrom). Ramachandran basins and rotamers are textbook values.
# ---------------------------------------------------------------------------------------------

HELIX, STRAND, LOOP = 0, 1, 2
SS_NAMES = ("helix", "strand", "loop")

# (phi, psi) centres of the secondary-structure basins.
HELIX_PHI_PSI = (-63.0, -42.0)  # right-handed alpha helix
STRAND_PHI_PSI = (-120.0, 130.0)  # (twisted) beta strand
# Loop residues: mixture of Ramachandran basins: (weight, phi, psi).
LOOP_BASINS = (
    (0.35, -75.0, 145.0),  # polyproline II
    (0.20, -120.0, 130.0),  # beta
    (0.30, -65.0, -40.0),  # alpha-R
    (0.10, 60.0, 40.0),  # alpha-L (glycine-rich)
    (0.05, -90.0, 0.0),  # bridge
)
# Type I' beta-hairpin turn: two residues joining antiparallel strands.
HAIRPIN_TURN = ((60.0, 30.0), (90.0, 0.0))
OMEGA_TRANS = 180.0

# Peptide-bond geometry between residues (Engh & Huber, as in residue_constants).
C_N_BOND = rc.between_res_bond_length_c_n[0]  # 1.329 A
CA_C_N_ANGLE = math.degrees(math.acos(rc.between_res_cos_angles_ca_c_n[0]))  # 116.6 deg
C_N_CA_ANGLE = math.degrees(math.acos(rc.between_res_cos_angles_c_n_ca[0]))  # 121.4 deg

# Rotamer wells for chi angles (degrees): gauche-, trans, gauche+.
CHI_WELLS = (-65.0, 180.0, 62.0)
# Per residue: the candidate values of each chi (chi1..chi4), as (values, probabilities).
_SP3 = (CHI_WELLS, (0.55, 0.33, 0.12))
_FLAT_PLUS = ((-65.0, 180.0, 62.0), (0.50, 0.35, 0.15))
ROTAMERS: dict[str, tuple] = {
    "ARG": (_SP3, _SP3, ((180.0, -65.0, 65.0), (0.7, 0.15, 0.15)), ((180.0, -85.0, 85.0), (0.6, 0.2, 0.2))),
    "ASN": (_SP3, ((-60.0, 30.0, 120.0, -120.0), (0.3, 0.3, 0.2, 0.2))),
    "ASP": (_SP3, ((0.0, 30.0, -30.0, 60.0), (0.4, 0.2, 0.2, 0.2))),
    "CYS": (_SP3,),
    "GLN": (_SP3, _SP3, ((0.0, 60.0, -60.0, 180.0), (0.4, 0.2, 0.2, 0.2))),
    "GLU": (_SP3, _SP3, ((0.0, 30.0, -30.0, 60.0), (0.4, 0.2, 0.2, 0.2))),
    "HIS": (_SP3, ((-75.0, 90.0, 180.0), (0.4, 0.4, 0.2))),
    "ILE": (((-65.0, 62.0, 180.0), (0.6, 0.25, 0.15)), ((170.0, -60.0, 65.0), (0.6, 0.25, 0.15))),
    "LEU": (((-65.0, 180.0, 62.0), (0.6, 0.35, 0.05)), ((65.0, 175.0, -60.0), (0.6, 0.3, 0.1))),
    "LYS": (_SP3, _SP3, ((180.0, -65.0, 65.0), (0.7, 0.15, 0.15)), ((180.0, -65.0, 65.0), (0.7, 0.15, 0.15))),
    "MET": (_SP3, _SP3, ((-70.0, 180.0, 70.0), (0.4, 0.3, 0.3))),
    "PHE": (_SP3, ((90.0, -90.0, 0.0), (0.5, 0.4, 0.1))),
    "PRO": (((30.0, -25.0), (0.5, 0.5)),),  # chi2 follows chi1 (ring closure): PRO_CHI2
    "SER": (_FLAT_PLUS,),
    "THR": (((62.0, -65.0, 180.0), (0.5, 0.4, 0.1)),),
    "TRP": (_SP3, ((-90.0, 90.0, 0.0), (0.4, 0.4, 0.2))),
    "TYR": (_SP3, ((90.0, -90.0, 0.0), (0.5, 0.4, 0.1))),
    "VAL": (((175.0, -60.0, 63.0), (0.7, 0.2, 0.1)),),
}
# Proline ring pucker: chi2 ~ -1.25 * chi1 closes the ring (C-gamma endo / exo).
PRO_CHI2_PER_CHI1 = -1.25

# Amino-acid tables in ``rc.restypes`` order (A R N D C Q E G H I L K M F P S T W Y V).
BACKGROUND_FREQUENCY = np.array(
    [.083, .055, .041, .055, .014, .039, .067, .071, .023, .059,
     .097, .058, .024, .039, .047, .066, .053, .011, .029, .069]
)  # fmt: skip
# Chou-Fasman propensities (helix, strand, turn), x100.
CHOU_FASMAN = (
    np.array(
        [
            [142, 98, 67, 101, 70, 111, 151, 57, 100, 108, 121, 116, 145, 113, 57, 77, 83, 108, 69, 106],
            [83, 93, 89, 54, 119, 110, 37, 75, 87, 160, 130, 74, 105, 138, 55, 75, 119, 137, 147, 170],
            [66, 95, 156, 146, 119, 98, 74, 156, 95, 47, 59, 101, 60, 60, 152, 143, 96, 96, 114, 50],
        ],
        dtype=np.float64,
    )
    / 100.0
)
KYTE_DOOLITTLE = np.array(
    [1.8, -4.5, -3.5, -3.5, 2.5, -3.5, -3.5, -0.4, -3.2, 4.5,
     3.8, -3.9, 1.9, 2.8, -1.6, -0.8, -0.7, -0.9, -1.3, 4.2]
)  # fmt: skip
GLY = rc.restype_order["G"]
PRO = rc.restype_order["P"]

# MSA alphabet: our residue ids -> HHblits ids (the store's MSA encoding); gap = 21.
OURS_TO_HHBLITS = np.array([rc.HHBLITS_AA_TO_ID[a] for a in rc.restypes], dtype=np.int8)
HHBLITS_GAP = rc.HHBLITS_AA_TO_ID["-"]

# Release-date windows (MLPerf): training chains up to the cut-off, validation after it.
TRAIN_DATE_RANGE = ("1995-01-01", "2021-09-01")
VALIDATION_DATE_RANGE = ("2021-09-17", "2021-12-11")


@dataclasses.dataclass(frozen=True)
class SynthConfig:
    """Tunable knobs of the generator (defaults produce the demo dataset)."""

    # fold templates
    helix_length: tuple[int, int] = (6, 14)
    strand_length: tuple[int, int] = (4, 8)
    loop_length: tuple[int, int] = (2, 5)
    helix_probability: float = 0.6  # next element is a helix (else a strand)
    hairpin_probability: float = 0.6  # strand after strand joined by a type I' turn
    helix_sigma_deg: float = 4.0
    strand_sigma_deg: float = 8.0
    loop_sigma_deg: float = 12.0
    omega_sigma_deg: float = 3.0
    loop_candidates: int = 16  # candidate loop conformations tried per loop (compaction)
    fold_candidates: int = 4  # complete folds built per family; the most compact one is kept
    max_template_attempts: int = 20
    # family members
    member_sigma_deg: tuple[float, float] = (4.0, 10.0)  # crankshaft noise in SS elements / loops
    member_divergence: tuple[float, float] = (0.15, 0.45)  # mutation rate ancestor -> member
    validation_fraction: float = 0.1  # family members released in the validation window
    # geometry checks
    min_ca_distance: float = 4.0  # CA-CA for |i - j| >= 3
    min_backbone_distance: float = 2.6  # N, CA, C, O, CB for |i - j| >= 2
    severe_clash_distance: float = 2.2  # a side chain this close to anything becomes alanine
    clash_distance: float = 3.0  # soft clash threshold used when packing rotamers
    rotamer_candidates: int = 8
    packing_sweeps: int = 3
    # sequences
    ss_propensity_weight: float = 1.0
    burial_weight: float = 0.3
    burial_radius: float = 10.0  # CB neighbour count radius
    conservation_range: tuple[float, float] = (0.7, 1.5)  # profile sharpness exposed .. buried
    profile_concentration: float = 20.0  # Dirichlet noise making each family's profile unique
    # co-evolution
    contact_distance: float = 8.0  # C-beta distance of coupled pairs
    contact_min_separation: int = 6
    coupled_states: int = 4
    # MSAs
    msa_depth: tuple[int, int] = (8, 192)  # log-uniform per chain (row 0 = query)
    row_divergence: tuple[float, float] = (0.05, 0.7)
    fragment_probability: float = 0.25
    min_fragment_fraction: float = 0.4
    gap_run_probability: float = 0.15  # per loop and row
    max_gap_run: int = 4
    insertion_probability: float = 0.03  # per loop position and row
    mean_insertion_length: float = 3.0
    # chain table
    resolution_range: tuple[float, float] = (1.2, 3.2)
    disordered_terminus_probability: float = 0.3  # unresolved (mask 0) residues at a terminus
    max_disordered_terminus: int = 3
    # templates: earlier-released members of the same family (a homologue's structure)
    max_template_hits: int = 4  # hits stored per chain (0 = no templates)
    template_min_age_days: int = 60  # a template is released at least this long before its query


# ---------------------------------------------------------------------------------------------
# Backbone geometry
# ---------------------------------------------------------------------------------------------


def _literature_backbone(restype: int) -> tuple[float, float, float]:
    """Ideal N-CA length, CA-C length and N-CA-C angle (deg) of a residue type (Alg. 24 table)."""
    pos = {name: np.asarray(p, np.float64) for name, _, p in rc.rigid_group_atom_positions[rc.resnames[restype]]}
    n, c = pos["N"], pos["C"]  # CA is at the origin
    angle = math.degrees(math.acos(float(n @ c) / (np.linalg.norm(n) * np.linalg.norm(c))))
    return float(np.linalg.norm(n)), float(np.linalg.norm(c)), angle


_BACKBONE_GEOMETRY = [_literature_backbone(r) for r in range(rc.restype_num)]


def _place(a, b, c, bond: float, angle_deg: float, torsion_deg: float) -> tuple[float, float, float]:
    """NeRF: the atom d with |cd| = bond, angle(b, c, d) = angle, dihedral(a, b, c, d) = torsion."""
    bcx, bcy, bcz = c[0] - b[0], c[1] - b[1], c[2] - b[2]
    inv = 1.0 / math.sqrt(bcx * bcx + bcy * bcy + bcz * bcz)
    bcx, bcy, bcz = bcx * inv, bcy * inv, bcz * inv
    abx, aby, abz = b[0] - a[0], b[1] - a[1], b[2] - a[2]
    nx, ny, nz = aby * bcz - abz * bcy, abz * bcx - abx * bcz, abx * bcy - aby * bcx
    inv = 1.0 / math.sqrt(nx * nx + ny * ny + nz * nz)
    nx, ny, nz = nx * inv, ny * inv, nz * inv
    mx, my, mz = ny * bcz - nz * bcy, nz * bcx - nx * bcz, nx * bcy - ny * bcx
    theta, tau = math.radians(angle_deg), math.radians(torsion_deg)
    d0 = -bond * math.cos(theta)
    d1 = bond * math.sin(theta) * math.cos(tau)
    d2 = bond * math.sin(theta) * math.sin(tau)
    return (
        c[0] + d0 * bcx + d1 * mx + d2 * nx,
        c[1] + d0 * bcy + d1 * my + d2 * ny,
        c[2] + d0 * bcz + d1 * mz + d2 * nz,
    )


def _extend_backbone(
    atoms: list,
    aatype: Sequence[int],
    phi: Sequence[float],
    psi: Sequence[float],
    omega: Sequence[float],
    start: int,
    stop: int,
) -> list:
    """Append residues ``start..stop-1`` (N, CA, C each) to ``atoms`` (a list of 3-tuples)."""
    out = list(atoms)
    for i in range(start, stop):
        n_ca, ca_c, n_ca_c = _BACKBONE_GEOMETRY[aatype[i]]
        if i == 0:
            n = (0.0, 0.0, 0.0)
            ca = (n_ca, 0.0, 0.0)
            t = math.radians(180.0 - n_ca_c)
            c = (n_ca + ca_c * math.cos(t), ca_c * math.sin(t), 0.0)
        else:
            pn, pca, pc = out[-3], out[-2], out[-1]
            n = _place(pn, pca, pc, C_N_BOND, CA_C_N_ANGLE, psi[i - 1])
            ca = _place(pca, pc, n, n_ca, C_N_CA_ANGLE, omega[i - 1])
            c = _place(pc, n, ca, ca_c, n_ca_c, phi[i])
        out.extend((n, ca, c))
    return out


def build_backbone(
    aatype: Sequence[int], phi: Sequence[float], psi: Sequence[float], omega: Sequence[float]
) -> np.ndarray:
    """Backbone N, CA, C ``[N_res, 3, 3]`` from torsions in degrees with ideal geometry.

    ``phi[i]`` = C(i-1)-N-CA-C, ``psi[i]`` = N-CA-C-N(i+1), ``omega[i]`` = CA-C-N(i+1)-CA(i+1)
    (``phi[0]``, ``psi[-1]``, ``omega[-1]`` are unused).
    """
    atoms = _extend_backbone([], [int(a) for a in aatype], phi, psi, omega, 0, len(aatype))
    return np.asarray(atoms, dtype=np.float64).reshape(len(aatype), 3, 3)


def backbone_to_atom14(
    backbone: np.ndarray, aatype: np.ndarray, psi_deg: np.ndarray, chi_deg: np.ndarray
) -> np.ndarray:
    """All heavy atoms (atom14 layout) from a backbone and torsions, via Alg. 24.

    Args:
        backbone: ``[N_res, 3, 3]`` N, CA, C.
        aatype: ``[N_res]`` residue types.
        psi_deg: ``[N_res]`` psi (places O).
        chi_deg: ``[*, N_res, 4]`` chi1..chi4 (unused chis ignored); leading dims are
            alternative rotamer sets sharing the backbone.

    Returns:
        ``[*, N_res, 14, 3]`` float64 positions (zero for absent atoms).
    """
    bb = torch.as_tensor(backbone, dtype=torch.float64)
    frames = Rigid.make_transform_from_reference(bb[:, 0], bb[:, 1], bb[:, 2])  # [N]
    chi = torch.as_tensor(chi_deg, dtype=torch.float64)
    batch = chi.shape[:-2]
    num_res = bb.shape[0]
    angles = torch.zeros(batch + (num_res, 7), dtype=torch.float64)
    angles[..., 2] = torch.as_tensor(psi_deg, dtype=torch.float64)
    angles[..., 3:] = chi
    rad = torch.deg2rad(angles)
    alpha = torch.stack([torch.sin(rad), torch.cos(rad)], dim=-1)  # [*, N, 7, 2]
    # Pre-omega and phi groups carry no heavy atoms: leave them at angle 0.
    alpha[..., :2, 0] = 0.0
    alpha[..., :2, 1] = 1.0
    consts = rigid_group_constants(torch.float64, torch.device("cpu"))
    aa = torch.as_tensor(np.asarray(aatype), dtype=torch.long).expand(batch + (num_res,))
    frames = frames.map_tensor_fn(lambda t: t.expand(batch + t.shape))
    all_frames = torsion_angles_to_frames(frames, alpha, aa, consts.default_frames)
    atom14 = frames_and_literature_positions_to_atom14_pos(
        all_frames, aa, consts.group_idx, consts.atom_mask, consts.lit_positions
    )
    return atom14.numpy()


def atom14_to_atom37_numpy(atom14: np.ndarray, aatype: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[N, 14, 3]`` -> atom37 positions ``[N, 37, 3]`` and mask ``[N, 37]``."""
    num_res = atom14.shape[0]
    positions = np.zeros((num_res, rc.atom_type_num, 3), np.float64)
    mask = np.zeros((num_res, rc.atom_type_num), np.float32)
    exists = rc.restype_atom14_mask[aatype] > 0  # [N, 14]
    to37 = rc.restype_atom14_to_atom37[aatype]  # [N, 14]
    res, slot = np.nonzero(exists)
    positions[res, to37[res, slot]] = atom14[res, slot]
    mask[res, to37[res, slot]] = 1.0
    return positions, mask


def dihedral(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> np.ndarray:
    """IUPAC dihedral angle (degrees) of points ``[..., 3]``."""
    b0, b1, b2 = a - b, c - b, d - c
    b1n = b1 / np.linalg.norm(b1, axis=-1, keepdims=True)
    v = b0 - np.sum(b0 * b1n, -1, keepdims=True) * b1n
    w = b2 - np.sum(b2 * b1n, -1, keepdims=True) * b1n
    x = np.sum(v * w, -1)
    y = np.sum(np.cross(b1n, v) * w, -1)
    return np.degrees(np.arctan2(y, x))


def _place_many(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, bond: float, angle_deg: float, torsion_deg: float
) -> np.ndarray:
    """Vectorised NeRF over ``[M, 3]`` point triples (see :func:`_place`)."""
    bc = c - b
    bc /= np.linalg.norm(bc, axis=-1, keepdims=True)
    n = np.cross(b - a, bc)
    n /= np.linalg.norm(n, axis=-1, keepdims=True)
    m = np.cross(n, bc)
    theta, tau = math.radians(angle_deg), math.radians(torsion_deg)
    d = np.array(
        [-bond * math.cos(theta), bond * math.sin(theta) * math.cos(tau), bond * math.sin(theta) * math.sin(tau)]
    )
    return c + d[0] * bc + d[1] * m + d[2] * n


# Ideal carbonyl and C-beta placement used only for clash checks while building backbones.
_C_O_BOND, _CA_C_O_ANGLE = 1.231, 120.5
_CB_COEFFS = (-0.58273431, 0.56802827, -0.54067466)  # CB = a (b x c) + b' b + c' c + CA (pseudo-beta)


def backbone_heavy_atoms(backbone: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """N, CA, C, O, CB ``[L, 5, 3]`` from N, CA, C ``[L, 3, 3]`` (ideal O and CB) and their mask ``[L, 5]``.

    O lies in the peptide plane, trans to the next residue's CA; the last residue has no O here.
    """
    num_res = backbone.shape[0]
    out = np.zeros((num_res, 5, 3))
    mask = np.ones((num_res, 5), bool)
    out[:, :3] = backbone
    if num_res > 1:
        out[:-1, 3] = _place_many(backbone[1:, 1], backbone[1:, 0], backbone[:-1, 2], _C_O_BOND, _CA_C_O_ANGLE, 0.0)
    mask[-1, 3] = False
    b, c = backbone[:, 1] - backbone[:, 0], backbone[:, 2] - backbone[:, 1]
    out[:, 4] = _CB_COEFFS[0] * np.cross(b, c) + _CB_COEFFS[1] * b + _CB_COEFFS[2] * c + backbone[:, 1]
    return out, mask


def _sq_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Squared distances ``[A, B]`` between point sets ``[A, 3]`` and ``[B, 3]``."""
    diff = a[:, None, 0] - b[None, :, 0]
    out = diff * diff
    for k in (1, 2):  # element-wise (no BLAS: these matrices are small and many)
        diff = a[:, None, k] - b[None, :, k]
        out += diff * diff
    return out


def backbone_clashes(backbone: np.ndarray, new: slice, cfg: SynthConfig) -> bool:
    """True if residues in ``new`` clash with the rest: CA-CA closer than ``min_ca_distance``
    (``|i - j| >= 3``) or backbone heavy atoms (N, CA, C, O, CB) closer than
    ``min_backbone_distance`` (``|i - j| >= 2``)."""
    idx = np.arange(backbone.shape[0])
    ca = backbone[:, 1]
    sep = np.abs(idx[new][:, None] - idx[None, :])  # [n, L]
    if np.any((_sq_distances(ca[new], ca) < cfg.min_ca_distance**2) & (sep >= 3)):
        return True
    atoms, mask = backbone_heavy_atoms(backbone)
    res = np.repeat(idx, 5)[mask.reshape(-1)]
    pts = atoms[mask]
    mine = (res >= idx[new][0]) & (res <= idx[new][-1])
    close = _sq_distances(pts[mine], pts) < cfg.min_backbone_distance**2
    return bool(np.any(close & (np.abs(res[mine][:, None] - res[None, :]) >= 2)))


# ---------------------------------------------------------------------------------------------
# Fold templates
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FoldTemplate:
    """A family's fold: per-residue secondary structure and backbone torsions (degrees)."""

    ss: np.ndarray  # [L] HELIX / STRAND / LOOP
    phi: np.ndarray  # [L]
    psi: np.ndarray  # [L]
    omega: np.ndarray  # [L]
    backbone: np.ndarray  # [L, 3, 3] built with all-alanine geometry

    @property
    def length(self) -> int:
        return len(self.ss)


def _segment_plan(length: int, rng: np.random.Generator, cfg: SynthConfig) -> list[tuple[int, int]]:
    """(ss, length) segments: loop, element, loop, element, ..., loop; total = ``length``."""
    plan: list[tuple[int, int]] = [(LOOP, int(rng.integers(1, cfg.loop_length[1] + 1)))]
    total = plan[0][1]
    previous = LOOP
    while True:
        kind = HELIX if rng.random() < cfg.helix_probability else STRAND
        lo, hi = cfg.helix_length if kind == HELIX else cfg.strand_length
        size = int(rng.integers(lo, hi + 1))
        if total + size + 1 > length:
            break
        if kind == STRAND and previous == STRAND and rng.random() < cfg.hairpin_probability:
            plan.append((-1, len(HAIRPIN_TURN)))  # hairpin turn marker
            total += len(HAIRPIN_TURN)
        elif previous != LOOP or len(plan) > 1:
            loop = int(rng.integers(cfg.loop_length[0], cfg.loop_length[1] + 1))
            plan.append((LOOP, loop))
            total += loop
        plan.append((kind, size))
        total += size
        previous = kind
    if total < length:
        plan.append((LOOP, length - total))
    elif total > length:  # trim the last element
        kind, size = plan[-1]
        plan[-1] = (kind, size - (total - length))
    return [p for p in plan if p[1] > 0]


def _sample_segment_torsions(kind: int, size: int, rng: np.random.Generator, cfg: SynthConfig) -> tuple:
    """(ss, phi, psi) arrays of one segment."""
    if kind == HELIX:
        phi = HELIX_PHI_PSI[0] + cfg.helix_sigma_deg * rng.standard_normal(size)
        psi = HELIX_PHI_PSI[1] + cfg.helix_sigma_deg * rng.standard_normal(size)
        return np.full(size, HELIX), phi, psi
    if kind == STRAND:
        phi = STRAND_PHI_PSI[0] + cfg.strand_sigma_deg * rng.standard_normal(size)
        psi = STRAND_PHI_PSI[1] + cfg.strand_sigma_deg * rng.standard_normal(size)
        return np.full(size, STRAND), phi, psi
    if kind == -1:  # hairpin turn
        phi = np.array([t[0] for t in HAIRPIN_TURN]) + cfg.helix_sigma_deg * rng.standard_normal(size)
        psi = np.array([t[1] for t in HAIRPIN_TURN]) + cfg.helix_sigma_deg * rng.standard_normal(size)
        return np.full(size, LOOP), phi, psi
    weights = np.array([b[0] for b in LOOP_BASINS])
    basin = rng.choice(len(LOOP_BASINS), size=size, p=weights / weights.sum())
    phi = np.array([LOOP_BASINS[b][1] for b in basin]) + cfg.loop_sigma_deg * rng.standard_normal(size)
    psi = np.array([LOOP_BASINS[b][2] for b in basin]) + cfg.loop_sigma_deg * rng.standard_normal(size)
    return np.full(size, LOOP), phi, psi


def radius_of_gyration(points: np.ndarray) -> float:
    """Root-mean-square distance of ``points`` ``[N, 3]`` from their centroid."""
    return float(np.sqrt(((points - points.mean(0)) ** 2).sum(-1).mean()))


def make_fold_template(length: int, rng: np.random.Generator, cfg: SynthConfig = SynthConfig()) -> FoldTemplate:
    """Sample a compact, clash-free fold of ``length`` residues.

    Segments are built one at a time; for each loop (with the element after it) several
    candidate conformations are tried and the clash-free one giving the smallest radius of
    gyration of the chain built so far is kept, which folds the chain back on itself. Of
    ``cfg.fold_candidates`` complete folds the most compact is returned (greedy growth alone
    leaves small proteins ~1.6x the radius of gyration of real ones, 2.2 N^0.38 A; this brings
    them to ~1.25x).
    """
    alanine = [rc.restype_order["A"]] * length
    folds: list[FoldTemplate] = []
    for _ in range(cfg.max_template_attempts):
        if len(folds) >= cfg.fold_candidates:
            break
        plan = _segment_plan(length, rng, cfg)
        ss = np.zeros(length, np.int64)
        phi = np.zeros(length)
        psi = np.zeros(length)
        omega = OMEGA_TRANS + cfg.omega_sigma_deg * rng.standard_normal(length)
        atoms: list = []
        start, ok, k = 0, True, 0
        while k < len(plan):
            # A block: a loop/turn and the element after it (or a lone segment).
            block = [plan[k]]
            if plan[k][0] in (LOOP, -1) and k + 1 < len(plan):
                block.append(plan[k + 1])
            stop = start + sum(size for _, size in block)
            best, best_score = None, math.inf
            for _ in range(cfg.loop_candidates if start > 0 else 1):
                pieces = [_sample_segment_torsions(kind, size, rng, cfg) for kind, size in block]
                ss[start:stop] = np.concatenate([p[0] for p in pieces])
                phi[start:stop] = np.concatenate([p[1] for p in pieces])
                psi[start:stop] = np.concatenate([p[2] for p in pieces])
                # psi of the residue before the block stays as sampled with its own segment.
                trial = _extend_backbone(atoms, alanine, phi, psi, omega, start, stop)
                if backbone_clashes(np.asarray(trial).reshape(-1, 3, 3), slice(max(start - 1, 0), stop), cfg):
                    continue
                ca = np.asarray(trial[1::3])
                # radius of gyration of the chain so far: the most compact candidate wins
                score = 0.0 if start == 0 else radius_of_gyration(ca)
                if score < best_score:
                    best, best_score = (
                        (trial, ss[start:stop].copy(), phi[start:stop].copy(), psi[start:stop].copy()),
                        score,
                    )
            if best is None:
                ok = False
                break
            atoms, ss[start:stop], phi[start:stop], psi[start:stop] = best
            start = stop
            k += len(block)
        if ok:
            backbone = np.asarray(atoms, np.float64).reshape(length, 3, 3)
            folds.append(FoldTemplate(ss=ss.copy(), phi=phi.copy(), psi=psi.copy(), omega=omega, backbone=backbone))
    if folds:
        return min(folds, key=lambda fold: radius_of_gyration(fold.backbone[:, 1]))
    raise RuntimeError(f"could not build a clash-free fold of length {length} in {cfg.max_template_attempts} attempts")


# ---------------------------------------------------------------------------------------------
# Side chains
# ---------------------------------------------------------------------------------------------


def sample_chis(aatype: np.ndarray, num: int, rng: np.random.Generator, sigma_deg: float = 8.0) -> np.ndarray:
    """``[num, N_res, 4]`` candidate chi angles (degrees) from the rotamer wells (0 where unused)."""
    chis = np.zeros((num, len(aatype), 4))
    for i, a in enumerate(aatype):
        wells = ROTAMERS.get(rc.resnames[int(a)], ())
        for j, (values, probs) in enumerate(wells):
            p = np.asarray(probs, np.float64)
            chis[:, i, j] = np.asarray(values)[rng.choice(len(values), size=num, p=p / p.sum())]
            chis[:, i, j] += sigma_deg * rng.standard_normal(num)
        if int(a) == PRO:
            chis[:, i, 1] = PRO_CHI2_PER_CHI1 * chis[:, i, 0]
    return chis


_BACKBONE14 = 5  # atom14 slots 0..4: N, CA, C, O, CB; side-chain atoms beyond CB follow
_NEIGHBOUR_MARGIN = 1.0  # A, added to the side-chain reach when listing residue pairs that can touch


def _norm(v: np.ndarray) -> np.ndarray:
    """Euclidean norm over the last axis (of length 3)."""
    return np.sqrt(v[..., 0] * v[..., 0] + v[..., 1] * v[..., 1] + v[..., 2] * v[..., 2])


def _overlap(d: np.ndarray, threshold: float) -> np.ndarray:
    """Soft clash energy ``relu(threshold - d)^2`` (0 for d = inf)."""
    return np.square(np.maximum(threshold - d, 0.0))


def pack_side_chains(
    backbone: np.ndarray,
    aatype: np.ndarray,
    psi: np.ndarray,
    rng: np.random.Generator,
    cfg: SynthConfig = SynthConfig(),
) -> tuple[np.ndarray, np.ndarray]:
    """Choose one rotamer per residue among ``rotamer_candidates`` samples to avoid clashes.

    Energy: soft overlap (below ``clash_distance``) of side-chain atoms with the other residues'
    N, CA, C, O, CB and with the other side chains; minimised by iterated conditional modes
    (``packing_sweeps`` sweeps in random order). A residue that still has an atom closer than
    ``severe_clash_distance`` is mutated to alanine (its side chain does not fit the fold).

    Returns:
        atom14 positions ``[N, 14, 3]`` and the (possibly mutated) ``aatype``.
    """
    aatype = np.asarray(aatype).copy()
    num_res, k = len(aatype), cfg.rotamer_candidates
    cand = backbone_to_atom14(backbone, aatype, psi, sample_chis(aatype, k, rng))  # [K, N, 14, 3]
    exists = rc.restype_atom14_mask[aatype] > 0  # [N, 14]
    # Distances for packing in float32 (plenty for a 0.1 A decision).
    core, core_mask = cand[0, :, :_BACKBONE14].astype(np.float32), exists[:, :_BACKBONE14]  # same in all candidates
    side = np.ascontiguousarray(np.transpose(cand[:, :, _BACKBONE14:], (1, 0, 2, 3)), dtype=np.float32)  # [N, K, 9, 3]
    side_mask = exists[:, _BACKBONE14:]  # [N, 9]
    has_side = side_mask.any(-1)
    ca = core[:, 1]
    reach = np.where(side_mask[:, None], np.linalg.norm(side - ca[:, None, None], axis=-1), 0.0).max(axis=(1, 2))
    d_ca = np.linalg.norm(ca[:, None] - ca[None], axis=-1)

    energies = _RotamerEnergies(
        *_side_chain_core_energies(core, core_mask, side, side_mask, has_side, reach, d_ca, cfg),
        *_side_chain_pair_energies(side, side_mask, has_side, reach, d_ca, cfg),
    )
    movable = np.nonzero(has_side)[0]
    choice = energies.iterated_conditional_modes(movable, rng, cfg.packing_sweeps)
    atom14 = cand[choice, np.arange(num_res)]
    # Residues whose side chain cannot fit: alanine (keeps N, CA, C, O, CB).
    energies.remove_misfits(atom14, aatype, choice, movable, cfg.severe_clash_distance)
    return atom14, aatype


def _side_chain_core_energies(
    core: np.ndarray,
    core_mask: np.ndarray,
    side: np.ndarray,
    side_mask: np.ndarray,
    has_side: np.ndarray,
    reach: np.ndarray,
    d_ca: np.ndarray,
    cfg: SynthConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """Side chain of i against the core atoms (N, CA, C, O, CB) of every other residue j, for the
    pairs that can touch: ``[N, K]`` soft-clash energies and closest approaches per candidate."""
    num_res, k = side.shape[:2]
    bb_energy = np.zeros((num_res, k), np.float32)
    bb_min = np.full((num_res, k), np.inf, np.float32)
    ii, jj = np.nonzero(
        (d_ca < reach[:, None] + 3.0 + _NEIGHBOUR_MARGIN) & ~np.eye(num_res, dtype=bool) & has_side[:, None]
    )
    for start in range(0, len(ii), 256):
        i, j = ii[start : start + 256], jj[start : start + 256]
        d = _norm(side[i][:, :, :, None] - core[j][:, None, None])  # [P, K, 9, 5]
        valid = side_mask[i][:, None, :, None] & core_mask[j][:, None, None, :]
        d = np.where(valid, d, np.inf)
        np.add.at(bb_energy, i, _overlap(d, cfg.clash_distance).sum(axis=(2, 3)))
        np.minimum.at(bb_min, i, d.min(axis=(2, 3)))
    return bb_energy, bb_min


def _side_chain_pair_energies(
    side: np.ndarray, side_mask: np.ndarray, has_side: np.ndarray, reach: np.ndarray, d_ca: np.ndarray, cfg: SynthConfig
) -> tuple[np.ndarray, np.ndarray, list[list[tuple[int, int, bool]]]]:
    """Side chain against side chain for the pairs ``i < j`` that can touch: ``[P, K, K]``
    soft-clash energies and closest approaches per candidate pair, and each residue's partners
    ``(pair p, other residue, transposed)`` (``transposed``: the residue is the pair's ``j``)."""
    num_res, k = side.shape[:2]
    pi, pj = np.nonzero(
        np.triu(d_ca < reach[:, None] + reach[None] + _NEIGHBOUR_MARGIN, k=1) & has_side[:, None] & has_side[None]
    )
    pair_energy = np.zeros((len(pi), k, k), np.float32)
    pair_min = np.full((len(pi), k, k), np.inf, np.float32)
    for start in range(0, len(pi), 32):
        i, j = pi[start : start + 32], pj[start : start + 32]
        d = _norm(side[i][:, :, None, :, None] - side[j][:, None, :, None, :])  # [P, K, K, 9, 9]
        valid = side_mask[i][:, None, None, :, None] & side_mask[j][:, None, None, None, :]
        d = np.where(valid, d, np.inf)
        pair_energy[start : start + 32] = _overlap(d, cfg.clash_distance).sum(axis=(3, 4))
        pair_min[start : start + 32] = d.min(axis=(3, 4))
    partners: list[list[tuple[int, int, bool]]] = [[] for _ in range(num_res)]
    for p, (i, j) in enumerate(zip(pi, pj)):
        partners[i].append((p, int(j), False))
        partners[j].append((p, int(i), True))
    return pair_energy, pair_min, partners


@dataclasses.dataclass
class _RotamerEnergies:
    """The clash tables of :func:`pack_side_chains` (``K`` rotamer candidates per residue)."""

    bb_energy: np.ndarray  # [N, K] side chain vs other residues' core atoms
    bb_min: np.ndarray  # [N, K] closest approach of the same
    pair_energy: np.ndarray  # [P, K, K] side chain vs side chain
    pair_min: np.ndarray  # [P, K, K]
    partners: list[list[tuple[int, int, bool]]]  # per residue: (pair, other residue, transposed)

    def local(self, i: int, choice: np.ndarray, table: np.ndarray, reduce) -> np.ndarray:
        """``[K]``: residue i's candidates against the core atoms and the other residues' chosen
        rotamers, summed (``reduce=np.add``, energies) or as a minimum (``np.minimum``, distances)."""
        out = self.bb_energy[i].copy() if reduce is np.add else self.bb_min[i].copy()
        for p, j, transposed in self.partners[i]:
            column = table[p][choice[j], :] if transposed else table[p][:, choice[j]]
            out = reduce(out, column)
        return out

    def iterated_conditional_modes(self, movable: np.ndarray, rng: np.random.Generator, sweeps: int) -> np.ndarray:
        """Per residue the candidate of least energy: start from the core-only optimum, then up to
        ``sweeps`` sweeps over ``movable`` in random order, each residue taking its best rotamer
        given the others' (stops early when a sweep changes nothing)."""
        choice = np.argmin(self.bb_energy, axis=1)
        for _ in range(sweeps):
            changed = False
            for i in rng.permutation(movable):
                best = int(np.argmin(self.local(i, choice, self.pair_energy, np.add)))
                changed |= best != choice[i]
                choice[i] = best
            if not changed:
                break
        return choice

    def remove_misfits(
        self, atom14: np.ndarray, aatype: np.ndarray, choice: np.ndarray, movable: np.ndarray, severe: float
    ) -> None:
        """Residues whose chosen side chain still comes closer than ``severe`` to anything become
        alanine (keeps N, CA, C, O, CB), in ``atom14`` and ``aatype`` (in place)."""
        for i in movable:
            if self.local(i, choice, self.pair_min, np.minimum)[choice[i]] < severe:
                aatype[i] = rc.restype_order["A"]
                atom14[i, _BACKBONE14:] = 0.0
                self.pair_min[[p for p, _, _ in self.partners[i]]] = np.inf  # no longer clashes with anyone
                self.bb_min[i] = np.inf


_PEPTIDE_ATOMS = [rc.atom_order[name] for name in ("N", "CA", "C", "O")]


def min_interresidue_distance(atom37: np.ndarray, mask: np.ndarray) -> float:
    """Closest approach of heavy atoms in different residues (Angstrom).

    Pairs bonded through the peptide bond (backbone atoms N, CA, C, O of consecutive residues:
    C-N 1.33, O-N 2.25, CA-N / C-CA 2.4) are excluded; everything else below ~2.2 is a clash.
    """
    num_res = atom37.shape[0]
    flat = mask.reshape(-1) > 0
    res = np.repeat(np.arange(num_res), rc.atom_type_num)[flat]
    peptide = np.isin(np.tile(np.arange(rc.atom_type_num), num_res)[flat], _PEPTIDE_ATOMS)
    pts = atom37.reshape(-1, 3)[flat].astype(np.float64)
    d2 = _sq_distances(pts, pts)
    sep = np.abs(res[:, None] - res[None, :])
    excluded = (sep == 0) | ((sep == 1) & peptide[:, None] & peptide[None, :])
    d2 = np.where(excluded, np.inf, d2)
    return float(np.sqrt(d2.min())) if d2.size else math.inf


# ---------------------------------------------------------------------------------------------
# Sequences and co-evolution
# ---------------------------------------------------------------------------------------------


def _burial(backbone: np.ndarray, radius: float) -> np.ndarray:
    """Per-residue burial in [-1, 1] from the number of CA neighbours within ``radius``."""
    ca = backbone[:, 1]
    d = np.linalg.norm(ca[:, None] - ca[None], axis=-1)
    counts = (d < radius).sum(1) - 1.0
    z = (counts - counts.mean()) / (counts.std() + 1e-6)
    return np.clip(z / 2.0, -1.0, 1.0)


def family_profile(template: FoldTemplate, rng: np.random.Generator, cfg: SynthConfig = SynthConfig()) -> np.ndarray:
    """``[L, 20]`` per-position residue distribution of a family."""
    burial = _burial(template.backbone, cfg.burial_radius)
    logp = np.log(BACKGROUND_FREQUENCY)[None, :].repeat(template.length, 0)
    logp += cfg.ss_propensity_weight * np.log(CHOU_FASMAN[template.ss])
    logp += cfg.burial_weight * burial[:, None] * KYTE_DOOLITTLE[None, :]
    # Backbone-dependent amino acids: glycine for phi > 0, proline only near phi = -65.
    positive_phi = template.phi > 0
    logp[positive_phi] -= 3.0
    logp[positive_phi, GLY] += 6.0
    pro_ok = (np.abs(template.phi + 65.0) < 20.0) & (template.ss == LOOP)
    logp[~pro_ok, PRO] = -np.inf
    # Buried positions are more conserved: sharpen their distribution.
    lo, hi = cfg.conservation_range
    sharpness = lo + (hi - lo) * (burial + 1.0) / 2.0
    logits = sharpness[:, None] * (logp - logp.max(-1, keepdims=True))
    prior = np.exp(logits)
    prior /= prior.sum(-1, keepdims=True)
    profile = np.stack([rng.dirichlet(cfg.profile_concentration * p + 1e-3) for p in prior])
    profile[~pro_ok, PRO] = 0.0
    return profile / profile.sum(-1, keepdims=True)


def coupled_pairs(template: FoldTemplate, rng: np.random.Generator, cfg: SynthConfig = SynthConfig()) -> np.ndarray:
    """``[P, 2]`` disjoint residue pairs in contact (pseudo-C-beta) that co-evolve."""
    bb = template.backbone
    # Ideal C-beta from the backbone (same construction as AlphaFold's pseudo-beta).
    b, c = bb[:, 1] - bb[:, 0], bb[:, 2] - bb[:, 1]
    cb = -0.58273431 * np.cross(b, c) + 0.56802827 * b - 0.54067466 * c + bb[:, 1]
    d = np.linalg.norm(cb[:, None] - cb[None], axis=-1)
    i, j = np.nonzero(np.triu(d < cfg.contact_distance, k=cfg.contact_min_separation))
    used: set[int] = set()
    pairs = []
    for k in rng.permutation(len(i)):
        if i[k] not in used and j[k] not in used:
            used.update((int(i[k]), int(j[k])))
            pairs.append((int(i[k]), int(j[k])))
    return np.asarray(sorted(pairs), dtype=np.int64).reshape(-1, 2)


@dataclasses.dataclass
class SequenceModel:
    """A family's sequence space: profile, co-evolving pairs and their allowed pair states."""

    profile: np.ndarray  # [L, 20]
    pairs: np.ndarray  # [P, 2]
    pair_states: np.ndarray  # [P, S, 2] residue types allowed at each coupled pair

    @classmethod
    def sample(
        cls, template: FoldTemplate, rng: np.random.Generator, cfg: SynthConfig = SynthConfig()
    ) -> SequenceModel:
        profile = family_profile(template, rng, cfg)
        pairs = coupled_pairs(template, rng, cfg)
        states = np.zeros((len(pairs), cfg.coupled_states, 2), np.int64)
        for p, (i, j) in enumerate(pairs):
            states[p, :, 0] = rng.choice(rc.restype_num, size=cfg.coupled_states, p=profile[i])
            states[p, :, 1] = rng.choice(rc.restype_num, size=cfg.coupled_states, p=profile[j])
        return cls(profile=profile, pairs=pairs, pair_states=states)

    def _draw(self, positions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        cum = np.cumsum(self.profile[positions], -1)
        u = rng.random(len(positions))[:, None]
        return np.minimum((u > cum).sum(-1), rc.restype_num - 1)

    def ancestor(self, rng: np.random.Generator) -> np.ndarray:
        seq = self._draw(np.arange(len(self.profile)), rng)
        if len(self.pairs):
            s = rng.integers(0, self.pair_states.shape[1], size=len(self.pairs))
            seq[self.pairs[:, 0]] = self.pair_states[np.arange(len(self.pairs)), s, 0]
            seq[self.pairs[:, 1]] = self.pair_states[np.arange(len(self.pairs)), s, 1]
        return seq

    def mutate(self, seq: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
        """Independent positions resampled from the profile with probability ``rate``; coupled
        pairs jump *together* to another allowed pair state with the same probability."""
        out = seq.copy()
        coupled = np.zeros(len(seq), bool)
        coupled[self.pairs.reshape(-1)] = True
        hit = (rng.random(len(seq)) < rate) & ~coupled
        out[hit] = self._draw(np.nonzero(hit)[0], rng)
        if len(self.pairs):
            jump = rng.random(len(self.pairs)) < rate
            s = rng.integers(0, self.pair_states.shape[1], size=int(jump.sum()))
            idx = np.nonzero(jump)[0]
            out[self.pairs[idx, 0]] = self.pair_states[idx, s, 0]
            out[self.pairs[idx, 1]] = self.pair_states[idx, s, 1]
        return out


def make_msa(
    query: np.ndarray,
    ss: np.ndarray,
    model: SequenceModel,
    depth: int,
    rng: np.random.Generator,
    cfg: SynthConfig = SynthConfig(),
) -> tuple[np.ndarray, np.ndarray]:
    """An MSA for ``query``: HHblits ids ``[depth, L]`` (int8, row 0 = query) and deletions ``[depth, L]``."""
    length = len(query)
    msa = np.empty((depth, length), np.int8)
    deletions = np.zeros((depth, length), np.int32)
    msa[0] = OURS_TO_HHBLITS[query]
    loops = _runs(ss == LOOP)
    lo, hi = cfg.row_divergence
    for r in range(1, depth):
        row = OURS_TO_HHBLITS[model.mutate(query, rng.uniform(lo, hi), rng)]
        if rng.random() < cfg.fragment_probability:  # a fragment: terminal gaps
            size = int(rng.integers(int(cfg.min_fragment_fraction * length), length + 1))
            begin = int(rng.integers(0, length - size + 1))
            row[:begin] = HHBLITS_GAP
            row[begin + size :] = HHBLITS_GAP
        for a, b in loops:
            if rng.random() < cfg.gap_run_probability:
                run = int(rng.integers(1, min(cfg.max_gap_run, b - a) + 1))
                g = int(rng.integers(a, b - run + 1))
                row[g : g + run] = HHBLITS_GAP
            inserted = rng.random(b - a) < cfg.insertion_probability
            deletions[r, a:b][inserted] = rng.geometric(1.0 / cfg.mean_insertion_length, size=int(inserted.sum()))
        msa[r] = row
    deletions[msa == HHBLITS_GAP] = 0
    return msa, deletions


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of the runs of True in ``flags``."""
    padded = np.concatenate([[False], flags, [False]]).astype(np.int8)
    edges = np.diff(padded)
    return list(zip(np.nonzero(edges == 1)[0].tolist(), np.nonzero(edges == -1)[0].tolist()))


# ---------------------------------------------------------------------------------------------
# Families and the store
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SyntheticChain:
    """One generated chain, ready for :meth:`StoreWriter.add_chain`."""

    family: int
    sequence: str
    aatype: np.ndarray  # [L]
    ss: np.ndarray  # [L]
    all_atom_positions: np.ndarray  # [L, 37, 3] float32
    all_atom_mask: np.ndarray  # [L, 37]
    msa: np.ndarray  # [D, L] HHblits ids
    deletion_matrix: np.ndarray  # [D, L]
    validation: bool


def build_member(
    template: FoldTemplate, aatype: np.ndarray, rng: np.random.Generator, cfg: SynthConfig = SynthConfig()
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A family member's structure: the template fold with local variation and packed side chains.

    Variation is a "crankshaft" move per peptide (psi_i + d, phi_i+1 - d), which changes the
    local backbone but hardly moves the rest of the chain, so members keep the family's fold.
    The backbone uses one ideal geometry for every residue type (the template's), so the fold
    does not drift with the sequence; O, CB and side chains come from the per-type literature
    positions (Alg. 24).

    Returns (atom37 positions ``[L, 37, 3]``, atom37 mask ``[L, 37]``, aatype ``[L]``); the
    residue types change where a side chain does not fit (see :func:`pack_side_chains`)."""
    ss_sigma, loop_sigma = cfg.member_sigma_deg
    alanine = np.full(template.length, rc.restype_order["A"])
    backbone, psi = template.backbone, template.psi
    for attempt in range(cfg.max_template_attempts):
        scale = 1.0 - attempt / cfg.max_template_attempts
        sigma = np.where(template.ss == LOOP, loop_sigma, ss_sigma) * scale
        shift = sigma * rng.standard_normal(template.length)
        trial_psi = template.psi + shift
        trial_phi = template.phi - np.concatenate([[0.0], shift[:-1]])
        trial = build_backbone(alanine, trial_phi, trial_psi, template.omega)
        if not backbone_clashes(trial, slice(None), cfg):
            backbone, psi = trial, trial_psi
            break
    atom14, aatype = pack_side_chains(backbone, aatype, psi, rng, cfg)
    atom14[:, :3] = backbone  # exact ideal peptide geometry for N, CA, C
    positions, mask = atom14_to_atom37_numpy(atom14, aatype)
    return positions, mask, aatype


def generate_family(
    family: int, num_members: int, length: int, seed: Any, cfg: SynthConfig = SynthConfig(), num_validation: int = 0
) -> list[SyntheticChain]:
    """All chains of one family (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    template = make_fold_template(length, rng, cfg)
    model = SequenceModel.sample(template, rng, cfg)
    ancestor = model.ancestor(rng)
    chains = []
    for m in range(num_members):
        aatype = model.mutate(ancestor, rng.uniform(*cfg.member_divergence), rng)
        positions, mask, aatype = build_member(template, aatype, rng, cfg)
        # Unresolved terminal residues, as in crystal structures.
        for end in (0, 1):
            if rng.random() < cfg.disordered_terminus_probability:
                k = int(rng.integers(1, cfg.max_disordered_terminus + 1))
                sl = slice(0, k) if end == 0 else slice(length - k, length)
                mask[sl] = 0.0
        positions = positions * mask[..., None]
        lo, hi = np.log(cfg.msa_depth[0]), np.log(cfg.msa_depth[1])
        depth = int(round(math.exp(rng.uniform(lo, hi))))
        msa, deletions = make_msa(aatype, template.ss, model, depth, rng, cfg)
        chains.append(
            SyntheticChain(
                family=family,
                sequence="".join(rc.restypes[a] for a in aatype),
                aatype=aatype,
                ss=template.ss.copy(),
                all_atom_positions=positions.astype(np.float32),
                all_atom_mask=mask,
                msa=msa,
                deletion_matrix=deletions,
                validation=m >= num_members - num_validation,
            )
        )
    return chains


def _random_date(rng: np.random.Generator, window: tuple[str, str]) -> str:
    start, stop = (datetime.date.fromisoformat(d) for d in window)
    return (start + datetime.timedelta(days=int(rng.integers(0, (stop - start).days + 1)))).isoformat()


def family_sizes(num_chains: int, num_families: int) -> list[int]:
    """Chains per family: as even as possible (the first families get the remainder)."""
    base, extra = divmod(num_chains, num_families)
    return [base + (f < extra) for f in range(num_families)]


def chain_name(k: int) -> tuple[str, str]:
    """(pdb_id, chain_id) of the k-th synthetic chain: ``"s0042"``, ``"s0042_A"``."""
    pdb_id = f"s{k:04d}"
    return pdb_id, f"{pdb_id}_A"


def synthesize(
    out: PathLike,
    num_chains: int = 320,
    num_families: int = 40,
    length_range: tuple[int, int] = (40, 120),
    seed: int = 0,
    config: SynthConfig | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Write a synthetic dataset store to ``out``; returns a summary dict.

    Args:
        out: store path (written atomically by :meth:`Store.create`).
        num_chains: total chains, spread evenly over ``num_families`` families.
        num_families: number of folds; each family's members share the fold.
        length_range: inclusive range of chain lengths (one length per family).
        seed: everything is a function of this seed and the other arguments.
        config: generator knobs (:class:`SynthConfig`).
        workers: processes generating families in parallel (output does not depend on it).
    """
    cfg = config or SynthConfig()
    if num_families < 1 or num_chains < num_families:
        raise ValueError(f"need 1 <= num_families <= num_chains, got {num_families} families for {num_chains} chains")
    lo, hi = length_range
    if not 16 <= lo <= hi:
        raise ValueError(f"length_range must satisfy 16 <= min <= max, got {length_range}")
    root = np.random.SeedSequence(seed)
    family_seeds = root.spawn(num_families)
    table_rng = np.random.default_rng(root.spawn(1)[0])  # lengths, dates, resolutions
    sizes = family_sizes(num_chains, num_families)
    lengths = table_rng.integers(lo, hi + 1, size=num_families)
    jobs = [
        (f, sizes[f], int(lengths[f]), family_seeds[f], cfg, int(round(cfg.validation_fraction * sizes[f])))
        for f in range(num_families)
    ]
    families = generate_families(jobs, workers)
    counts = write_families(out, families, table_rng, cfg)
    return {"path": str(out), "families": num_families, "seed": seed, **counts}


def generate_families(jobs: Sequence[tuple], workers: int = 1) -> list[list[SyntheticChain]]:
    """:func:`generate_family` of every argument tuple in ``jobs``, in ``workers`` processes
    (``spawn``, one torch thread each) or in this one with torch limited to one thread."""
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            return pool.starmap(generate_family, jobs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threading only adds overhead
    try:
        return [generate_family(*job) for job in jobs]
    finally:
        torch.set_num_threads(threads)


def write_families(
    out: PathLike, families: Sequence[Sequence[SyntheticChain]], table_rng: np.random.Generator, cfg: SynthConfig
) -> dict[str, int]:
    """Write the chains of ``families`` to a new store at ``out`` (chain ``k`` named by
    :func:`chain_name`), drawing each chain's release date and resolution from ``table_rng``, family by
    family, and its template hits among the family (:func:`family_template_hits`). Returns the counts
    of chains (training / validation), residues and template hits."""
    from scalefold.data.store import Store  # local import: the store pulls in h5py

    counts = {"chains": 0, "training": 0, "validation": 0, "residues": 0, "template_hits": 0}
    with Store.create(out) as writer:
        k = 0
        for chains in families:
            entries = []
            for chain in chains:
                pdb_id, _ = chain_name(k)
                k += 1
                window = VALIDATION_DATE_RANGE if chain.validation else TRAIN_DATE_RANGE
                release_date = _random_date(table_rng, window)
                resolution = float(np.round(table_rng.uniform(*cfg.resolution_range), 2))
                entries.append((chain, pdb_id, release_date, resolution))
            for chain, pdb_id, release_date, resolution in entries:
                hits, outcomes = family_template_hits(chain, release_date, entries, cfg)
                writer.add_chain(
                    f"{pdb_id}_A",
                    sequence=chain.sequence,
                    all_atom_positions=chain.all_atom_positions,
                    all_atom_mask=chain.all_atom_mask,
                    pdb_id=pdb_id,
                    release_date=release_date,
                    resolution=resolution,
                    cluster_id=chain.family,
                    method="X-RAY DIFFRACTION",
                    msa=chain.msa,
                    deletion_matrix=chain.deletion_matrix,
                    template_hits=hits,
                    template_outcomes=outcomes,
                )
                counts["chains"] += 1
                counts["validation" if chain.validation else "training"] += 1
                counts["residues"] += len(chain.sequence)
                counts["template_hits"] += len(hits)
    return counts


def family_template_hits(
    query: SyntheticChain, release_date: str, members: Sequence[tuple[SyntheticChain, str, str, float]], cfg: SynthConfig
) -> tuple[list[Any], list[Any]]:
    """Template hits of ``query``: members of its family released at least
    ``cfg.template_min_age_days`` before it (a homologue's experimental structure, as a template
    search would find), best sequence identity first, at most ``cfg.max_template_hits``.

    Members share the family's residue numbering, so the alignment is the identity over the
    resolved residues of the hit. Returns (``TemplateHit`` list, ``HitOutcome`` list) for
    :meth:`StoreWriter.add_chain`; the outcomes carry the template structures, so training builds
    template features from the store alone, exactly as for a preprocessed PDB store.
    """
    from scalefold.data.parsers.hhr import TemplateHit
    from scalefold.data.templates import STAGE_OK, AlignedTemplate, HitOutcome

    if cfg.max_template_hits <= 0:
        return [], []
    cutoff = datetime.date.fromisoformat(release_date) - datetime.timedelta(days=cfg.template_min_age_days)
    candidates = []
    for member, pdb_id, date, _ in members:
        if member is query or datetime.date.fromisoformat(date) > cutoff:
            continue
        resolved = np.nonzero(member.all_atom_mask[:, rc.atom_order["CA"]] > 0)[0]
        identity = float(np.mean(member.aatype[resolved] == query.aatype[resolved])) if len(resolved) else 0.0
        candidates.append((identity, pdb_id, member, resolved))
    candidates.sort(key=lambda c: (-c[0], c[1]))
    hits, outcomes = [], []
    for rank, (identity, pdb_id, member, resolved) in enumerate(candidates[: cfg.max_template_hits]):
        # HHsearch-like Sum_probs: aligned columns weighted by identity (ranks the hits)
        sum_probs = float(round(len(resolved) * (0.5 + 0.5 * identity), 1))
        hits.append(
            TemplateHit(
                index=rank + 1, name=f"{pdb_id.upper()}_A synthetic family {query.family} member",
                aligned_cols=len(resolved), sum_probs=sum_probs, query=query.sequence, hit_sequence=member.sequence,
                indices_query=list(range(len(query.sequence))), indices_hit=list(range(len(member.sequence))),
            )
        )  # fmt: skip
        template = AlignedTemplate(
            domain_name=f"{pdb_id}_A", sum_probs=sum_probs, query_index=resolved.astype(np.int32),
            residues="".join(member.sequence[i] for i in resolved),
            all_atom_positions=member.all_atom_positions[resolved].astype(np.float32),
            all_atom_mask=member.all_atom_mask[resolved].astype(np.float32),
        )  # fmt: skip
        outcomes.append(HitOutcome(STAGE_OK, sum_probs, template=template))
    return hits, outcomes


__all__ = [
    "SynthConfig",
    "FoldTemplate",
    "SequenceModel",
    "SyntheticChain",
    "build_backbone",
    "backbone_to_atom14",
    "atom14_to_atom37_numpy",
    "dihedral",
    "make_fold_template",
    "pack_side_chains",
    "make_msa",
    "build_member",
    "generate_family",
    "min_interresidue_distance",
    "synthesize",
    "generate_families",
    "write_families",
    "family_template_hits",
    "radius_of_gyration",
]
