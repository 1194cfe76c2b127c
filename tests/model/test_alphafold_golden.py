"""THE contract of issue 2: one training step of ScaleFold's AlphaFold equals the MLPerf reference.

``golden_small.pt`` holds a train-mode forward + AlphaFoldLoss + backward of the reference model
(float64, one recycling iteration, dropout 0). Built through the public entry point
``scalefold.reference_config.from_reference_config`` and loaded strictly with the reference weights, our
model must reproduce every output (at unpadded positions), every loss term and the gradient of
``loss_backpropagated`` with respect to every parameter to a relative error <= 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from scalefold.reference_config import from_reference_config

RTOL = 1e-6


def _as_float64(batch):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}


@pytest.fixture(scope="module")
def step(golden_small):
    """Run forward, loss and backward once for all tests in this module."""
    model, loss_fn = from_reference_config(golden_small["config"])
    model.load_state_dict(golden_small["state_dict"], strict=True)
    model.double().train()
    batch = _as_float64(golden_small["batch"])
    outputs = model(batch)
    loss, terms = loss_fn(outputs, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"model": model, "outputs": outputs, "loss": loss, "terms": terms, "grads": grads, "batch": batch}


def _valid_mask(key: str, ref: torch.Tensor, batch) -> torch.Tensor:
    """Entries of output ``key`` that belong to unpadded residues / MSA rows."""
    seq = batch["seq_mask"][..., -1]
    msa = batch["msa_mask"][..., -1]
    if key in ("msa", "masked_msa_logits"):
        mask = msa
    elif key in ("pair", "distogram_logits"):
        mask = seq[:, :, None] * seq[:, None, :]
    elif key.startswith("sm_") and key != "sm_single":
        mask = seq[:, None]  # [B, num_blocks, N_res, ...]
    else:
        mask = seq
    mask = mask.reshape(mask.shape + (1,) * (ref.dim() - mask.dim()))
    return mask.expand_as(ref).bool()


def _rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(expected.abs().max().item(), floor)
    if scale == 0.0:
        return actual.abs().max().item()
    return ((actual - expected).abs().max() / scale).item()


def test_output_keys(step, golden_small):
    """The forward returns exactly the reference's output keys with the reference's shapes."""
    assert set(step["outputs"]) == set(golden_small["outputs"])
    for key, ref in golden_small["outputs"].items():
        assert step["outputs"][key].shape == ref.shape, key


def test_outputs_match_reference(step, golden_small):
    """Every output agrees with the reference at valid positions."""
    errors = {}
    for key, ref in golden_small["outputs"].items():
        valid = _valid_mask(key, ref, step["batch"])
        errors[key] = _rel_err(step["outputs"][key].detach()[valid], ref[valid])
    bad = {k: e for k, e in errors.items() if not e <= RTOL}
    assert not bad, f"outputs beyond rtol {RTOL}: {bad}"


def test_losses_match_reference(step, golden_small):
    """Every loss term, the weighted and the scaled total, and the backpropagated loss agree."""
    expected = golden_small["losses"]
    actual = dict(step["terms"])
    actual["loss_backpropagated"] = step["loss"].detach()
    missing = set(expected) - set(actual)
    assert not missing, f"loss terms not returned: {missing}"
    bad = {k: (actual[k].item(), v.item()) for k, v in expected.items() if not _rel_err(actual[k], v) <= RTOL}
    assert not bad, f"loss terms beyond rtol {RTOL}: {bad}"


def test_gradients_match_reference(step, golden_small):
    """d loss_backpropagated / d parameter agrees for every parameter (none is left without grad)."""
    expected = golden_small["grads"]
    assert set(expected) == set(step["grads"])
    no_grad = [n for n, g in step["grads"].items() if g is None]
    assert no_grad == list(golden_small["grads_none"]), f"parameters without grad: {no_grad[:10]}"
    global_scale = max(g.abs().max().item() for g in expected.values())
    bad = {}
    for name, ref in expected.items():
        err = _rel_err(step["grads"][name], ref, floor=1e-9 * global_scale)
        if not err <= RTOL:
            bad[name] = err
    assert not bad, f"{len(bad)} parameter gradients beyond rtol {RTOL}: {dict(list(bad.items())[:10])}"


def test_loss_reads_last_recycling_slice(step, golden_small):
    """loss_fn accepts the batch with its recycling dimension and leaves the caller's batch as is."""
    assert set(step["batch"]) == set(golden_small["batch"])
    for key, value in golden_small["batch"].items():
        assert step["batch"][key].shape == value.shape, key
