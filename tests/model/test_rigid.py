"""Rotation / Rigid: representation round trips, group identities, dtype preservation, gradients."""

from __future__ import annotations

import pytest
import torch

from scalefold.model.rigid import (
    Rigid,
    Rotation,
    quat_multiply,
    quat_multiply_by_vec,
    quat_to_rot,
    rot_matmul,
    rot_to_quat,
)

F64 = torch.float64


def _random_rigid(shape=(3, 5), dtype=F64, seed=0) -> Rigid:
    g = torch.Generator().manual_seed(seed)
    t7 = torch.randn(shape + (7,), generator=g, dtype=F64).to(dtype)
    return Rigid.from_tensor_7(t7, normalize_quats=True)


def _same_rotation_quats(q1: torch.Tensor, q2: torch.Tensor) -> torch.Tensor:
    """Max deviation between quaternions up to the q ~ -q sign ambiguity."""
    return torch.minimum((q1 - q2).abs().amax(-1), (q1 + q2).abs().amax(-1)).max()


def test_quat_to_rot_is_orthonormal():
    """Unit quaternions give proper rotation matrices (R R^T = I, det R = 1)."""
    r = _random_rigid().get_rots().get_rot_mats()
    eye = torch.eye(3, dtype=F64).expand_as(r)
    torch.testing.assert_close(rot_matmul(r, r.transpose(-1, -2)), eye, atol=1e-14, rtol=0)
    torch.testing.assert_close(torch.linalg.det(r), torch.ones(r.shape[:-2], dtype=F64), atol=1e-14, rtol=0)


def test_rot_to_quat_round_trip():
    """matrix -> quaternion -> matrix is the identity (quaternion sign is free)."""
    rots = _random_rigid().get_rots()
    q = rots.get_quats()
    q_back = rot_to_quat(quat_to_rot(q))
    assert _same_rotation_quats(q, q_back) < 1e-12
    torch.testing.assert_close(quat_to_rot(q_back), quat_to_rot(q), atol=1e-13, rtol=0)


def test_quat_multiply_matches_matrix_product():
    """Hamilton product corresponds to matrix product; multiply_by_vec is the pure-vector case."""
    q1, q2 = _random_rigid(seed=1).get_rots().get_quats(), _random_rigid(seed=2).get_rots().get_quats()
    torch.testing.assert_close(quat_to_rot(quat_multiply(q1, q2)), rot_matmul(quat_to_rot(q1), quat_to_rot(q2)))
    vec = torch.randn(q1.shape[:-1] + (3,), dtype=F64)
    pure = torch.cat([torch.zeros_like(vec[..., :1]), vec], dim=-1)
    torch.testing.assert_close(quat_multiply_by_vec(q1, vec), quat_multiply(q1, pure))


def test_4x4_round_trip():
    """to_tensor_4x4 / from_tensor_4x4 preserve the transform and the homogeneous last row."""
    r = _random_rigid()
    m = r.to_tensor_4x4()
    assert m.shape == (3, 5, 4, 4)
    torch.testing.assert_close(m[..., 3, :], torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=F64).expand(3, 5, 4))
    torch.testing.assert_close(Rigid.from_tensor_4x4(m).to_tensor_4x4(), m, atol=0, rtol=0)


def test_7_round_trip():
    """to_tensor_7 / from_tensor_7 preserve quaternion and translation; matrix-format rigids
    go through the eigen-decomposition and come back as the same transform."""
    r = _random_rigid()
    t7 = r.to_tensor_7()
    torch.testing.assert_close(Rigid.from_tensor_7(t7).to_tensor_7(), t7, atol=0, rtol=0)
    r_mat = Rigid.from_tensor_4x4(r.to_tensor_4x4())
    torch.testing.assert_close(
        Rigid.from_tensor_7(r_mat.to_tensor_7()).to_tensor_4x4(), r.to_tensor_4x4(), atol=1e-12, rtol=0
    )


