"""The structure module (Supplementary 1.8, Alg. 20) and its parts.

* :class:`InvariantPointAttention` -- Alg. 22;
* :class:`BackboneUpdate` -- Alg. 23;
* :class:`StructureModuleTransition` -- Alg. 20, lines 8-9;
* :class:`AngleResnet` -- Alg. 20, lines 11-14 (torsion angles);
* :class:`StructureModule` -- Alg. 20, with all-atom coordinates from Alg. 24
  (:mod:`scalefold.model.all_atom`).

Numerics follow the MLPerf reference (``openfold/model/structure_module.py`` and friends): frames
are quaternion-based inside the block loop, translations are in nanometres there and scaled by
``scale_factor`` (10: nm -> Angstrom) for every output, the rotation gradient is stopped between
blocks, and IPA uses softplus head weights, a bias on every projection and the reference's
scaling constants.

Precision: the structure module always runs its geometry in at least float32. Under a bf16 /
fp16 autocast region (or with low-precision inputs) :meth:`StructureModule.forward` disables
autocast and casts ``s``, ``z`` and ``mask`` to float32 (float64 inputs stay float64); if the
parameters themselves are low precision it runs on float32 copies of them (gradients flow back
to the originals). Outputs are then float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from scalefold.kernels import elementwise
from scalefold.model.all_atom import RigidGroupConstants, rigid_group_constants
from scalefold.model.config import StructureModuleConfig
from scalefold.model.primitives import LayerNorm, Linear
from scalefold.model.rigid import Rigid, Rotation

# softplus^-1(1): IPA head weights start at softplus(w) = 1.
SOFTPLUS_INVERSE_1 = 0.541324854612918


class InvariantPointAttention(nn.Module):
    """Invariant point attention (Alg. 22).

    Attention logits combine three terms, each with weight sqrt(1/3): scalar query-key products,
    a pair bias from ``z`` and (negative, head-weighted) squared distances between query and key
    points placed in global coordinates by each residue's frame. The output concatenates
    attended scalars, attended points mapped back into the local frame (and their norms) and
    attended pair features. The linear projections carry biases and LeCun init, as in the
    AlphaFold source (the supplement has no biases).

    The attention weights are needed for three kinds of values, one of them (``z``) different
    for every query, so this is not a standard ``kernels.attention`` call: the softmax is
    computed here.
    """

    def __init__(
        self,
        c_s: int,
        c_z: int,
        c_hidden: int,
        num_heads: int,
        num_qk_points: int,
        num_v_points: int,
        inf: float = 1e5,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.c_s = c_s
        self.c_z = c_z
        self.c_hidden = c_hidden
        self.num_heads = num_heads
        self.num_qk_points = num_qk_points
        self.num_v_points = num_v_points
        self.inf = inf
        self.eps = eps

        hc = num_heads * c_hidden
        self.linear_q = Linear(c_s, hc, bias=True, init="default")
        self.linear_kv = Linear(c_s, 2 * hc, bias=True, init="default")
        self.linear_q_points = Linear(c_s, num_heads * num_qk_points * 3, bias=True, init="default")
        self.linear_kv_points = Linear(c_s, num_heads * (num_qk_points + num_v_points) * 3, bias=True, init="default")
        self.linear_b = Linear(c_z, num_heads, bias=True, init="default")
        self.head_weights = nn.Parameter(torch.full((num_heads,), SOFTPLUS_INVERSE_1))
        concat_out_dim = num_heads * (c_z + c_hidden + num_v_points * 4)
        self.linear_out = Linear(concat_out_dim, c_s, bias=True, init="final")

    def _points(self, linear: Linear, s: torch.Tensor, r: Rigid, num_points: int) -> torch.Tensor:
        """Project ``s`` to per-head points and place them in global coordinates.

        The projection's output is laid out as [all x | all y | all z].
        Returns ``[*, N_res, H, num_points, 3]``.
        """
        # [*, N_res, H * P * 3] -> [*, N_res, H * P, 3], global (one compiled chain under --compile)
        pts = elementwise.chain("ipa_points")(linear(s), r.get_rots().get_cur_rot(), r.get_trans())
        return pts.view(pts.shape[:-2] + (self.num_heads, num_points, 3))

    def forward(self, s: torch.Tensor, z: torch.Tensor, r: Rigid, mask: torch.Tensor) -> torch.Tensor:
        """``s`` ``[*, N_res, c_s]``, ``z`` ``[*, N_res, N_res, c_z]``, frames ``r`` ``[*, N_res]``
        (nm), ``mask`` ``[*, N_res]``. Returns the update to ``s``, ``[*, N_res, c_s]``."""
        H, C = self.num_heads, self.c_hidden

        # Scalar queries, keys, values (keys and values interleaved per head).
        q = self.linear_q(s).view(s.shape[:-1] + (H, C))  # [*, N_res, H, C]
        kv = self.linear_kv(s).view(s.shape[:-1] + (H, 2 * C))
        k, v = torch.split(kv, C, dim=-1)  # [*, N_res, H, C] each

        # Points in the global frame.
        q_pts = self._points(self.linear_q_points, s, r, self.num_qk_points)  # [*, N_res, H, P_qk, 3]
        kv_pts = self._points(self.linear_kv_points, s, r, self.num_qk_points + self.num_v_points)
        k_pts, v_pts = torch.split(kv_pts, (self.num_qk_points, self.num_v_points), dim=-2)
        # k_pts: [*, N_res, H, P_qk, 3]; v_pts: [*, N_res, H, P_v, 3]

        b = self.linear_b(z)  # [*, N_res, N_res, H]

        # Scalar term + pair bias + point term (softplus head weights) + mask, softmax: [*, H, N_res, N_res].
        a = torch.matmul(q.movedim(-3, -2), k.movedim(-3, -1))
        scale_pt = math.sqrt(1.0 / (3 * (self.num_qk_points * 9.0 / 2)))
        a = elementwise.chain("ipa_logits")(
            a, b, q_pts, k_pts, self.head_weights, mask, math.sqrt(1.0 / (3 * C)), scale_pt, self.inf
        )

        # Attended scalars: [*, N_res, H * C].
        o = torch.matmul(a, v.transpose(-2, -3)).transpose(-2, -3)
        o = o.reshape(o.shape[:-2] + (H * C,))

        # Attended points, back in the local frame: [*, N_res, H, P_v, 3], and their norms.
        o_pt, o_pt_norm = elementwise.chain("ipa_attended_points")(
            a, v_pts, r.get_rots().get_cur_rot(), r.get_trans(), self.eps
        )
        o_pt_norm = o_pt_norm.reshape(o_pt_norm.shape[:-2] + (H * self.num_v_points,))
        o_pt = o_pt.reshape(o_pt.shape[:-3] + (H * self.num_v_points, 3))

        # Attended pair features: [*, N_res, H * c_z].
        o_pair = torch.matmul(a.transpose(-2, -3), z)
        o_pair = o_pair.reshape(o_pair.shape[:-2] + (H * self.c_z,))

        o_cat = torch.cat((o, *torch.unbind(o_pt, dim=-1), o_pt_norm, o_pair), dim=-1)
        return self.linear_out(o_cat)


class BackboneUpdate(nn.Module):
    """Backbone update (Alg. 23): ``s`` -> ``[*, N_res, 6]`` = quaternion vector part (b, c, d)
    of the update ``(1, b, c, d)`` and a translation (nm). Composition happens in
    :meth:`scalefold.model.rigid.Rigid.compose_q_update_vec`."""

    def __init__(self, c_s: int) -> None:
        super().__init__()
        self.linear = Linear(c_s, 6, bias=True, init="final")

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.linear(s)


class StructureModuleTransition(nn.Module):
    """Three-layer residual MLP on the single representation, then LayerNorm (Alg. 20, l. 8-9)."""

    def __init__(self, c_s: int, dropout_rate: float = 0.0) -> None:
        super().__init__()
        self.linear_1 = Linear(c_s, c_s, bias=True, init="relu")
        self.linear_2 = Linear(c_s, c_s, bias=True, init="relu")
        self.linear_3 = Linear(c_s, c_s, bias=True, init="final")
        self.dropout = nn.Dropout(dropout_rate)
        self.layer_norm = LayerNorm(c_s)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        s = s + self.linear_3(torch.relu(self.linear_2(torch.relu(self.linear_1(s)))))
        return self.layer_norm(self.dropout(s))


class AngleResnetBlock(nn.Module):
    """One residual block of the angle ResNet: ``a + W2 relu(W1 relu(a))``."""

    def __init__(self, c_hidden: int) -> None:
        super().__init__()
        self.linear_1 = Linear(c_hidden, c_hidden, bias=True, init="relu")
        self.linear_2 = Linear(c_hidden, c_hidden, bias=True, init="final")

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a + self.linear_2(torch.relu(self.linear_1(torch.relu(a))))


class AngleResnet(nn.Module):
    """Torsion-angle prediction (Alg. 20, lines 11-14).

    Returns the raw ``[*, N_res, num_angles, 2]`` (sin, cos) predictions and their L2-normalised
    version. The ReLUs on the inputs come from the AlphaFold source (absent in the supplement).
    """

    def __init__(self, c_s: int, c_hidden: int, num_blocks: int, num_angles: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.num_angles = num_angles
        self.eps = eps
        self.linear_in = Linear(c_s, c_hidden, bias=True, init="default")
        self.linear_initial = Linear(c_s, c_hidden, bias=True, init="default")
        self.layers = nn.ModuleList([AngleResnetBlock(c_hidden) for _ in range(num_blocks)])
        self.linear_out = Linear(c_hidden, num_angles * 2, bias=True, init="default")

    def forward(self, s: torch.Tensor, s_initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.linear_in(torch.relu(s)) + self.linear_initial(torch.relu(s_initial))
        # a: [*, N_res, c_hidden]
        for layer in self.layers:
            a = layer(a)
        a = self.linear_out(torch.relu(a))
        unnormalized_angles = a.view(a.shape[:-1] + (self.num_angles, 2))  # [*, N_res, num_angles, 2]
        norm = torch.sqrt(torch.clamp(torch.sum(unnormalized_angles**2, dim=-1, keepdim=True), min=self.eps))
        return unnormalized_angles, unnormalized_angles / norm


def _geometry_dtype(dtype: torch.dtype) -> torch.dtype:
    """The structure module computes in float32 at least (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class StructureModule(nn.Module):
    """Structure module (Alg. 20): single + pair representation -> frames, angles, atom14.

    Built from its config (the reference's ``structure_module_config`` fields); parameter names
    match the reference checkpoint (``structure_module.*``).

    Forward returns, stacked over the ``num_blocks`` iterations along dim 1:
    ``sm_frames`` ``[B, blocks, N, 7]`` (quaternion + translation in Angstrom),
    ``sm_sidechain_frames`` ``[B, blocks, N, 8, 4, 4]``, ``sm_unnormalized_angles`` and
    ``sm_angles`` ``[B, blocks, N, 7, 2]``, ``sm_positions`` ``[B, blocks, N, 14, 3]``,
    ``sm_states`` ``[B, blocks, N, c_s]``; plus ``sm_single`` ``[B, N, c_s]`` (the final ``s``).
    """

    def __init__(self, cfg: StructureModuleConfig) -> None:
        super().__init__()
        c_s = cfg.c_s
        self.num_blocks = cfg.num_blocks
        self.scale_factor = cfg.scale_factor
        self.layer_norm_s = LayerNorm(c_s)
        self.layer_norm_z = LayerNorm(cfg.c_z)
        self.linear_in = Linear(c_s, c_s, bias=True, init="default")
        self.ipa = InvariantPointAttention(
            c_s=c_s,
            c_z=cfg.c_z,
            c_hidden=cfg.c_hidden_ipa,
            num_heads=cfg.num_heads_ipa,
            num_qk_points=cfg.num_qk_points,
            num_v_points=cfg.num_v_points,
            inf=cfg.inf,
            eps=cfg.eps,
        )
        self.ipa_dropout = nn.Dropout(cfg.dropout_rate)
        self.layer_norm_ipa = LayerNorm(c_s)
        self.transition = StructureModuleTransition(c_s=c_s, dropout_rate=cfg.dropout_rate)
        self.bb_update = BackboneUpdate(c_s=c_s)
        self.angle_resnet = AngleResnet(
            c_s=c_s,
            c_hidden=cfg.c_hidden_ang_res,
            num_blocks=cfg.num_ang_res_blocks,
            num_angles=cfg.num_angles,
            eps=cfg.eps,
        )

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        mask: torch.Tensor,
        aatype: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """``s`` ``[B, N, c_s]``, ``z`` ``[B, N, N, c_z]``, ``mask`` ``[B, N]``, ``aatype`` ``[B, N]``."""
        dtype = _geometry_dtype(s.dtype)
        low_precision_params = [p for p in self.parameters() if p.dtype != dtype]
        if low_precision_params:
            # Run on ``dtype`` copies of the parameters; gradients reach the originals.
            params = {name: p.to(dtype) for name, p in self.named_parameters()}
            return torch.func.functional_call(self, params, (s.to(dtype), z.to(dtype), mask.to(dtype), aatype))
        with torch.autocast(device_type=s.device.type, enabled=False):
            return self._forward(s.to(dtype), z.to(dtype), mask.to(dtype), aatype)

    def _forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        mask: torch.Tensor,
        aatype: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        consts = rigid_group_constants(s.dtype, s.device)

        s = self.layer_norm_s(s)  # [B, N, c_s]
        z = self.layer_norm_z(z)  # [B, N, N, c_z]
        s_initial = s
        s = self.linear_in(s)

        # Black-hole initialisation: identity frames (quaternion format), translations in nm.
        # A constant: the reference makes it a leaf that requires grad in training, but nothing reads that
        # gradient (it is not a parameter), and torch.compile cannot trace a factory call with
        # requires_grad=True (a graph break); without it outputs and parameter gradients are the same.
        rigids = Rigid.identity(s.shape[:-1], dtype=s.dtype, device=s.device, requires_grad=False, fmt="quat")

        outputs: list[dict[str, torch.Tensor]] = []
        for _ in range(self.num_blocks):
            s, rigids, out = self._block(s, z, mask, aatype, s_initial, rigids, consts)
            outputs.append(out)

        stacked = {key: torch.stack([out[key] for out in outputs], dim=1) for key in outputs[0]}
        stacked["sm_single"] = s
        return stacked

    def _block(self, s: torch.Tensor, z: torch.Tensor, mask: torch.Tensor, aatype: torch.Tensor,
               s_initial: torch.Tensor, rigids: Rigid, consts: RigidGroupConstants):  # fmt: skip
        """One iteration of Alg. 20 -> ``(s, frames for the next one, this one's outputs)``. Its geometry
        runs as three elementwise chains (:mod:`scalefold.kernels.geometry`; plain PyTorch unless compiled):
        the backbone update, the side chains (Alg. 24) and the frame outputs."""
        s = s + self.ipa(s, z, rigids, mask)
        s = self.ipa_dropout(s)
        s = self.layer_norm_ipa(s)
        s = self.transition(s)  # [B, N, c_s]

        # New frames (quaternions, nm) and the side chains' backbone frames (rotation matrices, Angstrom).
        update = self.bb_update(s)
        quats, trans, backb_rots, backb_trans = elementwise.chain("backbone_update")(
            rigids.get_rots().get_quats(), rigids.get_trans(), update, self.scale_factor
        )
        unnormalized_angles, angles = self.angle_resnet(s, s_initial)  # [B, N, 7, 2] each
        group_rots, group_trans, pred_xyz = elementwise.chain("sidechain_frames")(
            backb_rots, backb_trans, angles, aatype, *consts
        )  # [B, N, 8, 3, 3], [B, N, 8, 3], [B, N, 14, 3]
        frames, sidechain_frames = elementwise.chain("structure_outputs")(
            quats, trans, group_rots, group_trans, self.scale_factor
        )
        out = {
            "sm_frames": frames,
            "sm_sidechain_frames": sidechain_frames,
            "sm_unnormalized_angles": unnormalized_angles,
            "sm_angles": angles,
            "sm_positions": pred_xyz,
            "sm_states": s,
        }
        # No gradient flows through the rotations into the next block (Alg. 20, line 20).
        return s, Rigid(Rotation(quats=quats.detach(), normalize_quats=False), trans), out


__all__ = [
    "InvariantPointAttention",
    "BackboneUpdate",
    "StructureModuleTransition",
    "AngleResnetBlock",
    "AngleResnet",
    "StructureModule",
    "SOFTPLUS_INVERSE_1",
]
