"""Checkpoint adapters (``scalefold.checkpoint``): strict reference-name loading with a readable
error, the reference checkpoint / SWA file layouts, and upstream OpenFold name mapping."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from scalefold.checkpoint import (
    CheckpointError,
    StateDictMismatchError,
    load_reference_checkpoint,
    load_reference_state_dict,
    load_swa_checkpoint,
    reference_name_to_upstream,
    reference_to_upstream_openfold,
    save_reference_checkpoint,
    swa_state_dict,
    upstream_name_to_reference,
    upstream_openfold_to_reference,
)


class _Net(nn.Module):
    def __init__(self, width: int = 4, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))


def _read_tsv(path):
    rows = []
    for line in path.read_text().splitlines():
        name, shape, _ = line.split("\t")
        rows.append((name, tuple(int(x) for x in shape.strip("()").split(",") if x.strip())))
    return rows


def test_strict_load_lists_missing_unexpected_and_misshaped():
    """A mismatching state dict is refused (nothing loaded) with every category named."""
    model = _Net()
    sd = _Net().state_dict()
    del sd["blocks.0.weight"]
    sd["blocks.9.weight"] = torch.zeros(4, 4)
    sd["blocks.1.bias"] = torch.zeros(5)
    before = model.blocks[2].weight.clone()
    with pytest.raises(StateDictMismatchError) as info:
        load_reference_state_dict(model, sd)
    msg = str(info.value)
    assert "1 missing" in msg and "blocks.0.weight" in msg
    assert "1 unexpected" in msg and "blocks.9.weight" in msg
    assert "mis-shaped" in msg and "blocks.1.bias (5,) vs (4,)" in msg
    assert torch.equal(model.blocks[2].weight, before)


def test_mismatch_error_is_truncated():
    """Long name lists are cut to a few entries plus a count."""
    model = _Net(blocks=30)
    with pytest.raises(StateDictMismatchError, match=r"(?s)60 missing:.*\.\.\. and 50 more"):
        load_reference_state_dict(model, {})


def test_non_strict_load_reports_and_loads_the_rest():
    """strict=False loads matching tensors and returns the report."""
    model, source = _Net(), _Net()
    sd = source.state_dict()
    del sd["blocks.0.weight"]
    report = load_reference_state_dict(model, sd, strict=False)
    assert report.missing == ["blocks.0.weight"] and not report.unexpected
    assert torch.equal(model.blocks[1].weight, source.blocks[1].weight)


def test_checkpoint_dict_and_ddp_prefix_accepted():
    """Both a raw state dict, the ``alphafold_state_dict`` wrapper and ``module.`` names load."""
    source = _Net()
    for sd in (
        source.state_dict(),
        {"alphafold_state_dict": source.state_dict()},
        {"module." + k: v for k, v in source.state_dict().items()},
    ):
        model = _Net()
        load_reference_state_dict(model, sd)
        assert torch.equal(model.blocks[0].weight, source.blocks[0].weight)


def test_reference_checkpoint_round_trip(tmp_path):
    """model + Adam state (indexed in parameter order) + iteration survive save/load."""
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-6)
    model.blocks[0].weight.sum().backward()
    opt.step()
    path = tmp_path / "resumable_checkpoint.pt"
    save_reference_checkpoint(path, model, opt, iteration=7)
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"alphafold_state_dict", "optimizer_state_dict", "iteration"}

    model2 = _Net()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3, eps=1e-6)
    assert load_reference_checkpoint(path, model2, opt2) == 7
    assert torch.equal(model2.blocks[0].weight, model.blocks[0].weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_adam_state_must_match_parameters(tmp_path):
    """An optimizer state for a different parameter layout is refused with a clear message."""
    small, big = _Net(width=4), _Net(width=5)
    opt = torch.optim.Adam(small.parameters())
    small.blocks[0].weight.sum().backward()
    opt.step()
    ckpt = {"alphafold_state_dict": big.state_dict(), "optimizer_state_dict": opt.state_dict(), "iteration": 1}
    with pytest.raises(CheckpointError, match="Adam state does not match"):
        load_reference_checkpoint(ckpt, big, torch.optim.Adam(big.parameters()))


def test_swa_file_round_trip(tmp_path):
    """The SWA layout ``averaged_model.n_averaged`` + ``averaged_model.module.<name>`` loads."""
    source = _Net()
    path = tmp_path / "swa.pt"
    torch.save(swa_state_dict(source, n_averaged=12), path)
    assert "averaged_model.n_averaged" in torch.load(path, weights_only=True)
    model = _Net()
    weights, n = load_swa_checkpoint(path, model)
    assert n == 12 and set(weights) == set(source.state_dict())
    assert torch.equal(model.blocks[2].bias, source.blocks[2].bias)


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    """Truncated files, non-dicts and dicts of another layout raise CheckpointError naming the problem."""
    model = _Net()
    good = tmp_path / "good.pt"
    save_reference_checkpoint(good, model, torch.optim.Adam(model.parameters()), iteration=0)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(good.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="checkpoint .*corrupt.pt cannot be loaded: truncated"):
        load_reference_checkpoint(corrupt, model)
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("hello")
    with pytest.raises(CheckpointError, match="garbage.pt is not a PyTorch checkpoint .it starts with 'hello'"):
        load_reference_checkpoint(garbage, model)
    tensor_file = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), tensor_file)
    with pytest.raises(CheckpointError, match="not a checkpoint dict"):
        load_reference_checkpoint(tensor_file, model)
    with pytest.raises(CheckpointError, match="not a reference checkpoint: missing"):
        load_reference_checkpoint({"weights": model.state_dict()}, model)
    with pytest.raises(CheckpointError, match="not a reference SWA checkpoint"):
        load_swa_checkpoint(good, model)
    with pytest.raises(CheckpointError, match="absent.pt not found"):
        load_reference_checkpoint(tmp_path / "absent.pt", model)
    with pytest.raises(CheckpointError, match="is a directory"):
        load_reference_checkpoint(tmp_path, model)


def test_upstream_mapping_covers_every_name(reference_dir):
    """Every reference name maps to an upstream OpenFold name of the same shape and back."""
    ref = _read_tsv(reference_dir / "state_dict_initial_training.tsv")
    up = dict(_read_tsv(reference_dir / "openfold_upstream_state_dict_model_1.tsv"))
    assert len(ref) == len(up) == 5044
    mapped = {reference_name_to_upstream(n): s for n, s in ref}
    assert mapped == up
    assert [upstream_name_to_reference(reference_name_to_upstream(n)) for n, _ in ref] == [n for n, _ in ref]


def test_upstream_state_dict_round_trip(reference_dir):
    """State-dict level: reference -> upstream -> reference is the identity on names and tensors."""
    ref = _read_tsv(reference_dir / "state_dict_initial_training.tsv")[:200] + [
        ("structure_module.transition.linear_1.weight", (2, 2)),
        ("structure_module.ipa.linear_q_points.bias", (3,)),
    ]
    sd = {n: torch.randn(2) for n, _ in ref}
    up = reference_to_upstream_openfold(sd)
    assert "structure_module.transition.layers.0.linear_1.weight" in up
    assert "structure_module.ipa.linear_q_points.linear.bias" in up
    back = upstream_openfold_to_reference(up)
    assert list(back) == list(sd) and all(back[k] is sd[k] for k in sd)


def test_upstream_extra_transition_layer_is_refused():
    """Upstream structure-module transition layers beyond the first have no reference counterpart."""
    with pytest.raises(CheckpointError, match="one layer"):
        upstream_openfold_to_reference({"structure_module.transition.layers.1.linear_1.weight": torch.zeros(1)})
