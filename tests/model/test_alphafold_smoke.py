"""The ``tiny`` AlphaFold runs end to end in float32 and under bf16 autocast (CPU), recycling over
the trailing batch dimension with autograd only on the last pass."""

from __future__ import annotations

import torch

from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.features import make_synthetic_batch

N_RES, N_CLUST, N_EXTRA, N_TEMPL = 12, 4, 6, 2


def _tiny(seed: int = 0) -> AlphaFold:
    torch.manual_seed(seed)
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"evoformer_stack_config": {"num_blocks": 1}})
    return AlphaFold(cfg)


def _batch(recycles: int = 1):
    return make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=recycles, seed=1)


def test_float32_forward_backward():
    """float32: finite outputs with the documented shapes, and every parameter gets a gradient."""
    model = _tiny().train()
    out = model(_batch())
    assert out["msa"].shape == (1, N_CLUST, N_RES, 32)  # template rows dropped
    assert out["final_atom_positions"].shape == (1, N_RES, 37, 3)
    assert out["sm_frames"].shape == (1, 2, N_RES, 7)
    assert out["plddt"].shape == (1, N_RES)
    for key, value in out.items():
        assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
    loss = sum(v.float().mean() for k, v in out.items() if k.endswith("logits")) + out["sm_positions"].mean()
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing[:5]


def test_bf16_autocast_forward():
    """bf16 autocast: the forward runs (geometry kept in float32) and outputs are finite."""
    model = _tiny().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(_batch())
        loss = out["distogram_logits"].float().mean() + out["sm_positions"].float().mean()
    loss.backward()
    assert all(torch.isfinite(v.float()).all() for v in out.values())
    assert model.input_embedder.linear_tf_m.weight.grad is not None


def test_recycling_uses_previous_pass():
    """A second recycling pass changes the outputs: the recycled embeddings are used."""
    model = _tiny().eval()
    with torch.no_grad():
        one = model(_batch(recycles=0))
        two = model({k: v[..., [0, 0]] for k, v in _batch(recycles=0).items()})
    assert not torch.allclose(one["pair"], two["pair"])


def test_templates_disabled():
    """With templates disabled the template features are neither required nor read."""
    torch.manual_seed(0)
    cfg = AlphaFoldConfig.from_preset(
        "tiny", overrides={"templates_enabled": False, "evoformer_stack_config": {"num_blocks": 1}}
    )
    model = AlphaFold(cfg).eval()
    batch = {k: v for k, v in _batch(recycles=0).items() if not k.startswith("template_")}
    with torch.no_grad():
        out = model(batch)
    assert out["msa"].shape[1] == N_CLUST
    assert not any(n.startswith("template") for n, _ in model.named_parameters())
