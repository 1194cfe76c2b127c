"""Resolution gates of the pLDDT / experimentally-resolved / TM losses on entries without a resolution.

NMR entries keep ``resolution = NaN`` through the store and the features, as in the MLPerf reference
(``create_mmcif_features``). The reference gates with ``(resolution >= min) & (resolution <= max)``;
every comparison with NaN is False, so such a chain gets those terms multiplied by 0 -- exactly what a
resolution of 0.0 (below ``min_resolution`` 0.1) gives. These tests pin that, so a NaN never reaches
the loss or its gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from scalefold.losses import AlphaFoldLoss
from scalefold.losses.common import resolution_filter

GATED = ("plddt_loss", "experimentally_resolved")


def _inputs(golden_small: dict, resolution: float | None):
    batch = {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in golden_small["batch"].items()}
    outputs = {k: v.to(torch.float64) for k, v in golden_small["outputs"].items()}
    if resolution is not None:
        batch["resolution"] = torch.full_like(batch["resolution"], resolution)
    return outputs, batch


def test_resolution_filter_is_the_reference_expression():
    """Same truth table as the reference's ``(r >= lo) & (r <= hi)``: NaN and out-of-range are False,
    both bounds inclusive."""
    r = torch.tensor([math.nan, 0.0, 0.1, 1.5, 3.0, 3.0001, math.inf, -math.inf], dtype=torch.float32)
    expected = (r >= 0.1) & (r <= 3.0)
    assert torch.equal(resolution_filter(r, 0.1, 3.0), expected)
    assert resolution_filter(r, 0.1, 3.0).tolist() == [False, False, True, True, True, False, False, False]


def test_nan_resolution_gates_the_resolution_terms_like_zero(golden_small):
    """The golden batch (resolution in range, so the gated terms are non-zero) with resolution NaN:
    pLDDT and experimentally-resolved terms are exactly 0, every other term, the total loss and the
    gradients equal those of resolution 0.0 bitwise, and nothing is NaN."""
    loss_fn = AlphaFoldLoss(golden_small["config"]["loss_config"])
    outputs, batch = _inputs(golden_small, None)
    _, reference_terms = loss_fn(outputs, batch)
    assert all(float(reference_terms[name]) > 0 for name in GATED)  # the gate matters for this batch

    results = {}
    for resolution in (math.nan, 0.0):
        outputs, batch = _inputs(golden_small, resolution)
        logits = {k: outputs[k].clone().requires_grad_(True) for k in ("lddt_logits", "experimentally_resolved_logits")}
        outputs.update(logits)
        loss, terms = loss_fn(outputs, batch)
        grads = torch.autograd.grad(loss, list(logits.values()))
        results[resolution] = (loss.detach(), terms, grads)

    loss_nan, terms_nan, grads_nan = results[math.nan]
    loss_zero, terms_zero, grads_zero = results[0.0]
    assert torch.isfinite(loss_nan) and torch.equal(loss_nan, loss_zero)
    for name in GATED:
        assert float(terms_nan[name]) == 0.0, name
    for name, value in terms_nan.items():
        assert torch.isfinite(value) and torch.equal(value, terms_zero[name]), name
    for name in ("fape", "supervised_chi", "distogram", "masked_msa", "violation"):  # not resolution-gated
        assert torch.equal(terms_nan[name], reference_terms[name]), name
    for g_nan, g_zero in zip(grads_nan, grads_zero):
        assert torch.isfinite(g_nan).all() and torch.equal(g_nan, g_zero) and not g_nan.any()


@pytest.mark.parametrize("resolution", [math.nan, 0.0, 9.0])
def test_tm_term_is_gated_too(resolution):
    """With the TM head enabled, its term is gated the same way (reference ``tm_loss``)."""
    from scalefold.losses.tm import tm_loss

    logits = torch.randn(1, 5, 5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rigid = torch.eye(4, dtype=torch.float64).expand(1, 5, 4, 4).clone()
    rigid[..., :3, 3] = torch.arange(15, dtype=torch.float64).reshape(1, 5, 3)
    affine = torch.zeros(1, 5, 7, dtype=torch.float64)
    affine[..., 0] = 1.0
    affine[..., 4:] = rigid[..., :3, 3] + 0.5
    mask = torch.ones(1, 5, dtype=torch.float64)
    kwargs = dict(final_affine_tensor=affine, backbone_rigid_tensor=rigid, backbone_rigid_mask=mask)
    gated = tm_loss(logits, resolution=torch.tensor([resolution], dtype=torch.float64), **kwargs)
    in_range = tm_loss(logits, resolution=torch.tensor([1.5], dtype=torch.float64), **kwargs)
    assert float(in_range) > 0 and torch.equal(gated, torch.zeros_like(gated))
