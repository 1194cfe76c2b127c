"""The model's feature interface: the batch validation table and the features built in the model.

* :data:`FEATURES` / :func:`validate_batch` -- every tensor of a training batch with its shape
  (after the leading batch dimension ``B`` and before the trailing recycling dimension ``R``),
  dtype and consumer, as produced by the reference data pipeline (``feature_shapes.tsv``).
* :func:`build_extra_msa_feat` -- Algorithm 2 line 15 input (one-hot, has-deletion, deletion value).
* :func:`build_template_angle_feat` -- Table 1 ``template_angle_feat`` (57 channels).
* :func:`build_template_pair_feat` -- Table 1 ``template_pair_feat`` (88 channels): pseudo-beta
  distogram, pseudo-beta mask, aatype one-hots, backbone unit vectors, backbone mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

# Residue / atom constants used here (AlphaFold's residue_constants ordering).
NUM_RESTYPES_WITH_X_AND_GAP = 22  # 20 amino acids + unknown + gap
NUM_MSA_CLASSES = 23  # + mask token
ATOM_N, ATOM_CA, ATOM_C = 0, 1, 2  # atom37 order: N, CA, C, CB, O, ...
PSI_TORSION_INDEX = 2  # torsion order: pre-omega, phi, psi, chi1..chi4

Dim = Union[int, str]


@dataclass(frozen=True)
class FeatureSpec:
    """Shape (without leading ``B`` and trailing ``R``), dtype kind and consumer of one feature."""

    shape: tuple[Dim, ...]
    dtype: str  # "int" (int64 indices) or "float"
    consumer: str  # "model", "loss", "model+loss", "unused"


def _f(shape: tuple[Dim, ...], consumer: str) -> FeatureSpec:
    return FeatureSpec(shape, "float", consumer)


def _i(shape: tuple[Dim, ...], consumer: str) -> FeatureSpec:
    return FeatureSpec(shape, "int", consumer)


# Symbols: N_res, N_clust, N_extra_seq, N_templ are bound by the batch; tf_dim / msa_dim by the config.
FEATURES: dict[str, FeatureSpec] = {
    "aatype": _i(("N_res",), "model+loss"),
    "all_atom_mask": _f(("N_res", 37), "loss"),
    "all_atom_positions": _f(("N_res", 37, 3), "loss"),
    "atom14_alt_gt_exists": _f(("N_res", 14), "loss"),
    "atom14_alt_gt_positions": _f(("N_res", 14, 3), "loss"),
    "atom14_atom_exists": _f(("N_res", 14), "loss"),
    "atom14_atom_is_ambiguous": _f(("N_res", 14), "loss"),
    "atom14_gt_exists": _f(("N_res", 14), "loss"),
    "atom14_gt_positions": _f(("N_res", 14, 3), "loss"),
    "atom37_atom_exists": _f(("N_res", 37), "model+loss"),
    "backbone_rigid_mask": _f(("N_res",), "loss"),
    "backbone_rigid_tensor": _f(("N_res", 4, 4), "loss"),
    "bert_mask": _f(("N_clust", "N_res"), "loss"),
    "chi_angles_sin_cos": _f(("N_res", 4, 2), "loss"),
    "chi_mask": _f(("N_res", 4), "loss"),
    "extra_deletion_value": _f(("N_extra_seq", "N_res"), "model"),
    "extra_has_deletion": _f(("N_extra_seq", "N_res"), "model"),
    "extra_msa": _i(("N_extra_seq", "N_res"), "model"),
    "extra_msa_mask": _f(("N_extra_seq", "N_res"), "model"),
    "extra_msa_row_mask": _f(("N_extra_seq",), "unused"),
    "is_distillation": _f((), "unused"),
    "msa_feat": _f(("N_clust", "N_res", "msa_dim"), "model"),
    "msa_mask": _f(("N_clust", "N_res"), "model"),
    "msa_row_mask": _f(("N_clust",), "unused"),
    "pseudo_beta": _f(("N_res", 3), "loss"),
    "pseudo_beta_mask": _f(("N_res",), "loss"),
    "residue_index": _i(("N_res",), "model+loss"),
    "residx_atom14_to_atom37": _i(("N_res", 14), "loss"),
    "residx_atom37_to_atom14": _i(("N_res", 37), "model"),
    "resolution": _f((), "loss"),
    "rigidgroups_alt_gt_frames": _f(("N_res", 8, 4, 4), "loss"),
    "rigidgroups_group_exists": _f(("N_res", 8), "unused"),
    "rigidgroups_group_is_ambiguous": _f(("N_res", 8), "unused"),
    "rigidgroups_gt_exists": _f(("N_res", 8), "loss"),
    "rigidgroups_gt_frames": _f(("N_res", 8, 4, 4), "loss"),
    "seq_length": _i((), "loss"),
    "seq_mask": _f(("N_res",), "model+loss"),
    "target_feat": _f(("N_res", "tf_dim"), "model"),
    "template_aatype": _i(("N_templ", "N_res"), "model"),
    "template_all_atom_mask": _f(("N_templ", "N_res", 37), "model"),
    "template_all_atom_positions": _f(("N_templ", "N_res", 37, 3), "model"),
    "template_alt_torsion_angles_sin_cos": _f(("N_templ", "N_res", 7, 2), "model"),
    "template_mask": _f(("N_templ",), "model"),
    "template_pseudo_beta": _f(("N_templ", "N_res", 3), "model"),
    "template_pseudo_beta_mask": _f(("N_templ", "N_res"), "model"),
    "template_sum_probs": _f(("N_templ", 1), "unused"),
    "template_torsion_angles_mask": _f(("N_templ", "N_res", 7), "model"),
    "template_torsion_angles_sin_cos": _f(("N_templ", "N_res", 7, 2), "model"),
    "true_msa": _i(("N_clust", "N_res"), "loss"),
    "use_clamped_fape": _f((), "loss"),
}


def required_features(consumer: str, templates_enabled: bool = True) -> tuple[str, ...]:
    """Names of the features ``consumer`` (``"model"`` or ``"loss"``) reads."""
    names = [n for n, spec in FEATURES.items() if consumer in spec.consumer.split("+")]
    if not templates_enabled:
        names = [n for n in names if not n.startswith("template_")]
    return tuple(names)


def validate_batch(
    batch: Mapping[str, torch.Tensor],
    names: Iterable[str],
    symbols: Mapping[str, int] | None = None,
    recycling_dim: bool = True,
) -> dict[str, int]:
    """Check that ``batch`` holds every feature in ``names`` with the right rank, shape and dtype.

    Every feature is ``[B, *spec.shape, R]`` (``R`` only when ``recycling_dim``); ``B``, ``R`` and
    the symbolic sizes (``N_res``, ``N_clust``, ...) must agree across features. ``symbols``
    pre-binds sizes (e.g. ``tf_dim``/``msa_dim`` from the config). Raises ``ValueError`` naming
    the offending feature; returns the bound sizes.
    """
    bound: dict[str, int] = dict(symbols or {})
    first: dict[str, str] = {k: "the model config" for k in bound}
    for name in names:
        spec = FEATURES[name]
        if name not in batch:
            raise ValueError(f"batch is missing feature {name!r} (expected shape {_describe(spec, recycling_dim)})")
        t = batch[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"feature {name!r} must be a torch.Tensor, got {type(t).__name__}")
        dims: tuple[Dim, ...] = ("B",) + spec.shape + (("R",) if recycling_dim else ())
        if t.dim() != len(dims):
            raise ValueError(
                f"feature {name!r} has rank {t.dim()} (shape {tuple(t.shape)}); "
                f"expected rank {len(dims)}: {_describe(spec, recycling_dim)}"
            )
        for axis, (dim, size) in enumerate(zip(dims, t.shape)):
            if isinstance(dim, int):
                ok, want = size == dim, str(dim)
            elif dim in bound:
                ok, want = size == bound[dim], f"{dim}={bound[dim]} (from {first[dim]})"
            else:
                bound[dim], first[dim] = size, repr(name)
                ok, want = True, ""
            if not ok:
                raise ValueError(
                    f"feature {name!r} has shape {tuple(t.shape)}: axis {axis} is {size}, expected {want}; "
                    f"layout {_describe(spec, recycling_dim)}"
                )
        if spec.dtype == "int" and t.dtype != torch.int64:
            raise ValueError(f"feature {name!r} has dtype {t.dtype}; expected torch.int64 (indices)")
        if spec.dtype == "float" and not t.is_floating_point():
            raise ValueError(f"feature {name!r} has dtype {t.dtype}; expected a floating-point dtype")
    return bound


def _describe(spec: FeatureSpec, recycling_dim: bool) -> str:
    dims = ("B",) + spec.shape + (("R",) if recycling_dim else ())
    return "[" + ", ".join(str(d) for d in dims) + f"] {'int64' if spec.dtype == 'int' else 'float'}"


# --------------------------------------------------------------------------------------------
# Feature builders
# --------------------------------------------------------------------------------------------


def build_extra_msa_feat(
    extra_msa: torch.Tensor,
    extra_has_deletion: torch.Tensor,
    extra_deletion_value: torch.Tensor,
) -> torch.Tensor:
    """Extra-MSA features (Table 1): one-hot over 23 classes, has-deletion, deletion value.

    Returns ``[*, N_extra_seq, N_res, 25]`` in the dtype of ``extra_has_deletion``.
    """
    dtype = extra_has_deletion.dtype
    one_hot = F.one_hot(extra_msa, num_classes=NUM_MSA_CLASSES).to(dtype)
    return torch.cat([one_hot, extra_has_deletion.unsqueeze(-1), extra_deletion_value.unsqueeze(-1)], dim=-1)


def build_template_angle_feat(
    template_aatype: torch.Tensor,
    template_torsion_angles_sin_cos: torch.Tensor,
    template_alt_torsion_angles_sin_cos: torch.Tensor,
    template_torsion_angles_mask: torch.Tensor,
) -> torch.Tensor:
    """``template_angle_feat`` (Table 1): aatype one-hot (22), torsion sin/cos (14),
    alternative torsion sin/cos (14), torsion mask (7). Returns ``[*, N_templ, N_res, 57]``."""
    dtype = template_torsion_angles_sin_cos.dtype
    lead = template_torsion_angles_sin_cos.shape[:-2]
    return torch.cat(
        [
            F.one_hot(template_aatype, num_classes=NUM_RESTYPES_WITH_X_AND_GAP).to(dtype),
            template_torsion_angles_sin_cos.reshape(lead + (-1,)),
            template_alt_torsion_angles_sin_cos.reshape(lead + (-1,)),
            template_torsion_angles_mask,
        ],
        dim=-1,
    )


def backbone_frames_from_reference(
    n_xyz: torch.Tensor, ca_xyz: torch.Tensor, c_xyz: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation ``R`` and origin (CA) of the backbone frame: x along CA->C, N in the xy-plane.

    Built as AlphaFold's ``make_transform_from_reference``: two rotations carry C onto the
    x-axis, a third puts N in the xy-plane. ``R`` maps global into local coordinates:
    ``local = R (x - ca)``. Shapes ``[*, 3]`` -> ``[*, 3, 3]``, ``[*, 3]``.
    """
    n = n_xyz - ca_xyz
    c = c_xyz - ca_xyz
    c_x, c_y, c_z = c.unbind(-1)
    zeros, ones = torch.zeros_like(c_x), torch.ones_like(c_x)

    norm = torch.sqrt(eps + c_x**2 + c_y**2)
    sin_1, cos_1 = -c_y / norm, c_x / norm
    rot_1 = torch.stack([cos_1, -sin_1, zeros, sin_1, cos_1, zeros, zeros, zeros, ones], dim=-1)
    rot_1 = rot_1.reshape(c_x.shape + (3, 3))

    norm = torch.sqrt(eps + c_x**2 + c_y**2 + c_z**2)
    sin_2 = c_z / norm
    cos_2 = torch.sqrt(c_x**2 + c_y**2) / norm
    rot_2 = torch.stack([cos_2, zeros, sin_2, zeros, ones, zeros, -sin_2, zeros, cos_2], dim=-1)
    rot_2 = rot_2.reshape(c_x.shape + (3, 3))

    rot_c = rot_2 @ rot_1
    n = (rot_c @ n.unsqueeze(-1)).squeeze(-1)
    _, n_y, n_z = n.unbind(-1)
    norm = torch.sqrt(eps + n_y**2 + n_z**2)
    sin_n, cos_n = -n_z / norm, n_y / norm
    rot_n = torch.stack([ones, zeros, zeros, zeros, cos_n, -sin_n, zeros, sin_n, cos_n], dim=-1)
    rot_n = rot_n.reshape(c_x.shape + (3, 3))
    return rot_n @ rot_c, ca_xyz


