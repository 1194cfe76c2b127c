"""Frame Aligned Point Error (supplement 1.9.2, Algorithm 28) and the FAPE loss (1.9.3, eq. 29–31).

FAPE expresses every point in every local frame, for prediction and ground truth alike, and
averages the (optionally clamped) distance between the two. The AF2 loss uses it twice:

* backbone FAPE — the backbone frames of *every* structure-module iteration, points = frame
  origins (the C-alpha atoms), averaged over iterations; clamped at ``clamp_distance`` for a
  per-sample choice ``use_clamped_fape`` (1: clamped, 0: unclamped; 90 % clamped in training);
* side-chain FAPE — the 8 rigid groups x 14 atoms of the *final* iteration against the
  ground truth renamed by Algorithm 26 (always clamped).
"""

from __future__ import annotations

import torch

from scalefold.model.rigid import Rigid, Rotation


def compute_fape(
    pred_frames: Rigid,
    target_frames: Rigid,
    frames_mask: torch.Tensor,
    pred_positions: torch.Tensor,
    target_positions: torch.Tensor,
    positions_mask: torch.Tensor,
    length_scale: float,
    l1_clamp_distance: float | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Algorithm 28.

    Args:
        pred_frames:      [*, N_frames] predicted frames
        target_frames:    [*, N_frames] true frames
        frames_mask:      [*, N_frames]
        pred_positions:   [*, N_pts, 3]
        target_positions: [*, N_pts, 3]
        positions_mask:   [*, N_pts]
        length_scale: the error is divided by it (Z = 10 Å).
        l1_clamp_distance: clamp of the per-point error, ``None`` for unclamped.
        eps: regulariser of the distance and of the normalisation.
    Returns:
        [*] FAPE.
    """
    # Every point in every local frame. [*, N_frames, N_pts, 3]
    local_pred_pos = pred_frames.invert().unsqueeze(-1).apply(pred_positions[..., None, :, :])
    local_target_pos = target_frames.invert().unsqueeze(-1).apply(target_positions[..., None, :, :])

    # [*, N_frames, N_pts]
    error_dist = torch.sqrt(torch.sum((local_pred_pos - local_target_pos) ** 2, dim=-1) + eps)
    if l1_clamp_distance is not None:
        error_dist = torch.clamp(error_dist, min=0, max=l1_clamp_distance)

    normed_error = error_dist / length_scale
    normed_error = normed_error * frames_mask[..., None]
    normed_error = normed_error * positions_mask[..., None, :]

    # Mean over frames then points, normalising one axis at a time (fp16-friendly; matches the
    # reference's rounding).
    normed_error = torch.sum(normed_error, dim=-1)
    normed_error = normed_error / (eps + torch.sum(frames_mask, dim=-1))[..., None]
    normed_error = torch.sum(normed_error, dim=-1)
    return normed_error / (eps + torch.sum(positions_mask, dim=-1))


def backbone_fape_loss(
    backbone_rigid_tensor: torch.Tensor,
    backbone_rigid_mask: torch.Tensor,
    traj: torch.Tensor,
    use_clamped_fape: torch.Tensor | None = None,
    clamp_distance: float = 10.0,
    loss_unit_distance: float = 10.0,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Backbone FAPE averaged over structure-module iterations.

    Args:
        backbone_rigid_tensor: [*, N_res, 4, 4] true backbone frames
        backbone_rigid_mask:   [*, N_res]
        traj:                  [*, N_iter, N_res, 7] predicted frames (quaternion, translation)
            of every iteration (``sm_frames``)
        use_clamped_fape:      [*] 1.0 = clamped, 0.0 = unclamped; ``None`` = always clamped
    Returns:
        [*] loss.
    """
    # Quaternions -> rotation matrices (the reference computes FAPE in matrix form).
    pred = Rigid.from_tensor_7(traj)
    pred = Rigid(Rotation(rot_mats=pred.get_rots().get_rot_mats()), pred.get_trans())
    # [*, 1, N_res]: the same ground truth for every iteration.
    target = Rigid.from_tensor_4x4(backbone_rigid_tensor).unsqueeze(-2)
    mask = backbone_rigid_mask.unsqueeze(-2)

    def fape(clamp: float | None) -> torch.Tensor:
        # [*, N_iter]
        return compute_fape(
            pred_frames=pred,
            target_frames=target,
            frames_mask=mask,
            pred_positions=pred.get_trans(),
            target_positions=target.get_trans(),
            positions_mask=mask,
            length_scale=loss_unit_distance,
            l1_clamp_distance=clamp,
            eps=eps,
        )

    fape_value = fape(clamp_distance)
    if use_clamped_fape is not None:
        use_clamped = use_clamped_fape.unsqueeze(-1)
        fape_value = fape_value * use_clamped + fape(None) * (1 - use_clamped)
    return torch.mean(fape_value, dim=-1)


def sidechain_fape_loss(
    sidechain_frames: torch.Tensor,
    sidechain_atom_pos: torch.Tensor,
    rigidgroups_gt_frames: torch.Tensor,
    rigidgroups_alt_gt_frames: torch.Tensor,
    rigidgroups_gt_exists: torch.Tensor,
    renamed_atom14_gt_positions: torch.Tensor,
    renamed_atom14_gt_exists: torch.Tensor,
    alt_naming_is_better: torch.Tensor,
    clamp_distance: float = 10.0,
    length_scale: float = 10.0,
    eps: float = 1e-4,
) -> torch.Tensor:
    """All-atom FAPE of the final structure-module iteration (eq. 30).

    Args:
        sidechain_frames:            [*, N_iter, N_res, 8, 4, 4] predicted rigid-group frames
        sidechain_atom_pos:          [*, N_iter, N_res, 14, 3] predicted atom14 positions
        rigidgroups_gt_frames:       [*, N_res, 8, 4, 4]
        rigidgroups_alt_gt_frames:   [*, N_res, 8, 4, 4] frames of the swapped naming
        rigidgroups_gt_exists:       [*, N_res, 8]
        renamed_atom14_gt_positions: [*, N_res, 14, 3]
        renamed_atom14_gt_exists:    [*, N_res, 14]
        alt_naming_is_better:        [*, N_res]
    Returns:
        [*] loss.
    """
    use_alt = alt_naming_is_better[..., None, None, None]
    renamed_gt_frames = (1.0 - use_alt) * rigidgroups_gt_frames + use_alt * rigidgroups_alt_gt_frames

    # Final iteration, flattened over residues x groups / residues x atoms.
    batch_dims = rigidgroups_gt_exists.shape[:-2]
    pred_frames = Rigid.from_tensor_4x4(sidechain_frames[..., -1, :, :, :, :].reshape(*batch_dims, -1, 4, 4))
    target_frames = Rigid.from_tensor_4x4(renamed_gt_frames.reshape(*batch_dims, -1, 4, 4))
    pred_positions = sidechain_atom_pos[..., -1, :, :, :].reshape(*batch_dims, -1, 3)

    return compute_fape(
        pred_frames=pred_frames,
        target_frames=target_frames,
        frames_mask=rigidgroups_gt_exists.reshape(*batch_dims, -1),
        pred_positions=pred_positions,
        target_positions=renamed_atom14_gt_positions.reshape(*batch_dims, -1, 3),
        positions_mask=renamed_atom14_gt_exists.reshape(*batch_dims, -1),
        length_scale=length_scale,
        l1_clamp_distance=clamp_distance,
        eps=eps,
    )


def fape_loss(
    outputs: dict,
    batch: dict,
    backbone_clamp_distance: float = 10.0,
    backbone_loss_unit_distance: float = 10.0,
    backbone_weight: float = 0.5,
    sidechain_clamp_distance: float = 10.0,
    sidechain_length_scale: float = 10.0,
    sidechain_weight: float = 0.5,
    eps: float = 1e-4,
) -> torch.Tensor:
    """``backbone_weight * backbone FAPE + sidechain_weight * side-chain FAPE`` (eq. 7's L_FAPE).

    ``batch`` must already hold the renamed ground truth (:func:`compute_renamed_ground_truth`).
    Returns [*].
    """
    backbone = backbone_fape_loss(
        backbone_rigid_tensor=batch["backbone_rigid_tensor"],
        backbone_rigid_mask=batch["backbone_rigid_mask"],
        traj=outputs["sm_frames"],
        use_clamped_fape=batch.get("use_clamped_fape"),
        clamp_distance=backbone_clamp_distance,
        loss_unit_distance=backbone_loss_unit_distance,
        eps=eps,
    )
    sidechain = sidechain_fape_loss(
        sidechain_frames=outputs["sm_sidechain_frames"],
        sidechain_atom_pos=outputs["sm_positions"],
        rigidgroups_gt_frames=batch["rigidgroups_gt_frames"],
        rigidgroups_alt_gt_frames=batch["rigidgroups_alt_gt_frames"],
        rigidgroups_gt_exists=batch["rigidgroups_gt_exists"],
        renamed_atom14_gt_positions=batch["renamed_atom14_gt_positions"],
        renamed_atom14_gt_exists=batch["renamed_atom14_gt_exists"],
        alt_naming_is_better=batch["alt_naming_is_better"],
        clamp_distance=sidechain_clamp_distance,
        length_scale=sidechain_length_scale,
        eps=eps,
    )
    return backbone * backbone_weight + sidechain * sidechain_weight
