"""Rigid-body transformations ("frames", Supplementary 1.1): ``Rotation`` and ``Rigid``.

A ``Rotation`` holds a batch of rotations either as ``[*, 3, 3]`` matrices or as ``[*, 4]``
quaternions ``(w, x, y, z)``; a ``Rigid`` is a ``Rotation`` plus a ``[*, 3]`` translation,
``T x = R x + t``. Both behave like tensors of shape ``[*]`` (indexing, ``unsqueeze``, ``cat``,
``map_tensor_fn``) and are fully differentiable.

Precision: unlike the reference (which forces float32 storage for mixed precision), these
classes keep the dtype they are given -- float64 stays float64, so float64 runs match the
goldens to ~1e-10. Callers that need fp32 geometry under autocast (the structure module) cast
their inputs explicitly. The matrix products are written out elementwise, so autocast never
downcasts them.

The API follows OpenFold's ``rigid_utils`` so code written against it reads the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# The written-out rotation algebra lives with the geometry chains of the kernels (the structure module's
# compiled chains and these classes run the very same functions).
from scalefold.kernels.geometry import invert_rot_mat, quat_multiply_by_vec, quat_to_rot, rot_matmul, rot_vec_mul

# ---------------------------------------------------------------------------------------------
# Elementwise rotation algebra
# ---------------------------------------------------------------------------------------------


def rot_to_quat(rot: torch.Tensor) -> torch.Tensor:
    """``[*, 3, 3]`` rotation matrices -> ``[*, 4]`` unit quaternions.

    The quaternion is the top eigenvector of the symmetric 4x4 matrix K built from ``rot``
    (Bar-Itzhack's method), so the sign is arbitrary (q and -q are the same rotation).
    Half-precision inputs are decomposed in float32 (``eigh`` has no bf16/fp16 kernels).
    """
    if rot.shape[-2:] != (3, 3):
        raise ValueError("Input rotation is incorrectly shaped")
    (xx, xy, xz), (yx, yy, yz), (zx, zy, zz) = [[rot[..., i, j] for j in range(3)] for i in range(3)]
    k = [
        [xx + yy + zz, zy - yz, xz - zx, yx - xy],
        [zy - yz, xx - yy - zz, xy + yx, xz + zx],
        [xz - zx, xy + yx, yy - xx - zz, yz + zy],
        [yx - xy, xz + zx, yz + zy, zz - xx - yy],
    ]
    k = (1.0 / 3.0) * torch.stack([torch.stack(row, dim=-1) for row in k], dim=-2)
    if k.dtype in (torch.bfloat16, torch.float16):
        _, vectors = torch.linalg.eigh(k.float())
        return vectors[..., -1].to(rot.dtype)
    _, vectors = torch.linalg.eigh(k)
    return vectors[..., -1]


def quat_multiply(quat1: torch.Tensor, quat2: torch.Tensor) -> torch.Tensor:
    """Hamilton product ``quat1 * quat2`` of ``[*, 4]`` quaternions."""
    a1, b1, c1, d1 = torch.unbind(quat1, dim=-1)
    a2, b2, c2, d2 = torch.unbind(quat2, dim=-1)
    return torch.stack(
        [
            a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
            a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
            a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
            a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2,
        ],
        dim=-1,
    )


def invert_quat(quat: torch.Tensor) -> torch.Tensor:
    """Inverse ``conj(q) / |q|^2`` of ``[*, 4]`` quaternions."""
    conj = torch.cat([quat[..., :1], -quat[..., 1:]], dim=-1)
    return conj / torch.sum(quat**2, dim=-1, keepdim=True)


def identity_rot_mats(
    batch_dims: tuple[int, ...],
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    requires_grad: bool = True,
) -> torch.Tensor:
    """``[*batch_dims, 3, 3]`` identity matrices."""
    rots = torch.eye(3, dtype=dtype, device=device)
    rots = rots.view((1,) * len(batch_dims) + (3, 3)).expand(tuple(batch_dims) + (3, 3)).contiguous()
    return rots.requires_grad_(requires_grad)


def identity_trans(
    batch_dims: tuple[int, ...],
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    requires_grad: bool = True,
) -> torch.Tensor:
    """``[*batch_dims, 3]`` zero translations."""
    return torch.zeros(tuple(batch_dims) + (3,), dtype=dtype, device=device, requires_grad=requires_grad)


def identity_quats(
    batch_dims: tuple[int, ...],
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    requires_grad: bool = True,
) -> torch.Tensor:
    """``[*batch_dims, 4]`` identity quaternions ``(1, 0, 0, 0)``."""
    quats = torch.zeros(tuple(batch_dims) + (4,), dtype=dtype, device=device)
    quats[..., 0] = 1
    return quats.requires_grad_(requires_grad)


# ---------------------------------------------------------------------------------------------
# Rotation
# ---------------------------------------------------------------------------------------------


class Rotation:
    """A batch of 3D rotations stored as matrices ``[*, 3, 3]`` or quaternions ``[*, 4]``.

    Exactly one of ``rot_mats`` / ``quats`` is given; the stored format is never changed in
    place (``get_rot_mats`` / ``get_quats`` convert on the fly). ``shape`` is the batch shape.
    """

    def __init__(
        self,
        rot_mats: torch.Tensor | None = None,
        quats: torch.Tensor | None = None,
        normalize_quats: bool = True,
    ) -> None:
        if (rot_mats is None) == (quats is None):
            raise ValueError("Exactly one of rot_mats and quats must be specified")
        if rot_mats is not None and rot_mats.shape[-2:] != (3, 3):
            raise ValueError("Incorrectly shaped rotation matrix")
        if quats is not None and quats.shape[-1] != 4:
            raise ValueError("Incorrectly shaped quaternion")
        if quats is not None and normalize_quats:
            quats = quats / torch.linalg.norm(quats, dim=-1, keepdim=True)
        self._rot_mats = rot_mats
        self._quats = quats

    @staticmethod
    def identity(
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        requires_grad: bool = True,
        fmt: str = "quat",
    ) -> Rotation:
        """Identity rotations of batch shape ``shape``; ``fmt`` is ``"quat"`` or ``"rot_mat"``."""
        if fmt == "rot_mat":
            return Rotation(rot_mats=identity_rot_mats(shape, dtype, device, requires_grad))
        if fmt == "quat":
            return Rotation(quats=identity_quats(shape, dtype, device, requires_grad), normalize_quats=False)
        raise ValueError(f"Invalid format: {fmt}")

    # -- tensor-like behaviour ----------------------------------------------------------------

    def _wrap(self, rot_mats: torch.Tensor | None = None, quats: torch.Tensor | None = None) -> Rotation:
        return Rotation(rot_mats=rot_mats) if rot_mats is not None else Rotation(quats=quats, normalize_quats=False)

    def __getitem__(self, index: Any) -> Rotation:
        if not isinstance(index, tuple):
            index = (index,)
        if self._rot_mats is not None:
            return self._wrap(rot_mats=self._rot_mats[index + (slice(None), slice(None))])
        return self._wrap(quats=self._quats[index + (slice(None),)])

    def __mul__(self, right: torch.Tensor) -> Rotation:
        """Pointwise multiplication with a ``[*]`` tensor (e.g. a mask)."""
        if not isinstance(right, torch.Tensor):
            raise TypeError("The other multiplicand must be a Tensor")
        if self._rot_mats is not None:
            return self._wrap(rot_mats=self._rot_mats * right[..., None, None])
        return self._wrap(quats=self._quats * right[..., None])

    def __rmul__(self, left: torch.Tensor) -> Rotation:
        return self.__mul__(left)

    @property
    def shape(self) -> torch.Size:
        """Batch shape (the rotation dims excluded)."""
        return self._quats.shape[:-1] if self._quats is not None else self._rot_mats.shape[:-2]

    @property
    def dtype(self) -> torch.dtype:
        return self.get_cur_rot().dtype

    @property
    def device(self) -> torch.device:
        return self.get_cur_rot().device

    @property
    def requires_grad(self) -> bool:
        return self.get_cur_rot().requires_grad

    def get_cur_rot(self) -> torch.Tensor:
        """The stored tensor, in whichever format it is held."""
        return self._rot_mats if self._rot_mats is not None else self._quats

    def get_rot_mats(self) -> torch.Tensor:
        """Rotations as ``[*, 3, 3]`` matrices."""
        return self._rot_mats if self._rot_mats is not None else quat_to_rot(self._quats)

    def get_quats(self) -> torch.Tensor:
        """Rotations as ``[*, 4]`` quaternions (an eigen-decomposition if stored as matrices)."""
        return self._quats if self._quats is not None else rot_to_quat(self._rot_mats)

    def unsqueeze(self, dim: int) -> Rotation:
        """Like ``torch.unsqueeze`` over the batch dims."""
        if dim > len(self.shape):
            raise ValueError("Invalid dimension")
        if self._rot_mats is not None:
            return self._wrap(rot_mats=self._rot_mats.unsqueeze(dim if dim >= 0 else dim - 2))
        return self._wrap(quats=self._quats.unsqueeze(dim if dim >= 0 else dim - 1))

    @staticmethod
    def cat(rs: Sequence[Rotation], dim: int) -> Rotation:
        """Concatenate along a batch dim; the result is always in matrix format."""
        rot_mats = torch.cat([r.get_rot_mats() for r in rs], dim=dim if dim >= 0 else dim - 2)
        return Rotation(rot_mats=rot_mats)

    def map_tensor_fn(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Rotation:
        """Apply ``fn`` to each of the 9 (matrix) or 4 (quaternion) component tensors ``[*]``."""
        if self._rot_mats is not None:
            flat = self._rot_mats.reshape(self._rot_mats.shape[:-2] + (9,))
            flat = torch.stack([fn(c) for c in torch.unbind(flat, dim=-1)], dim=-1)
            return self._wrap(rot_mats=flat.reshape(flat.shape[:-1] + (3, 3)))
        quats = torch.stack([fn(c) for c in torch.unbind(self._quats, dim=-1)], dim=-1)
        return self._wrap(quats=quats)

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Rotation:
        if self._rot_mats is not None:
            return self._wrap(rot_mats=self._rot_mats.to(device=device, dtype=dtype))
        return self._wrap(quats=self._quats.to(device=device, dtype=dtype))

    def detach(self) -> Rotation:
        """Same rotation, cut from the autograd graph."""
        if self._rot_mats is not None:
            return self._wrap(rot_mats=self._rot_mats.detach())
        return self._wrap(quats=self._quats.detach())

    # -- rotation algebra ---------------------------------------------------------------------

    def compose_q_update_vec(self, q_update_vec: torch.Tensor, normalize_quats: bool = True) -> Rotation:
        """Compose with the (non-unit) quaternion update ``(1, x, y, z)``, ``q_update_vec`` ``[*, 3]``.

        ``q_new = q + q * (0, x, y, z) = q * (1, x, y, z)``, normalised (Alg. 23, line 3).
        """
        quats = self.get_quats()
        new_quats = quats + quat_multiply_by_vec(quats, q_update_vec)
        return Rotation(quats=new_quats, normalize_quats=normalize_quats)

    def compose_r(self, r: Rotation) -> Rotation:
        """``self * r`` by matrix product."""
        return Rotation(rot_mats=rot_matmul(self.get_rot_mats(), r.get_rot_mats()))

    def compose_q(self, r: Rotation, normalize_quats: bool = True) -> Rotation:
        """``self * r`` by quaternion product."""
        return Rotation(quats=quat_multiply(self.get_quats(), r.get_quats()), normalize_quats=normalize_quats)

    def apply(self, pts: torch.Tensor) -> torch.Tensor:
        """Rotate ``[*, 3]`` points."""
        return rot_vec_mul(self.get_rot_mats(), pts)

    def invert_apply(self, pts: torch.Tensor) -> torch.Tensor:
        """Rotate ``[*, 3]`` points by the inverse rotation."""
        return rot_vec_mul(invert_rot_mat(self.get_rot_mats()), pts)

    def invert(self) -> Rotation:
        if self._rot_mats is not None:
            return self._wrap(rot_mats=invert_rot_mat(self._rot_mats))
        return self._wrap(quats=invert_quat(self._quats))


# ---------------------------------------------------------------------------------------------
# Rigid
# ---------------------------------------------------------------------------------------------


class Rigid:
    """A batch of rigid transformations ``T = (R, t)``, ``T x = R x + t``; shape ``[*]``."""

    def __init__(self, rots: Rotation | None, trans: torch.Tensor | None) -> None:
        if trans is not None:
            batch_dims, dtype, device, requires_grad = trans.shape[:-1], trans.dtype, trans.device, trans.requires_grad
        elif rots is not None:
            batch_dims, dtype, device, requires_grad = rots.shape, rots.dtype, rots.device, rots.requires_grad
        else:
            raise ValueError("At least one of rots and trans must be specified")
        # The missing half is a constant identity. The reference makes it a leaf that requires grad when
        # the other half does; nothing reads that leaf's gradient, and torch.compile cannot trace a
        # factory call with requires_grad=True (a graph break): created without it, values and the
        # gradients of everything upstream are the same.
        del requires_grad
        if rots is None:
            rots = Rotation.identity(batch_dims, dtype, device, requires_grad=False)
        elif trans is None:
            trans = identity_trans(batch_dims, dtype, device, requires_grad=False)
        if rots.shape != trans.shape[:-1] or rots.device != trans.device:
            raise ValueError("Rots and trans incompatible")
        self._rots = rots
        self._trans = trans

    @staticmethod
    def identity(
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        requires_grad: bool = True,
        fmt: str = "quat",
    ) -> Rigid:
        """Identity transformations of batch shape ``shape``."""
        return Rigid(
            Rotation.identity(shape, dtype, device, requires_grad, fmt=fmt),
            identity_trans(shape, dtype, device, requires_grad),
        )

    # -- tensor-like behaviour ----------------------------------------------------------------

    def __getitem__(self, index: Any) -> Rigid:
        if not isinstance(index, tuple):
            index = (index,)
        return Rigid(self._rots[index], self._trans[index + (slice(None),)])

    def __mul__(self, right: torch.Tensor) -> Rigid:
        """Pointwise multiplication of rotation and translation with a ``[*]`` tensor (masking)."""
        if not isinstance(right, torch.Tensor):
            raise TypeError("The other multiplicand must be a Tensor")
        return Rigid(self._rots * right, self._trans * right[..., None])

    def __rmul__(self, left: torch.Tensor) -> Rigid:
        return self.__mul__(left)

    @property
    def shape(self) -> torch.Size:
        return self._trans.shape[:-1]

    @property
    def dtype(self) -> torch.dtype:
        return self._trans.dtype

    @property
    def device(self) -> torch.device:
        return self._trans.device

    def get_rots(self) -> Rotation:
        return self._rots

    def get_trans(self) -> torch.Tensor:
        return self._trans

    def unsqueeze(self, dim: int) -> Rigid:
        """Like ``torch.unsqueeze`` over the batch dims."""
        if dim > len(self.shape):
            raise ValueError("Invalid dimension")
        return Rigid(self._rots.unsqueeze(dim), self._trans.unsqueeze(dim if dim >= 0 else dim - 1))

    @staticmethod
    def cat(ts: Sequence[Rigid], dim: int) -> Rigid:
        """Concatenate along a batch dim (rotations end up in matrix format)."""
        rots = Rotation.cat([t._rots for t in ts], dim)
        trans = torch.cat([t._trans for t in ts], dim=dim if dim >= 0 else dim - 1)
        return Rigid(rots, trans)

    def map_tensor_fn(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Rigid:
        """Apply ``fn`` to every ``[*]`` component tensor of rotation and translation."""
        new_trans = torch.stack([fn(c) for c in torch.unbind(self._trans, dim=-1)], dim=-1)
        return Rigid(self._rots.map_tensor_fn(fn), new_trans)

    def apply_rot_fn(self, fn: Callable[[Rotation], Rotation]) -> Rigid:
        return Rigid(fn(self._rots), self._trans)

    def apply_trans_fn(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Rigid:
        return Rigid(self._rots, fn(self._trans))

    def scale_translation(self, trans_scale_factor: float) -> Rigid:
        """Multiply the translation by a constant (nm <-> Angstrom in the structure module)."""
        return self.apply_trans_fn(lambda t: t * trans_scale_factor)

    def stop_rot_gradient(self) -> Rigid:
        """Detach the rotation (Alg. 20, line 20: no gradient through rotations between blocks)."""
        return self.apply_rot_fn(lambda r: r.detach())

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Rigid:
        return Rigid(self._rots.to(device=device, dtype=dtype), self._trans.to(device=device, dtype=dtype))

    # -- transformation algebra ---------------------------------------------------------------

    def compose_q_update_vec(self, q_update_vec: torch.Tensor) -> Rigid:
        """Compose with a ``[*, 6]`` update ``(x, y, z, t_x, t_y, t_z)`` (Alg. 23).

        The rotation becomes ``q * (1, x, y, z)`` (normalised) and the translation
        ``t + R t_update``.
        """
        q_vec, t_vec = q_update_vec[..., :3], q_update_vec[..., 3:]
        new_rots = self._rots.compose_q_update_vec(q_vec)
        new_trans = self._trans + self._rots.apply(t_vec)
        return Rigid(new_rots, new_trans)

    def compose(self, r: Rigid) -> Rigid:
        """``self o r``: ``x -> R_self (R_r x + t_r) + t_self``."""
        new_rots = self._rots.compose_r(r._rots)
        new_trans = self._rots.apply(r._trans) + self._trans
        return Rigid(new_rots, new_trans)

    def apply(self, pts: torch.Tensor) -> torch.Tensor:
        """``R x + t`` for ``[*, 3]`` points."""
        return self._rots.apply(pts) + self._trans

    def invert_apply(self, pts: torch.Tensor) -> torch.Tensor:
        """``R^T (x - t)`` for ``[*, 3]`` points."""
        return self._rots.invert_apply(pts - self._trans)

    def invert(self) -> Rigid:
        """``(R^T, -R^T t)``."""
        rot_inv = self._rots.invert()
        return Rigid(rot_inv, -1 * rot_inv.apply(self._trans))

    # -- conversions --------------------------------------------------------------------------

    def to_tensor_4x4(self) -> torch.Tensor:
        """``[*, 4, 4]`` homogeneous matrices."""
        tensor = self._trans.new_zeros(self.shape + (4, 4))
        tensor[..., :3, :3] = self._rots.get_rot_mats()
        tensor[..., :3, 3] = self._trans
        tensor[..., 3, 3] = 1
        return tensor

    @staticmethod
    def from_tensor_4x4(t: torch.Tensor) -> Rigid:
        """From ``[*, 4, 4]`` homogeneous matrices (matrix format)."""
        if t.shape[-2:] != (4, 4):
            raise ValueError("Incorrectly shaped input tensor")
        return Rigid(Rotation(rot_mats=t[..., :3, :3]), t[..., :3, 3])

    def to_tensor_7(self) -> torch.Tensor:
        """``[*, 7]``: quaternion (4) then translation (3)."""
        tensor = self._trans.new_zeros(self.shape + (7,))
        tensor[..., :4] = self._rots.get_quats()
        tensor[..., 4:] = self._trans
        return tensor

    @staticmethod
    def from_tensor_7(t: torch.Tensor, normalize_quats: bool = False) -> Rigid:
        """From ``[*, 7]`` (quaternion, translation)."""
        if t.shape[-1] != 7:
            raise ValueError("Incorrectly shaped input tensor")
        quats, trans = t[..., :4], t[..., 4:]
        return Rigid(Rotation(quats=quats, normalize_quats=normalize_quats), trans)

    @staticmethod
    def from_3_points(
        p_neg_x_axis: torch.Tensor,
        origin: torch.Tensor,
        p_xy_plane: torch.Tensor,
        eps: float = 1e-8,
    ) -> Rigid:
        """Frames from three points by Gram-Schmidt (Alg. 21), all inputs ``[*, 3]``.

        x-axis along ``origin - p_neg_x_axis``, y-axis in the plane of ``p_xy_plane``; the
        rotation's columns are (e0, e1, e2) and the translation is ``origin``.
        """
        p_neg_x_axis = torch.unbind(p_neg_x_axis, dim=-1)
        origin = torch.unbind(origin, dim=-1)
        p_xy_plane = torch.unbind(p_xy_plane, dim=-1)

        e0 = [c1 - c2 for c1, c2 in zip(origin, p_neg_x_axis)]
        e1 = [c1 - c2 for c1, c2 in zip(p_xy_plane, origin)]

        denom = torch.sqrt(sum(c * c for c in e0) + eps)
        e0 = [c / denom for c in e0]
        dot = sum(c1 * c2 for c1, c2 in zip(e0, e1))
        e1 = [c2 - c1 * dot for c1, c2 in zip(e0, e1)]
        denom = torch.sqrt(sum(c * c for c in e1) + eps)
        e1 = [c / denom for c in e1]
        e2 = [
            e0[1] * e1[2] - e0[2] * e1[1],
            e0[2] * e1[0] - e0[0] * e1[2],
            e0[0] * e1[1] - e0[1] * e1[0],
        ]
        # Row i of the matrix is (e0[i], e1[i], e2[i]): the e's are its columns.
        rots = torch.stack([c for row in zip(e0, e1, e2) for c in row], dim=-1)
        rots = rots.reshape(rots.shape[:-1] + (3, 3))
        return Rigid(Rotation(rot_mats=rots), torch.stack(origin, dim=-1))

    @staticmethod
    def make_transform_from_reference(
        n_xyz: torch.Tensor, ca_xyz: torch.Tensor, c_xyz: torch.Tensor, eps: float = 1e-20
    ) -> Rigid:
        """Backbone frames from N, CA, C ``[*, 3]`` by successive rotations (AlphaFold's
        ``make_transform_from_reference``): CA at the origin, C on +x, N in the xy-plane (y > 0).

        Symmetries are not handled: swapped atom naming puts N at negative y.
        """
        translation = -1 * ca_xyz
        n_xyz = n_xyz + translation
        c_xyz = c_xyz + translation

        def rot_from_entries(shape_like: torch.Tensor, entries: dict) -> torch.Tensor:
            rots = shape_like.new_zeros(shape_like.shape + (3, 3))
            for (i, j), value in entries.items():
                rots[..., i, j] = value
            return rots

        c_x, c_y, c_z = [c_xyz[..., i] for i in range(3)]
        norm = torch.sqrt(eps + c_x**2 + c_y**2)
        sin_c1, cos_c1 = -c_y / norm, c_x / norm
        c1_rots = rot_from_entries(
            sin_c1, {(0, 0): cos_c1, (0, 1): -1 * sin_c1, (1, 0): sin_c1, (1, 1): cos_c1, (2, 2): 1}
        )

        norm = torch.sqrt(eps + c_x**2 + c_y**2 + c_z**2)
        sin_c2, cos_c2 = c_z / norm, torch.sqrt(c_x**2 + c_y**2) / norm
        c2_rots = rot_from_entries(
            sin_c2, {(0, 0): cos_c2, (0, 2): sin_c2, (1, 1): 1, (2, 0): -1 * sin_c2, (2, 2): cos_c2}
        )

        c_rots = rot_matmul(c2_rots, c1_rots)
        n_xyz = rot_vec_mul(c_rots, n_xyz)

        n_y, n_z = n_xyz[..., 1], n_xyz[..., 2]
        norm = torch.sqrt(eps + n_y**2 + n_z**2)
        sin_n, cos_n = -n_z / norm, n_y / norm
        n_rots = rot_from_entries(sin_c2, {(0, 0): 1, (1, 1): cos_n, (1, 2): -1 * sin_n, (2, 1): sin_n, (2, 2): cos_n})

        rots = rot_matmul(n_rots, c_rots).transpose(-1, -2)
        return Rigid(Rotation(rot_mats=rots), -1 * translation)


__all__ = [
    "Rotation",
    "Rigid",
    "rot_matmul",
    "rot_vec_mul",
    "invert_rot_mat",
    "quat_to_rot",
    "rot_to_quat",
    "quat_multiply",
    "quat_multiply_by_vec",
    "invert_quat",
    "identity_rot_mats",
    "identity_trans",
    "identity_quats",
]