def build_template_pair_feat(
    template_aatype: torch.Tensor,
    template_pseudo_beta: torch.Tensor,
    template_pseudo_beta_mask: torch.Tensor,
    template_all_atom_positions: torch.Tensor,
    template_all_atom_mask: torch.Tensor,
    min_bin: float,
    max_bin: float,
    num_bins: int,
    use_unit_vector: bool,
    inf: float,
    eps: float,
) -> torch.Tensor:
    """``template_pair_feat`` (Table 1, Algorithm 2 line 9 input).

    Channels: pseudo-beta distogram (``num_bins``), pseudo-beta pair mask (1), aatype one-hot of
    residue j (22) and of residue i (22), unit vector from the frame of i to CA of j (3; zero
    unless ``use_unit_vector``), backbone pair mask (1) -- 88 for 39 bins. Everything is
    multiplied by the backbone (N, CA, C present) pair mask, as in the reference.
    Inputs ``[*, N_res, ...]`` (any leading dims, e.g. ``[B, N_templ]``); returns
    ``[*, N_res, N_res, C]`` in the dtype of ``template_pseudo_beta``.
    """
    dtype = template_pseudo_beta.dtype
    pb_mask_2d = template_pseudo_beta_mask.unsqueeze(-1) * template_pseudo_beta_mask.unsqueeze(-2)
    # [*, N_res, N_res]

    # Distogram of squared pseudo-beta distances; bin edges as in the reference (default dtype).
    tpb = template_pseudo_beta
    d2 = torch.sum((tpb.unsqueeze(-2) - tpb.unsqueeze(-3)) ** 2, dim=-1, keepdim=True)
    lower = torch.linspace(min_bin, max_bin, num_bins, device=tpb.device) ** 2
    upper = torch.cat([lower[1:], lower.new_full((1,), inf)], dim=-1)  # new_full: no host-to-device copy
    dgram = ((d2 > lower) & (d2 < upper)).to(dtype)
    # [*, N_res, N_res, num_bins]

    n_res = template_aatype.shape[-1]
    aatype_1hot = F.one_hot(template_aatype, num_classes=NUM_RESTYPES_WITH_X_AND_GAP).to(dtype)
    aatype_j = aatype_1hot.unsqueeze(-3).expand(aatype_1hot.shape[:-2] + (n_res, n_res, -1))
    aatype_i = aatype_1hot.unsqueeze(-2).expand(aatype_1hot.shape[:-2] + (n_res, n_res, -1))

    atom_mask = template_all_atom_mask
    bb_mask = atom_mask[..., ATOM_N] * atom_mask[..., ATOM_CA] * atom_mask[..., ATOM_C]
    bb_mask_2d = bb_mask.unsqueeze(-1) * bb_mask.unsqueeze(-2)

    if use_unit_vector:
        pos = template_all_atom_positions
        rot, origin = backbone_frames_from_reference(
            pos[..., ATOM_N, :], pos[..., ATOM_CA, :], pos[..., ATOM_C, :], eps=eps
        )
        # CA of j in the frame of i: R_i (ca_j - ca_i)  -> [*, N_res, N_res, 3]
        delta = origin.unsqueeze(-3) - origin.unsqueeze(-2)
        rigid_vec = torch.einsum("...iab,...ijb->...ija", rot, delta)
        inv_distance = torch.rsqrt(eps + torch.sum(rigid_vec**2, dim=-1)) * bb_mask_2d
        unit_vector = (rigid_vec * inv_distance.unsqueeze(-1)).to(dtype)
    else:
        unit_vector = dgram.new_zeros(dgram.shape[:-1] + (3,))

    t = torch.cat(
        [
            dgram,
            pb_mask_2d.unsqueeze(-1).to(dtype),
            aatype_j,
            aatype_i,
            unit_vector,
            bb_mask_2d.unsqueeze(-1).to(dtype),
        ],
        dim=-1,
    )
    return t * bb_mask_2d.unsqueeze(-1).to(dtype)


