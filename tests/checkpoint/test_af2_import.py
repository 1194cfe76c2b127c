"""Importing AlphaFold2 / OpenFold weights: what differs is said in one line, bad files are refused naming the
file, key and shapes, nothing is half-written, and the result is what ``--init-from``, ``evaluate`` and
``predict`` take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scalefold.checkpoint.adapters import reference_to_upstream_openfold
from scalefold.checkpoint.af2_import import (
    WeightsImportError,
    detect_format,
    import_af2,
    import_openfold,
    import_weights,
    read_init_source,
)
from scalefold.checkpoint.af2_synthetic import PREFIX, af2_arrays, af2_shapes
from scalefold.cli import main
from scalefold.errors import EXIT_USER_ERROR
from scalefold.model import AlphaFold, AlphaFoldConfig


def _save(path, arrays):
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)
    return path


def _refused(path, match, **kw):
    with pytest.raises(WeightsImportError, match=match) as info:
        import_weights(path, **kw)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


# --------------------------------------------------------------------------------------------
# Architecture differences
# --------------------------------------------------------------------------------------------


def test_preset_found_from_the_file(unique_af2_file):
    path, arrays = unique_af2_file
    result = import_weights(path)
    assert (result.source_format, result.preset, result.description) == ("af2", "tiny", "AlphaFold2 model_1/model_2")
    assert "tiny" in result.summary() and "\n" not in result.summary()
    assert result.num_values == sum(a.size for a in arrays.values())


def test_ptm_head_refused_dropped_or_mapped(random_af2_file, tiny_config):
    """A _ptm file: refused for the presets (no TM head) in one line; imported without the head on request
    (and said); mapped onto a model that has the TM head."""
    path, arrays = random_af2_file
    message = _refused(path, "predicted-aligned-error head.*every ScaleFold preset lacks")
    assert "--drop-pae-head" in message
    dropped = import_weights(path, drop_pae_head=True)
    assert "left out the predicted-aligned-error head" in dropped.summary()
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"auxiliary_heads_config": {"tm_score_head_enabled": True}})
    result = import_af2(path, model=AlphaFold(cfg))
    head = arrays[PREFIX + "predicted_aligned_error_head/logits//weights"]
    assert torch.equal(result.state_dict["auxiliary_heads.tm.linear.weight"], torch.from_numpy(head.T.copy()))


def test_model_3_without_templates(tmp_path, tiny_config):
    """model_3-5 (no template modules): refused for the presets naming what differs; mapped onto a model
    that embeds no templates; a model_1 file refused for that model."""
    arrays = af2_arrays(af2_shapes(tiny_config, templates=False))
    path = _save(tmp_path / "params_model_3.npz", arrays)
    _refused(path, "no template parameters.*model_3.*every ScaleFold preset embeds templates")
    no_templates = AlphaFold(AlphaFoldConfig.from_preset("tiny", overrides={"templates_enabled": False}))
    result = import_af2(path, model=no_templates)
    assert not any(n.startswith("template_") for n in result.state_dict)
    model_1 = _save(tmp_path / "params_model_1.npz", af2_arrays(af2_shapes(tiny_config)))
    with pytest.raises(WeightsImportError, match="has template parameters.*lacks"):
        import_af2(model_1, model=no_templates)


def test_multimer_and_other_networks_refused(tmp_path, tiny_config):
    arrays = af2_arrays(af2_shapes(tiny_config))
    multimer = dict(arrays, **{PREFIX + "evoformer/~_relative_encoding/position_activations//weights": np.ones((2, 2), np.float32)})
    _refused(_save(tmp_path / "params_model_1_multimer_v3.npz", multimer), "AlphaFold-Multimer parameters")
    other = {"encoder/layer_0/attention//query_w": np.ones((2, 2, 2), np.float32)}
    _refused(_save(tmp_path / "other.npz", other), "not AlphaFold2 parameters: 1 key outside alphafold/")
    _refused(_save(tmp_path / "flat.npz", {"w": np.ones(3, np.float32)}), "not a haiku parameter file")


def test_missing_extra_and_misshaped_keys_named(tmp_path, tiny_config):
    arrays = af2_arrays(af2_shapes(tiny_config))
    gone = [k for k in arrays if "/structure_module/" in k][:7]
    missing = {k: v for k, v in arrays.items() if k not in gone}
    message = _refused(_save(tmp_path / "missing.npz", missing), "missing 7 keys", preset="tiny")
    assert gone[0] in message and "(7 in all)" in message
    extra = dict(arrays, **{PREFIX + "evoformer/unknown_module//weights": np.ones((2, 2), np.float32)})
    _refused(_save(tmp_path / "extra.npz", extra), r"1 key that no parameter of preset 'tiny' takes: .*unknown_module", preset="tiny")
    key = PREFIX + "evoformer/evoformer_iteration/msa_row_attention_with_pair_bias/attention//query_w"
    bad = dict(arrays, **{key: np.ones((2, 32, 2, 8), np.float32)})  # 2 heads of 8 instead of 4 heads of 8
    _refused(_save(tmp_path / "shape.npz", bad), r"query_w' has shape \(2, 32, 2, 8\).*gives \(16, 32\).*needs \(32, 32\)",
             preset="tiny")  # fmt: skip
    blocks = dict(arrays, **{key: np.ones((3, 32, 4, 8), np.float32)})
    _refused(_save(tmp_path / "blocks.npz", blocks), "3 stacked blocks on axis 0, preset 'tiny' has 2", preset="tiny")
    _refused(_save(tmp_path / "auto.npz", bad), "fits no preset of .*against the closest, 'tiny'")


def test_unreadable_files_refused(tmp_path, unique_af2_file):
    path, _ = unique_af2_file
    data = path.read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[: len(data) // 2])
    _refused(tmp_path / "truncated.npz", "not a readable .npz file")
    corrupt = bytearray(data)
    corrupt[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64  # inside a member: its CRC no longer fits
    (tmp_path / "corrupt.npz").write_bytes(bytes(corrupt))
    _refused(tmp_path / "corrupt.npz", "key '.*' cannot be read: the file is truncated or corrupt")
    nan = {k: v for k, v in np.load(path).items()}
    first = next(iter(nan))
    nan[first] = nan[first].copy()
    nan[first].flat[0] = np.nan
    _refused(_save(tmp_path / "nan.npz", nan), "has 1 non-finite value")
    _refused(_save(tmp_path / "ints.npz", {PREFIX + "x//weights": np.ones(2, np.int32)}), "holds int32 values")
    pickled = {PREFIX + "x//weights": np.array([{"a": 1}], dtype=object)}  # never unpickled
    _refused(_save(tmp_path / "pickled.npz", pickled), r"cannot be read: \(ValueError: Object arrays cannot be loaded")
    (tmp_path / "text.bin").write_text("hello")
    _refused(tmp_path / "text.bin", "neither an AlphaFold2 .npz nor a PyTorch checkpoint")


# --------------------------------------------------------------------------------------------
# OpenFold
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_weights(unique_af2_file):
    return import_af2(unique_af2_file[0], preset="tiny").state_dict


@pytest.mark.parametrize("wrapper", ["bare", "lightning", "ema", "ddp"])
def test_openfold_checkpoints(tmp_path, reference_weights, wrapper):
    """OpenFold names, bare or in its training wrapper (Lightning ``model.`` names; the EMA weights
    preferred), import to the same tensors."""
    upstream = reference_to_upstream_openfold(reference_weights)
    obj = {
        "bare": upstream,
        "lightning": {"state_dict": {"model." + k: v for k, v in upstream.items()}, "epoch": 3},
        "ema": {"ema": {"params": upstream, "decay": 0.999}, "state_dict": {"model." + k: v * 0 for k, v in upstream.items()}},
        "ddp": {"module." + k: v for k, v in upstream.items()},
    }[wrapper]  # fmt: skip
    path = tmp_path / "openfold.pt"
    torch.save(obj, path)
    assert detect_format(path) == "openfold"
    result = import_weights(path)
    assert result.preset == "tiny" and result.source_format == "openfold"
    assert result.state_dict.keys() == reference_weights.keys()
    assert all(torch.equal(result.state_dict[k], v) for k, v in reference_weights.items())
    assert ("EMA weights" in result.description) == (wrapper == "ema")


def test_openfold_problems_named(tmp_path, reference_weights):
    upstream = reference_to_upstream_openfold(reference_weights)
    broken = {k: v for k, v in upstream.items() if "structure_module" not in k}
    torch.save(broken, tmp_path / "missing.pt")
    _refused(tmp_path / "missing.pt", r"missing \d+ parameters that preset 'tiny' needs", preset="tiny")
    torch.save(dict(upstream, **{"evoformer.blocks.0.tri_mul_out.linear_ab_p.weight": torch.ones(2)}), tmp_path / "mm.pt")
    _refused(tmp_path / "mm.pt", "OpenFold multimer checkpoint")
    torch.save({"alphafold_state_dict": reference_weights, "iteration": 0}, tmp_path / "ref.pt")
    _refused(tmp_path / "ref.pt", "already a ScaleFold / MLPerf reference checkpoint", source_format="openfold")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "missing.pt").read_bytes()[:1000])
    with pytest.raises(WeightsImportError, match="cut.pt"):
        import_openfold(tmp_path / "cut.pt")


# --------------------------------------------------------------------------------------------
# The command, --init-from, evaluate/predict
# --------------------------------------------------------------------------------------------


def test_command_writes_a_checkpoint_inference_loads(tmp_path, unique_af2_file, capsys):
    from scalefold.inference.weights import load_model

    path, _ = unique_af2_file
    out = tmp_path / "imported.pt"
    assert main(["import-weights", str(path), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"imported {path} (AlphaFold2 model_1/model_2)") and lines[1] == f"wrote {out}"
    loaded = load_model(out)  # what evaluate and predict use
    assert loaded.preset == "tiny" and loaded.iteration == 0
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["imported_from"]["file"] == path.name and len(ckpt["imported_from"]["sha256"]) == 64


def test_command_refuses_and_writes_nothing(tmp_path, random_af2_file, capsys):
    path, _ = random_af2_file
    out = tmp_path / "out.pt"
    assert main(["import-weights", str(path), "--out", str(out)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scalefold import-weights: import error: ") and path.name in err[0]
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary file


def test_command_check_runs_a_forward_pass(tmp_path, random_af2_file, capsys):
    path, _ = random_af2_file
    out = tmp_path / "checked.pt"
    assert main(["import-weights", str(path), "--out", str(out), "--drop-pae-head", "--check"]) == 0
    text = capsys.readouterr().out
    assert "structure_module.ipa.linear_kv.weight\t(64, 32)\talphafold/alphafold_iteration/structure_module/" in text
    assert "forward check on demo_target:" in text and "outputs finite" in text


def test_command_prints_the_mapping(capsys):
    assert main(["import-weights", "--mapping", "--preset", "tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = [line for line in lines if not line.startswith("#")]
    assert len(body) == len({line.split("\t")[0] for line in body}) == 429
    assert any("429 of 429 parameters mapped exactly once" in line for line in lines)


def test_init_from_imports_on_the_way(unique_af2_file, reference_weights):
    """``--init-from params.npz``: imported into the run's own model, said in one line, no Adam state."""
    from scalefold.config.training import TrainConfig
    from scalefold.model.factory import build_model, build_model_config
    from scalefold.optim.adam_swa import FlatAdamSWA
    from scalefold.train.run_checkpoints import init_from_checkpoint

    cfg = TrainConfig.from_preset("tiny", env={})
    model = build_model(cfg, build_model_config(cfg), torch.device("cpu"), torch.float32)
    opt = FlatAdamSWA(list(model.named_parameters()), lr=1e-3, eps=1e-6, swa_decay=0.9)
    said = []
    iteration, sha = init_from_checkpoint(str(unique_af2_file[0]), model, opt, say=said.append)
    assert iteration == 0 and len(sha) == 64 and len(said) == 1 and said[0].startswith("imported ")
    assert "the run's model" in said[0]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), reference_weights[name]), name
    assert opt.num_steps == 0
    assert read_init_source(unique_af2_file[0], model)["iteration"] == 0


def test_init_source_of_each_kind(tmp_path, reference_weights):
    """``--init-from``: an OpenFold checkpoint is imported on the way too; a reference checkpoint, and a bare
    state dict with reference names, load as they always did (no import, nothing said)."""
    model = AlphaFold(AlphaFoldConfig.from_preset("tiny"))
    said = []
    torch.save({"ema": {"params": reference_to_upstream_openfold(reference_weights)}}, tmp_path / "of.pt")
    ckpt = read_init_source(tmp_path / "of.pt", model, say=said.append)
    assert said and "OpenFold checkpoint, EMA weights" in said[0] and ckpt["iteration"] == 0
    assert all(torch.equal(ckpt["alphafold_state_dict"][k], v) for k, v in reference_weights.items())
    reference = {"alphafold_state_dict": reference_weights, "iteration": 5}
    torch.save(reference, tmp_path / "ref.pt")
    torch.save(reference_weights, tmp_path / "bare.pt")
    assert read_init_source(tmp_path / "ref.pt", model, say=said.append)["iteration"] == 5
    assert set(read_init_source(tmp_path / "bare.pt", model, say=said.append)) == set(reference_weights)
    assert len(said) == 1
