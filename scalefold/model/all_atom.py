"""From backbone frames and torsion angles to all-atom coordinates (Supplementary 1.8.4, Alg. 24).

* :func:`torsion_angles_to_frames` -- the 8 rigid-group frames per residue (backbone, pre-omega,
  phi, psi, chi1..chi4) in global coordinates (Alg. 24, lines 1-10);
* :func:`frames_and_literature_positions_to_atom14_pos` -- idealised atom positions placed by
  their group's frame (Alg. 24, line 11), atom14 layout;
* :func:`atom14_to_atom37` -- compact atom14 layout -> the 37-atom-type layout;
* :func:`pseudo_beta_fn` -- CB (CA for glycine) positions, used by recycling and distograms.

The per-residue-type constant tables come from :mod:`scalefold.residue_constants`; they are
float32 there (as in the reference) and converted to the compute dtype by
:func:`rigid_group_constants`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Union

import torch

from scalefold import residue_constants as rc
from scalefold.kernels import geometry
from scalefold.model.rigid import Rigid, Rotation


class RigidGroupConstants(NamedTuple):
    """Residue-type tables used by Alg. 24, as tensors (index 0 = ``restype_order``, 21 rows)."""

    default_frames: torch.Tensor  # [21, 8, 4, 4] rigid group -> parent group
    group_idx: torch.Tensor  # [21, 14] int64 rigid group of each atom14 slot
    atom_mask: torch.Tensor  # [21, 14] 1 where the atom14 slot holds an atom
    lit_positions: torch.Tensor  # [21, 14, 3] idealised positions in the group frame


@functools.cache
def rigid_group_constants(dtype: torch.dtype, device: torch.device) -> RigidGroupConstants:
    """The Alg. 24 constant tables in ``dtype`` on ``device`` (cached; never require grad).

    Converted from the float32 numpy tables, so float64 gets exactly the reference's values.
    Built outside inference mode so the cached tensors are usable by later autograd passes. A fake-tensor
    step must find them built (real) already: :func:`scalefold.perf.memory.estimate_memory` builds them
    before it enters its fake mode, else the cache would keep fake tensors a later real step cannot use.
    """
    with torch.inference_mode(False):
        return _make_rigid_group_constants(dtype, device)


def _make_rigid_group_constants(dtype: torch.dtype, device: torch.device) -> RigidGroupConstants:
    return RigidGroupConstants(
        default_frames=torch.tensor(rc.restype_rigid_group_default_frame, dtype=dtype, device=device),
        group_idx=torch.tensor(rc.restype_atom14_to_rigid_group, dtype=torch.long, device=device),
        atom_mask=torch.tensor(rc.restype_atom14_mask, dtype=dtype, device=device),
        lit_positions=torch.tensor(rc.restype_atom14_rigid_group_positions, dtype=dtype, device=device),
    )


def torsion_angles_to_frames(
    backb_to_global: Rigid,
    alpha: torch.Tensor,
    aatype: torch.Tensor,
    default_frames: torch.Tensor,
) -> Rigid:
    """Rigid-group frames from backbone frames and torsion angles (Alg. 24, lines 1-10).

    The arithmetic is :func:`scalefold.kernels.geometry.torsion_angles_to_frames` (the structure module
    runs it inside its ``sidechain_frames`` chain, compiled under ``--compile``).

    Args:
        backb_to_global: ``[*, N]`` backbone frames (Angstrom).
        alpha: ``[*, N, 7, 2]`` (sin, cos) of pre-omega, phi, psi, chi1..chi4.
        aatype: ``[*, N]`` residue types.
        default_frames: ``[21, 8, 4, 4]`` group-to-parent literature frames.

    Returns:
        ``[*, N, 8]`` frames of all rigid groups in global coordinates.
    """
    rot = backb_to_global.get_rots().get_cur_rot()
    rots, trans = geometry.torsion_angles_to_frames(rot, backb_to_global.get_trans(), alpha, aatype, default_frames)
    return Rigid(Rotation(rot_mats=rots), trans)


def frames_and_literature_positions_to_atom14_pos(
    frames: Rigid,
    aatype: torch.Tensor,
    group_idx: torch.Tensor,
    atom_mask: torch.Tensor,
    lit_positions: torch.Tensor,
) -> torch.Tensor:
    """Place each atom's literature position with its rigid group's frame (Alg. 24, line 11):
    :func:`scalefold.kernels.geometry.atom14_positions`.

    Args:
        frames: ``[*, N, 8]`` rigid-group frames in global coordinates.
        aatype: ``[*, N]`` residue types.
        group_idx: ``[21, 14]`` group of each atom14 slot.
        atom_mask: ``[21, 14]`` atom14 existence per residue type.
        lit_positions: ``[21, 14, 3]`` positions in the group frame.

    Returns:
        ``[*, N, 14, 3]`` atom positions (zero where the residue has no such atom).
    """
    rots = frames.get_rots().get_rot_mats()
    return geometry.atom14_positions(rots, frames.get_trans(), aatype, group_idx, atom_mask, lit_positions)


def atom14_to_atom37(atom14: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scatter atom14 data ``[*, N, 14, ...]`` into the atom37 layout ``[*, N, 37, ...]``.

    Uses the per-residue features ``residx_atom37_to_atom14`` ``[*, N, 37]`` (the atom14 slot of
    each atom type) and ``atom37_atom_exists`` ``[*, N, 37]`` (zeroes atom types the residue
    lacks).
    """
    index = batch["residx_atom37_to_atom14"].long()
    exists = batch["atom37_atom_exists"]
    extra_dims = atom14.shape[index.ndim :]  # e.g. (3,) for coordinates
    index = index.reshape(index.shape + (1,) * len(extra_dims)).expand(index.shape + tuple(extra_dims))
    atom37 = torch.gather(atom14, index.ndim - len(extra_dims) - 1, index)
    return atom37 * exists.reshape(exists.shape + (1,) * len(extra_dims)).to(atom37.dtype)


def pseudo_beta_fn(
    aatype: torch.Tensor,
    all_atom_positions: torch.Tensor,
    all_atom_mask: torch.Tensor | None = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """CB position (CA for glycine) from atom37 positions ``[*, N, 37, 3]`` -> ``[*, N, 3]``.

    With ``all_atom_mask`` ``[*, N, 37]`` also returns the matching ``[*, N]`` mask.
    """
    is_gly = aatype == rc.restype_order["G"]
    ca_idx, cb_idx = rc.atom_order["CA"], rc.atom_order["CB"]
    pseudo_beta = torch.where(is_gly[..., None], all_atom_positions[..., ca_idx, :], all_atom_positions[..., cb_idx, :])
    if all_atom_mask is None:
        return pseudo_beta
    pseudo_beta_mask = torch.where(is_gly, all_atom_mask[..., ca_idx], all_atom_mask[..., cb_idx])
    return pseudo_beta, pseudo_beta_mask


__all__ = [
    "RigidGroupConstants",
    "rigid_group_constants",
    "torsion_angles_to_frames",
    "frames_and_literature_positions_to_atom14_pos",
    "atom14_to_atom37",
    "pseudo_beta_fn",
]