# --------------------------------------------------------------------------------------------
# Synthetic batches (smoke tests, benchmarks, the demo before real data is available)
# --------------------------------------------------------------------------------------------

_INT_RANGES = {
    "aatype": 20,
    "extra_msa": NUM_MSA_CLASSES,
    "true_msa": NUM_MSA_CLASSES - 1,
    "template_aatype": NUM_RESTYPES_WITH_X_AND_GAP,
    "residx_atom14_to_atom37": 37,
    "residx_atom37_to_atom14": 14,
}


def make_synthetic_batch(
    n_res: int,
    n_clust: int,
    n_extra_seq: int,
    n_templ: int,
    num_recycling_iters: int = 0,
    batch_size: int = 1,
    tf_dim: int = 22,
    msa_dim: int = 49,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """A random batch with every feature of :data:`FEATURES` in its pipeline layout
    ``[B, ..., R]`` (``R = num_recycling_iters + 1``). Values are plausible, not physical:
    masks are 1, positions are Gaussian (10 A), frames are translations, angles unit vectors.
    """
    g = torch.Generator().manual_seed(seed)
    sizes = {
        "N_res": n_res,
        "N_clust": n_clust,
        "N_extra_seq": n_extra_seq,
        "N_templ": n_templ,
        "tf_dim": tf_dim,
        "msa_dim": msa_dim,
    }
    r = num_recycling_iters + 1
    batch: dict[str, torch.Tensor] = {}
    for name, spec in FEATURES.items():
        shape = (batch_size,) + tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape) + (r,)
        if name == "residue_index":
            t = torch.arange(n_res).view(1, n_res, 1).expand(shape).clone()
        elif name == "seq_length":
            t = torch.full(shape, n_res, dtype=torch.int64)
        elif spec.dtype == "int":
            t = torch.randint(0, _INT_RANGES[name], shape, generator=g)
        elif name.endswith("positions") or name.endswith("pseudo_beta"):
            t = torch.randn(shape, generator=g, dtype=dtype) * 10.0
        elif name.endswith("frames") or name == "backbone_rigid_tensor":
            t = torch.eye(4, dtype=dtype).view((1,) * (len(shape) - 3) + (4, 4, 1)).repeat(shape[:-3] + (1, 1, r))
            t[..., :3, 3, :] = torch.randn(t[..., :3, 3, :].shape, generator=g, dtype=dtype) * 10.0
        elif name.endswith("sin_cos"):
            angle = torch.rand(shape[:-2] + (1, r), generator=g, dtype=dtype) * 6.283185307179586
            t = torch.cat([torch.sin(angle), torch.cos(angle)], dim=-2)
        elif name in ("msa_feat", "target_feat", "extra_deletion_value"):
            t = torch.rand(shape, generator=g, dtype=dtype)
        elif name in ("extra_has_deletion", "is_distillation", "atom14_atom_is_ambiguous"):
            t = torch.zeros(shape, dtype=dtype)
        elif name == "resolution":
            t = torch.full(shape, 2.0, dtype=dtype)
        else:  # masks
            t = torch.ones(shape, dtype=dtype)
        batch[name] = t.to(device) if device is not None else t
    return batch


__all__ = [
    "FEATURES",
    "make_synthetic_batch",
    "FeatureSpec",
    "required_features",
    "validate_batch",
    "build_extra_msa_feat",
    "build_template_angle_feat",
    "build_template_pair_feat",
    "backbone_frames_from_reference",
]
