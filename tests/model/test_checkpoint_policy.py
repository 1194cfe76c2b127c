"""Activation checkpointing as a policy (on, off, N): which blocks recompute, and that the gradients
do not change by a bit whichever policy runs."""

from __future__ import annotations

import pytest
import torch

import scalefold.model.memory as memory_module
from scalefold.config.recompute import parse_checkpointing
from scalefold.config.training import TrainConfig
from scalefold.losses import AlphaFoldLoss
from scalefold.model import AlphaFold
from scalefold.model.factory import build_model_config as model_config
from scalefold.model.memory import checkpointed_blocks
from scalefold.train.step import synthetic_batch

STACKS = [("template_pair_stack", 2), ("extra_msa_stack", 4), ("evoformer_stack", 48)]  # MLPerf's


def test_policies_parse():
    assert [parse_checkpointing(v) for v in (True, "on", "ON", "true", False, None, "off", "no")] == [True] * 4 + [False] * 4
    assert parse_checkpointing("auto") == "auto"
    assert parse_checkpointing("12") == 12 and parse_checkpointing(0) == 0 and parse_checkpointing(7) == 7
    for bad in ("sometimes", "-1", -1, "1.5", ""):
        with pytest.raises(ValueError, match="activation checkpointing"):
            parse_checkpointing(bad)


def test_n_counts_blocks_in_forward_order():
    assert checkpointed_blocks("on", STACKS) == {"template_pair_stack": 2, "extra_msa_stack": 4, "evoformer_stack": 48}
    assert checkpointed_blocks(False, STACKS) == dict.fromkeys(("template_pair_stack", "extra_msa_stack", "evoformer_stack"), 0)
    assert checkpointed_blocks(1, STACKS) == {"template_pair_stack": 1, "extra_msa_stack": 0, "evoformer_stack": 0}
    assert checkpointed_blocks("40", STACKS) == {"template_pair_stack": 2, "extra_msa_stack": 4, "evoformer_stack": 34}
    assert checkpointed_blocks(54, STACKS) == checkpointed_blocks(True, STACKS)
    with pytest.raises(ValueError, match="54 blocks .*N must be 0 .. 54"):
        checkpointed_blocks(55, STACKS)
    with pytest.raises(ValueError, match="must be resolved"):
        checkpointed_blocks("auto", STACKS)


def _tiny(policy) -> tuple[TrainConfig, object]:
    cfg = TrainConfig.from_preset("tiny", overrides={"precision": "fp64", "activation_checkpointing": policy}, env={})
    model_cfg = model_config(cfg)
    for stack in (model_cfg.evoformer_stack_config, model_cfg.extra_msa_stack_config):  # dropout on: masks replayed
        stack.msa_dropout, stack.pair_dropout = 0.15, 0.25
    model_cfg.template_pair_stack_config.dropout_rate = 0.25
    return cfg, model_cfg


def _gradients(policy) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    cfg, model_cfg = _tiny(policy)
    torch.manual_seed(0)
    model = AlphaFold(model_cfg, activation_checkpointing=policy).to(torch.float64).train()
    with torch.no_grad():  # the zero-initialised ("final") layers would hide most of the blocks' work
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = synthetic_batch(cfg, model)
    torch.manual_seed(1)
    loss, _ = AlphaFoldLoss(model_cfg.loss_config)(model(batch), batch)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, loss.detach()


def test_gradients_are_equal_bit_for_bit_under_every_policy(monkeypatch):
    calls = []
    real = memory_module.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(memory_module, "checkpoint", counting)
    reference, loss = _gradients("off")
    assert calls == [] and len(reference) > 100
    total = sum(AlphaFold(_tiny("on")[1]).checkpointed_blocks().values())  # tiny: 1 + 1 + 2 blocks
    for policy in ("on", 1, 3, total - 1):
        calls.clear()
        grads, other_loss = _gradients(policy)
        assert len(calls) == (total if policy == "on" else policy)  # blocks recomputed in the grad pass only
        assert torch.equal(other_loss, loss)
        assert grads.keys() == reference.keys()
        different = [n for n in grads if not torch.equal(grads[n], reference[n])]
        assert different == [], (policy, different[:5])


def test_the_model_refuses_what_it_cannot_run():
    model_cfg = _tiny("on")[1]
    with pytest.raises(ValueError, match="must be resolved"):
        AlphaFold(model_cfg, activation_checkpointing="auto")
    with pytest.raises(ValueError, match="the model has 4 blocks"):
        AlphaFold(model_cfg, activation_checkpointing=5)
    assert AlphaFold(model_cfg, activation_checkpointing="2").checkpointed_blocks() == {
        "template_pair_stack": 1, "extra_msa_stack": 1, "evoformer_stack": 0}  # fmt: skip


def test_training_option_takes_a_policy():
    assert TrainConfig.from_preset("mlperf", env={}).activation_checkpointing == "on"
    cfg = TrainConfig.from_preset("tiny", env={"SCALEFOLD_ACTIVATION_CHECKPOINTING": "auto"})
    assert cfg.activation_checkpointing == "auto"
    with pytest.raises(ValueError, match="expected on, off, auto or a number"):
        TrainConfig.from_preset("tiny", overrides={"activation_checkpointing": "sometimes"}, env={})
