"""The AlphaFold2 -> ScaleFold mapping: coverage, each transform on a hand-made case, every value traced,
ScaleFold's modules against AlphaFold's (numpy, from the file), and planted mistakes that must fail.

The files are written by :mod:`scalefold.checkpoint.af2_synthetic` from AlphaFold's module structure; the
checks (``af2_checks``) know AF2's layout on their own, not through the mapping table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from af2_checks import module_problems, trace_problems

from scalefold.checkpoint import af2_mapping as mapping
from scalefold.checkpoint.af2_import import WeightsImportError, import_af2
from scalefold.checkpoint.af2_synthetic import af2_shapes, trace_index
from scalefold.model import AlphaFold, AlphaFoldConfig


def _meta_model(cfg: AlphaFoldConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(t.shape) for n, t in AlphaFold(cfg, activation_checkpointing=False).state_dict().items()}


@pytest.mark.parametrize("preset,templates,ptm", [
    ("tiny", True, False), ("tiny", True, True), ("tiny", False, False), ("mlperf", True, False), ("mlperf", True, True),
])  # fmt: skip
def test_every_parameter_is_mapped_exactly_once(preset, templates, ptm):
    """Each parameter of the model (model_1 / _ptm / model_3 architectures) has one row; each key of the
    AF2 file (written from AF2's structure) is read, stacked keys once per block; every shape fits."""
    cfg = AlphaFoldConfig.from_preset(preset, overrides={"templates_enabled": templates,
                                                         "auxiliary_heads_config": {"tm_score_head_enabled": ptm}})  # fmt: skip
    shapes = _meta_model(cfg)
    entries, uncovered = mapping.expand(shapes)
    assert uncovered == []
    assert [e.target for e in entries] == list(shapes)
    file_shapes = af2_shapes(cfg, templates=templates, ptm=ptm)
    by_key = mapping.source_keys(entries)
    assert set(by_key) == set(file_shapes)
    for key, readers in by_key.items():
        blocks = [e.block for e in readers]
        assert blocks == ([None] if blocks == [None] else list(range(file_shapes[key][0]))), key
    for e in entries:
        assert mapping.converted_shape(e, file_shapes[e.source]) == shapes[e.target], e.target
    if preset == "mlperf" and templates and not ptm:
        assert sum(np.prod(s) for s in shapes.values()) == 93_229_082  # AlphaFold2 model_1


def test_linear_layer_transform():
    """haiku ``x @ w + b`` with ``w`` [in, out] equals torch's Linear with the converted weight."""
    w, b = np.arange(6.0).reshape(3, 2), np.array([0.5, -1.0])
    x = np.array([[1.0, 2.0, 3.0]])
    weight = mapping.TRANSFORMS["linear"].fn(w)
    assert weight.tolist() == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    assert np.allclose(torch.nn.functional.linear(torch.tensor(x), torch.tensor(weight), torch.tensor(b)).numpy(),
                       x @ w + b)  # fmt: skip


def test_multi_head_projection_transforms():
    """``einsum('a,ahc->hc')`` equals the flattened projection viewed as [H, c]; the gate bias [H, c] flattens
    the same way; the output ``einsum('hc,hco->o')`` equals the flattened output projection."""
    rng = np.random.default_rng(0)
    c_in, heads, c_head, c_out = 3, 2, 4, 5
    x = rng.standard_normal(c_in)
    w_in = rng.standard_normal((c_in, heads, c_head))
    q = mapping.TRANSFORMS["heads_in"].fn(w_in) @ x
    assert q.shape == (heads * c_head,)
    assert np.allclose(q.reshape(heads, c_head), np.einsum("a,ahc->hc", x, w_in))
    bias = rng.standard_normal((heads, c_head))
    assert np.array_equal(mapping.TRANSFORMS["heads_bias"].fn(bias).reshape(heads, c_head), bias)
    o = rng.standard_normal((heads, c_head))
    w_out = rng.standard_normal((heads, c_head, c_out))
    assert np.allclose(mapping.TRANSFORMS["heads_out"].fn(w_out) @ o.reshape(-1), np.einsum("hc,hco->o", o, w_out))
    # the outer product's [c, c, out]: the left channel is the major one of the flattening
    left, right = rng.standard_normal(2), rng.standard_normal(3)
    w_opm = rng.standard_normal((2, 3, c_out))
    flat = np.outer(left, right).reshape(-1)  # ScaleFold: outer product flattened left-major
    assert np.allclose(mapping.TRANSFORMS["flat_out"].fn(w_opm) @ flat, np.einsum("c,e,cef->f", left, right, w_opm))
    for kind, t in mapping.TRANSFORMS.items():  # the shape rule agrees with the function
        shape = (2, 3, 4)[: t.ndim]
        assert t.fn(np.zeros(shape)).shape == t.shape(shape), kind


def test_stacked_block_transform():
    """A stacked key's block i is axis-0 slice i, converted on its own."""
    stacked = np.arange(3 * 2 * 4, dtype=np.float64).reshape(3, 2, 4)  # 3 blocks of a [2, 4] linear weight
    for block in range(3):
        entry = mapping.Entry(f"x.blocks.{block}.w", "k", "linear", block, "core")
        assert np.array_equal(mapping.convert(entry, stacked), stacked[block].T)


def test_every_value_traces_back_to_its_source(unique_af2_file):
    """Every imported value comes from the key and index the haiku parameter's kind dictates, stacked
    keys from the block named in the ScaleFold parameter; every value of the file is used once."""
    path, arrays = unique_af2_file
    result = import_af2(path, preset="tiny")
    assert trace_problems(result.state_dict, arrays, trace_index(arrays)) == []


def test_modules_compute_what_alphafold_computes(random_af2_file, tiny_config):
    """With imported weights, ScaleFold's attention, triangle multiplications, outer product mean and global
    column attention equal AlphaFold's (numpy from the file's arrays), in float64."""
    path, arrays = random_af2_file
    model = _loaded(import_af2(path, preset="tiny", drop_pae_head=True), tiny_config)
    assert module_problems(model, arrays) == []


def _loaded(result, cfg) -> AlphaFold:
    model = AlphaFold(cfg, activation_checkpointing=False).double().eval()
    model.load_state_dict(result.state_dict)
    return model


def _planted(monkeypatch, edit) -> None:
    rows = {group: list(rows) for group, rows in mapping.ROWS.items()}
    edit(rows)
    monkeypatch.setattr(mapping, "ROWS", rows)


def _replace(rows, target, new):
    for group in rows.values():
        for i, row in enumerate(group):
            if row[0] == target:
                group[i] = new(row)
                return
    raise AssertionError(target)


def test_planted_missing_transpose_fails(monkeypatch, unique_af2_file):
    """A square linear weight taken as stored (no transpose) has the right shape: the trace catches it. (Taken
    as a ``copy`` instead, the importer refuses it already: ``copy`` is for vectors.)"""
    path, arrays = unique_af2_file
    target = "evoformer_stack.blocks.{i}.core.tri_mul_out.linear_z.weight"  # [16, 16] in the tiny preset
    _planted(monkeypatch, lambda rows: _replace(rows, target, lambda r: (r[0], r[1], "copy")))
    with pytest.raises(WeightsImportError, match=r"output_projection//weights.*wrong rank"):
        import_af2(path, preset="tiny")
    as_stored = mapping.Transform(lambda w: w, lambda s: tuple(s), "[c_in, c_out]", "[c_in, c_out]")
    monkeypatch.setitem(mapping.TRANSFORMS, "as_stored", as_stored)
    _planted(monkeypatch, lambda rows: _replace(rows, target, lambda r: (r[0], r[1], "as_stored")))
    problems = trace_problems(import_af2(path, preset="tiny").state_dict, arrays, trace_index(arrays))
    assert problems and all("tri_mul_out.linear_z.weight" in p for p in problems), problems


def test_planted_block_off_by_one_fails(monkeypatch, unique_af2_file):
    """Reading block i+1 (mod the count) for block i: same shapes; the trace names the block read."""
    path, arrays = unique_af2_file
    real = mapping.expand

    def shifted(names, groups=None):
        entries, uncovered = real(names, groups)
        fix = lambda e: mapping.Entry(e.target, e.source, e.transform, (e.block + 1) % 2, e.group)  # noqa: E731
        return [fix(e) if e.block is not None and e.target.startswith("evoformer_stack.") else e
                for e in entries], uncovered  # fmt: skip

    monkeypatch.setattr(mapping, "expand", shifted)
    problems = trace_problems(import_af2(path, preset="tiny").state_dict, arrays, trace_index(arrays))
    assert problems and "from block 1" in problems[0], problems


@pytest.mark.parametrize("module,pair", [
    ("triangle_multiplication_incoming", ("tri_mul_in.linear_a_p", "tri_mul_in.linear_b_p")),
    ("msa_row_attention", ("msa_att_row.mha.linear_q", "msa_att_row.mha.linear_k")),
    ("outer_product_mean", ("outer_product_mean.linear_1", "outer_product_mean.linear_2")),
    ("msa_column_global_attention", ("global_attention.linear_k", "global_attention.linear_v")),
])  # fmt: skip
def test_planted_swapped_projections_fail(monkeypatch, random_af2_file, tiny_config, module, pair):
    """Two same-shaped projections swapped (e.g. AlphaFold's incoming left/right taken as ScaleFold's a/b):
    the trace cannot see it, the module comparison does."""
    path, arrays = random_af2_file
    a, b = pair

    def swap(rows):
        sources = {}
        for group in rows.values():
            for row in group:
                for name in (a, b):
                    if f".{name}." in row[0]:
                        sources[row[0]] = row[1]
        for target, source in sources.items():
            other = target.replace(a, b) if a in target else target.replace(b, a)
            _replace(rows, other, lambda r, source=source: (r[0], source, r[2]))

    _planted(monkeypatch, swap)
    model = _loaded(import_af2(path, preset="tiny", drop_pae_head=True), tiny_config)
    problems = module_problems(model, arrays)
    assert problems and any(module in p for p in problems), problems


def test_mapping_lines_name_the_three_columns():
    """Each expanded line is 'ScaleFold parameter, haiku key[block], transform', the key a real AF2 key."""
    shapes = _meta_model(AlphaFoldConfig.from_preset("tiny"))
    entries, _ = mapping.expand(shapes)
    line = next(e for e in entries if e.target == "evoformer_stack.blocks.1.msa_att_row.mha.linear_q.weight")
    assert line.describe() == ("evoformer_stack.blocks.1.msa_att_row.mha.linear_q.weight\talphafold/alphafold_iteration/"
                               "evoformer/evoformer_iteration/msa_row_attention_with_pair_bias/attention//query_w[1]\t"
                               "heads_in")  # fmt: skip
    counts = mapping.coverage(entries, shapes)
    assert sum(c["parameters"] for k, c in counts.items() if k != "stacked") == len(shapes)
    assert set(counts) == set(mapping.TRANSFORMS) | {"stacked"}


def test_state_dict_written_back_in_af2_layout_round_trips(tmp_path, tiny_config):
    """A ScaleFold model written in AlphaFold's layout (how the fine-tuning demo's file is made from the shipped
    weights) has exactly the keys and shapes of an AF2 file and imports back to the same tensors."""
    from scalefold.checkpoint.af2_synthetic import af2_arrays_from_state_dict

    torch.manual_seed(0)
    state = AlphaFold(tiny_config, activation_checkpointing=False).state_dict()
    arrays = af2_arrays_from_state_dict(state, tiny_config)
    assert {k: a.shape for k, a in arrays.items()} == af2_shapes(tiny_config)
    path = tmp_path / "written_back.npz"
    np.savez(path, **arrays)
    result = import_af2(path, preset="tiny")
    assert all(torch.equal(result.state_dict[k], v) for k, v in state.items())
