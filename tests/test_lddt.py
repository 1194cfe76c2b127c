"""lDDT / lDDT-Cα metric (scalefold.lddt) against the MLPerf reference golden and its
defining properties."""

from __future__ import annotations

import torch

from scalefold.lddt import lddt, lddt_ca, validation_lddt_ca
from scalefold.model.rigid import quat_to_rot

RTOL = 1e-10


def _inputs(golden_modules: dict):
    case = golden_modules["lddt_ca"]["inputs"]
    return case["predicted_atom_positions"], case["target_atom_positions"], case["atom_mask"]


def test_lddt_ca_matches_reference_validation_metric(golden_modules):
    """validation_lddt_ca (= lddt_ca(eps=1e-8, per_residue=False)) equals the reference's
    compute_validation_metrics(..., {"lddt_ca"}) on a chain with one fully masked residue and one
    residue whose CA alone is masked."""
    pred, target, mask = _inputs(golden_modules)
    expected = golden_modules["lddt_ca"]["outputs"]["lddt_ca"]
    got = validation_lddt_ca(pred, target, mask)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=0)
    torch.testing.assert_close(lddt_ca(pred, target, mask, eps=1e-8, per_residue=False), expected, rtol=RTOL, atol=0)


def test_lddt_ca_per_residue_matches_reference(golden_modules):
    """lddt_ca with its defaults (per_residue=True, eps=1e-10) equals the reference's per-residue
    loss.lddt_ca, including score 1 for residues without any scored neighbour."""
    pred, target, mask = _inputs(golden_modules)
    expected = golden_modules["lddt_ca"]["outputs"]["lddt_ca_per_residue"]
    got = lddt_ca(pred, target, mask)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=0)


def test_lddt_invariant_to_global_motion(golden_modules):
    """lDDT depends only on distances: a global rotation + translation of the prediction, and
    separately of the target, leaves it unchanged."""
    pred, target, mask = _inputs(golden_modules)
    gen = torch.Generator().manual_seed(0)
    ref = lddt_ca(pred, target, mask)
    for which in ("pred", "target"):
        q = torch.randn(4, generator=gen, dtype=torch.float64)
        rot = quat_to_rot(q / q.norm())
        trans = 30 * torch.randn(3, generator=gen, dtype=torch.float64)
        p, t = pred, target
        if which == "pred":
            p = pred @ rot.T + trans
        else:
            t = target @ rot.T + trans
        torch.testing.assert_close(lddt_ca(p, t, mask), ref, rtol=1e-9, atol=1e-12)


def test_lddt_perfect_thresholds_and_cutoff():
    """A perfect prediction scores 1. Moving point 0 by 1.5 Å along -x changes its distance to
    point 1 by 1.5 Å (pair score 0.5: only the 2 and 4 Å thresholds hold) and to points 2, 3 by
    0.35 Å (pair score 1). A point farther than the 15 Å cutoff from all others is never scored
    (its own score is eps/eps = 1 wherever it is predicted)."""
    pos = torch.tensor([[0.0, 0, 0], [3.0, 0, 0], [0, 3.0, 0], [0, 0, 3.0], [20.0, 0, 0]], dtype=torch.float64)[None]
    mask = torch.ones(1, 5, 1, dtype=torch.float64)
    torch.testing.assert_close(lddt(pos, pos, mask, per_residue=False), torch.ones(1, dtype=torch.float64))

    moved = pos.clone()
    moved[0, 0, 0] = -1.5
    moved[0, 4] = torch.tensor([-7.0, 2.0, 5.0])
    expected = torch.tensor([[2.5 / 3, 2.5 / 3, 1.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(lddt(moved, pos, mask), expected, rtol=1e-9, atol=1e-9)
    # Chain level: 12 scored ordered pairs, two of them scoring 0.5.
    torch.testing.assert_close(
        lddt(moved, pos, mask, per_residue=False), torch.tensor([11.0 / 12], dtype=torch.float64)
    )


def test_lddt_runs_in_low_precision(golden_modules):
    """The metric runs in float32 and bf16 (dtype follows the inputs)."""
    pred, target, mask = _inputs(golden_modules)
    expected = golden_modules["lddt_ca"]["outputs"]["lddt_ca"]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        got = validation_lddt_ca(pred.to(dtype), target.to(dtype), mask.to(dtype))
        assert got.dtype == dtype
        assert abs(float(got) - float(expected)) <= tol