def test_quaternion_normalisation():
    """normalize_quats rescales to unit norm; without it the stored quaternion is kept as given."""
    q = torch.tensor([[2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
    t = torch.zeros(2, 3, dtype=F64)
    normed = Rigid.from_tensor_7(torch.cat([q, t], -1), normalize_quats=True).get_rots().get_quats()
    torch.testing.assert_close(normed.norm(dim=-1), torch.ones(2, dtype=F64))
    torch.testing.assert_close(normed[1], torch.full((4,), 0.5, dtype=F64))
    raw = Rigid.from_tensor_7(torch.cat([q, t], -1)).get_rots().get_quats()
    torch.testing.assert_close(raw, q)
    # compose_q_update_vec normalises the composed quaternion.
    upd = Rigid.identity((2,), dtype=F64).compose_q_update_vec(torch.randn(2, 6, dtype=F64))
    torch.testing.assert_close(upd.get_rots().get_quats().norm(dim=-1), torch.ones(2, dtype=F64))


def test_compose_invert_identities():
    """T o T^-1 = id, (T1 o T2) x = T1 (T2 x), invert_apply undoes apply, identity is neutral."""
    r1, r2 = _random_rigid(seed=3), _random_rigid(seed=4)
    x = torch.randn(3, 5, 3, dtype=F64)
    eye = torch.eye(4, dtype=F64).expand(3, 5, 4, 4)
    torch.testing.assert_close(r1.compose(r1.invert()).to_tensor_4x4(), eye, atol=1e-14, rtol=0)
    torch.testing.assert_close(r1.invert().compose(r1).to_tensor_4x4(), eye, atol=1e-14, rtol=0)
    torch.testing.assert_close(r1.compose(r2).apply(x), r1.apply(r2.apply(x)))
    torch.testing.assert_close(r1.invert_apply(r1.apply(x)), x)
    torch.testing.assert_close(r1.invert().apply(x), r1.invert_apply(x))
    ident = Rigid.identity((3, 5), dtype=F64)
    torch.testing.assert_close(ident.compose(r1).to_tensor_4x4(), r1.to_tensor_4x4())
    # Quaternion update (q_vec, t): rotation q * (1, q_vec), translation t + R t_update.
    upd = torch.randn(3, 5, 6, dtype=F64)
    new = r1.compose_q_update_vec(upd)
    expected_q = quat_multiply(r1.get_rots().get_quats(), torch.cat([torch.ones_like(upd[..., :1]), upd[..., :3]], -1))
    expected_q = expected_q / expected_q.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(new.get_rots().get_quats(), expected_q)
    torch.testing.assert_close(new.get_trans(), r1.apply(upd[..., 3:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtype_preserved(dtype):
    """Rotations and translations keep the input dtype (no forced float32 as in the reference)."""
    r = _random_rigid(dtype=dtype)
    assert r.get_trans().dtype == dtype and r.get_rots().dtype == dtype
    assert r.to_tensor_4x4().dtype == dtype and r.compose(r).to_tensor_7().dtype == dtype
    assert Rigid.identity((2,), dtype=dtype).get_trans().dtype == dtype
    pts = torch.zeros(3, 3, dtype=dtype)
    frame = Rigid.from_3_points(
        pts + torch.tensor([-1.0, 0, 0], dtype=dtype), pts, pts + torch.tensor([0, 1.0, 0], dtype=dtype)
    )
    assert frame.get_trans().dtype == dtype


def test_from_3_points_gram_schmidt():
    """Alg. 21: x-axis along origin - p_neg_x, y in the plane, translation = origin."""
    g = torch.Generator().manual_seed(5)
    p1, p2, p3 = (torch.randn(4, 3, generator=g, dtype=F64) for _ in range(3))
    frame = Rigid.from_3_points(p1, p2, p3, eps=0.0)
    rot = frame.get_rots().get_rot_mats()
    e0 = (p2 - p1) / (p2 - p1).norm(dim=-1, keepdim=True)
    torch.testing.assert_close(rot[..., :, 0], e0)
    torch.testing.assert_close(frame.get_trans(), p2)
    local = frame.invert_apply(p3)  # p3 lies in the local xy-plane with y > 0
    torch.testing.assert_close(local[..., 2], torch.zeros(4, dtype=F64), atol=1e-12, rtol=0)
    assert (local[..., 1] > 0).all()
    torch.testing.assert_close(torch.linalg.det(rot), torch.ones(4, dtype=F64))


def test_make_transform_from_reference():
    """CA goes to the origin, C onto +x, N into the xy-plane with y > 0."""
    g = torch.Generator().manual_seed(6)
    n, ca, c = (torch.randn(4, 3, generator=g, dtype=F64) for _ in range(3))
    frame = Rigid.make_transform_from_reference(n, ca, c)
    torch.testing.assert_close(frame.get_trans(), ca)
    c_local, n_local = frame.invert_apply(c), frame.invert_apply(n)
    torch.testing.assert_close(c_local[..., 1:], torch.zeros(4, 2, dtype=F64), atol=1e-12, rtol=0)
    assert (c_local[..., 0] > 0).all() and (n_local[..., 1] > 0).all()
    torch.testing.assert_close(n_local[..., 2], torch.zeros(4, dtype=F64), atol=1e-12, rtol=0)


def test_tensor_like_ops():
    """Indexing, unsqueeze, cat, map_tensor_fn and masking act on the batch dims."""
    r = _random_rigid()
    assert r[0].shape == (5,) and r[:, 1:3].shape == (3, 2) and r[..., None].shape == (3, 5, 1)
    assert r.unsqueeze(-1).shape == (3, 5, 1) and r.unsqueeze(0).shape == (1, 3, 5)
    cat = Rigid.cat([r, r], dim=-1)
    assert cat.shape == (3, 10) and cat.get_rots().get_cur_rot().shape == (3, 10, 3, 3)
    summed = r.unsqueeze(-1).map_tensor_fn(lambda t: t.sum(-1))
    torch.testing.assert_close(summed.to_tensor_7(), r.to_tensor_7())
    mask = torch.zeros(3, 5, dtype=F64)
    assert (r * mask).get_trans().abs().sum() == 0
    scaled = r.scale_translation(10.0)
    torch.testing.assert_close(scaled.get_trans(), 10.0 * r.get_trans())


def test_stop_rot_gradient():
    """stop_rot_gradient detaches the rotation but not the translation."""
    t7 = torch.randn(4, 7, dtype=F64, requires_grad=True)
    r = Rigid.from_tensor_7(t7, normalize_quats=True).stop_rot_gradient()
    x = torch.randn(4, 3, dtype=F64)
    r.apply(x).sum().backward()
    assert t7.grad[:, :4].abs().sum() == 0 and t7.grad[:, 4:].abs().sum() > 0


def test_gradients_match_finite_differences():
    """apply/compose/invert are differentiable (gradcheck in float64)."""
    t7 = torch.randn(2, 7, dtype=F64, requires_grad=True)
    x = torch.randn(2, 3, dtype=F64)

    def fn(t):
        r = Rigid.from_tensor_7(t, normalize_quats=True)
        return r.compose(r.invert().compose(r)).apply(x) + r.invert_apply(x)

    assert torch.autograd.gradcheck(fn, (t7,))
    assert Rotation.identity((2,), dtype=F64, fmt="rot_mat").get_quats().shape == (2, 4)
