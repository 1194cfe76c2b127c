"""``scalefold.reference_config.from_reference_config`` works for reference configs other than the
golden one: TM head + TM loss (the reference ``*_ptm`` presets), no template torsion rows,
templates disabled."""

from __future__ import annotations

import pytest
import torch

from scalefold.model.config import AlphaFoldConfig
from scalefold.model.features import make_synthetic_batch
from scalefold.reference_config import from_reference_config

N_RES, N_CLUST, N_EXTRA, N_TEMPL = 10, 3, 4, 2


def _reference_dict(**overrides):
    """A reference-style plain dict: the tiny dims plus the given top-level overrides."""
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"evoformer_stack_config": {"num_blocks": 1}}).to_dict()
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize(
    "variant",
    [
        {"auxiliary_heads_config": "tm", "loss_config": "tm"},
        {"embed_template_torsion_angles": False},
        {"templates_enabled": False},
    ],
    ids=["ptm", "no_torsion_rows", "no_templates"],
)
def test_variant_runs_forward_and_loss(variant):
    """Each variant builds, runs a train-mode forward + loss + backward, and yields finite values."""
    cfg = _reference_dict()
    if variant.get("auxiliary_heads_config") == "tm":
        cfg["auxiliary_heads_config"]["tm_score_head_enabled"] = True
        cfg["loss_config"]["tm_loss_config"].update(enabled=True, weight=0.1)
    for key in ("embed_template_torsion_angles", "templates_enabled"):
        if key in variant:
            cfg[key] = variant[key]
    torch.manual_seed(0)
    model, loss_fn = from_reference_config(cfg)
    batch = make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, seed=3)
    outputs = model.train()(batch)
    loss, terms = loss_fn(outputs, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert outputs["msa"].shape[1] == N_CLUST
    if cfg["auxiliary_heads_config"]["tm_score_head_enabled"]:
        assert outputs["tm_logits"].shape == (1, N_RES, N_RES, 64)
        assert "predicted_aligned_error" in outputs and "tm" in terms


def test_entry_point_rejects_unknown_keys():
    """A dict the reference would reject (unknown key) is rejected with the key named."""
    with pytest.raises(ValueError, match="structure_module_config.*num_ipa_blocks"):
        from_reference_config({"structure_module_config": {"num_ipa_blocks": 3}})
