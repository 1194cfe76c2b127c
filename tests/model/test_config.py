"""Configuration dataclasses and presets (``scalefold.model.config``)."""

from __future__ import annotations

import pytest
import torch

from scalefold.model.config import PRESETS, AlphaFoldConfig

MLPERF_NUM_PARAMETERS = 93_229_082
MLPERF_NUM_TENSORS = 5_044


def _read_tsv(path):
    rows = []
    for line in path.read_text().splitlines():
        name, shape, _ = line.split("\t")
        rows.append((name, tuple(int(x) for x in shape.strip("()").split(",") if x.strip())))
    return rows


def test_reference_dict_round_trip(golden_small):
    """``from_dict`` accepts the reference's plain config dict exactly and ``to_dict`` returns it."""
    cfg = AlphaFoldConfig.from_dict(golden_small["config"])
    assert cfg.to_dict() == golden_small["config"]


def test_tiny_preset_is_the_golden_small_config(golden_small):
    """``tiny`` has exactly the golden_small dimensions (only the preset label differs)."""
    tiny = AlphaFoldConfig.from_preset("tiny").to_dict()
    golden = dict(golden_small["config"])
    tiny.pop("preset"), golden.pop("preset")
    assert tiny == golden


def test_mlperf_preset_values():
    """``mlperf`` = reference initial_training: the closed-division hyper-parameters."""
    cfg = AlphaFoldConfig.from_preset("mlperf")
    assert cfg.to_dict() == {**AlphaFoldConfig.from_preset("initial_training").to_dict(), "preset": "mlperf-tf32"}
    assert (cfg.train_sequence_crop_size, cfg.max_msa_clusters, cfg.max_extra_msa, cfg.max_templates) == (
        256,
        124,
        1024,
        4,
    )
    assert cfg.num_recycling_iters == 3
    evo = cfg.evoformer_stack_config
    assert (evo.c_m, evo.c_z, evo.c_s, evo.num_blocks, evo.msa_dropout, evo.pair_dropout) == (
        256,
        128,
        384,
        48,
        0.15,
        0.25,
    )
    assert cfg.extra_msa_stack_config.num_blocks == 4 and cfg.template_pair_stack_config.num_blocks == 2
    assert cfg.structure_module_config.num_blocks == 8 and cfg.structure_module_config.num_heads_ipa == 12
    loss = cfg.loss_config
    weights = [
        loss.fape_loss_config.weight,
        loss.supervised_chi_loss_config.weight,
        loss.distogram_loss_config.weight,
        loss.masked_msa_loss_config.weight,
        loss.plddt_loss_config.weight,
        loss.experimentally_resolved_loss_config.weight,
        loss.violation_loss_config.weight,
    ]
    assert weights == [1.0, 1.0, 0.3, 2.0, 0.01, 0.0, 0.0]
    assert (cfg.clip_grad_max_norm, cfg.swa_decay_rate, cfg.use_clamped_fape_probability) == (0.1, 0.9, 0.9)


def test_demo_preset_is_small():
    """``demo`` is a CPU-sized model: c_m 32, c_z 16, 2 Evoformer blocks, crop 64."""
    cfg = AlphaFoldConfig.from_preset("demo")
    assert cfg.evoformer_stack_config.c_m == 32 and cfg.evoformer_stack_config.c_z == 16
    assert cfg.evoformer_stack_config.num_blocks == 2 and cfg.train_sequence_crop_size == 64


def test_unknown_key_is_rejected_with_its_path():
    """Unknown keys anywhere in the tree raise a ValueError naming the dotted key."""
    with pytest.raises(ValueError, match="evoformer_stack_config.*num_blockz"):
        AlphaFoldConfig.from_dict({"evoformer_stack_config": {"num_blockz": 3}})
    with pytest.raises(ValueError, match="no_such_global"):
        AlphaFoldConfig.from_dict({"no_such_global": 1})


def test_wrong_type_is_rejected():
    """Values are type-checked (ints accepted for floats, not the other way round)."""
    with pytest.raises(ValueError, match="evoformer_stack_config.num_blocks"):
        AlphaFoldConfig.from_dict({"evoformer_stack_config": {"num_blocks": 2.5}})
    with pytest.raises(ValueError, match="templates_enabled"):
        AlphaFoldConfig.from_dict({"templates_enabled": 1})
    with pytest.raises(ValueError, match="chunk_size_opm"):
        AlphaFoldConfig.from_dict({"evoformer_stack_config": {"chunk_size_opm": "128"}})
    chunked = AlphaFoldConfig.from_dict({"evoformer_stack_config": {"chunk_size_opm": 128}})
    assert chunked.evoformer_stack_config.chunk_size_opm == 128
    cfg = AlphaFoldConfig.from_dict({"evoformer_stack_config": {"inf": 1}})
    assert cfg.evoformer_stack_config.inf == 1.0 and isinstance(cfg.evoformer_stack_config.inf, float)


def test_overrides_and_precision():
    """Nested overrides merge onto a preset; fp16 lowers the finite infinities like the reference."""
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"evoformer_stack_config": {"num_blocks": 1}})
    assert cfg.evoformer_stack_config.num_blocks == 1 and cfg.evoformer_stack_config.c_m == 32
    half = AlphaFoldConfig.from_preset("mlperf", precision="fp16")
    assert half.evoformer_stack_config.inf == 1e4 and half.template_pair_feat_inf == 1e4
    with pytest.raises(ValueError, match="unknown preset"):
        AlphaFoldConfig.from_preset("huge")
    assert {"mlperf", "initial_training", "demo", "tiny"} <= set(PRESETS)


def _meta_model(preset):
    from scalefold.model.alphafold import AlphaFold

    with torch.device("meta"):
        return AlphaFold(AlphaFoldConfig.from_preset(preset))


def test_mlperf_parameter_count():
    """The mlperf model has the logged model_parameters_count 93,229,082 in 5,044 tensors."""
    model = _meta_model("mlperf")
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == MLPERF_NUM_PARAMETERS
    assert len(params) == MLPERF_NUM_TENSORS


def test_mlperf_state_dict_matches_reference_names(reference_dir):
    """state_dict names, order and shapes equal the reference TSV (= Adam parameter order)."""
    expected = _read_tsv(reference_dir / "state_dict_initial_training.tsv")
    model = _meta_model("mlperf")
    actual = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    assert actual == expected
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in expected]
