"""Parameter files in AlphaFold2's exact layout, with fixed-seed values: the stand-in for DeepMind's files.

DeepMind's ``params_model_*.npz`` cannot be downloaded everywhere (and not in CI), so the importer is
tested on files written here from the published structure of AlphaFold2's haiku modules
(``alphafold/model/modules.py``, ``folding.py``: module names, parameter names, shapes, which stacks are
stacked on axis 0). This module does not use the import mapping (:mod:`scalefold.checkpoint.af2_mapping`):
it describes AlphaFold's side on its own, so that a wrong row of the mapping shows up as a test failure.

The sizes come from a ScaleFold :class:`~scalefold.model.AlphaFoldConfig` (the ``mlperf`` preset gives
``model_1``'s sizes; ``demo``/``tiny`` give small files of the same layout). Values (``values=``):

* ``"random"`` -- fixed-seed Gaussians scaled by 1/sqrt(fan-in) (LayerNorm scales near 1), a sensible
  starting point for the fine-tuning demo;
* ``"unique"`` -- every value of the file distinct and exactly representable in float32 (a seeded
  permutation of ``(k - n/2) / 2**m``), so every imported value can be traced back to its source array and
  index (:func:`trace_index`); only for files of fewer than 2**24 values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Union

import numpy as np
import torch

from scalefold.model.config import AlphaFoldConfig

PREFIX = "alphafold/alphafold_iteration/"
Shapes = dict[str, tuple[int, ...]]


def _linear(c_in: int, c_out: int, bias: bool = True) -> Shapes:
    return {"weights": (c_in, c_out), **({"bias": (c_out,)} if bias else {})}


def _norm(c: int) -> Shapes:
    return {"scale": (c,), "offset": (c,)}


def _attention(c_q: int, c_kv: int, heads: int, c_head: int, c_out: int, gated: bool = True) -> dict:
    """haiku ``Attention`` (modules.py): q/k/v ``[c, H, c_head]``, output ``[H, c_head, c_out]``."""
    params = {"query_w": (c_q, heads, c_head), "key_w": (c_kv, heads, c_head), "value_w": (c_kv, heads, c_head),
              "output_w": (heads, c_head, c_out), "output_b": (c_out,)}  # fmt: skip
    if gated:
        params.update(gating_w=(c_q, heads, c_head), gating_b=(heads, c_head))
    return params


def _global_attention(c: int, heads: int, c_head: int) -> dict:
    """haiku ``GlobalAttention``: one key and value projection shared by the heads."""
    return {"query_w": (c, heads, c_head), "key_w": (c, c_head), "value_w": (c, c_head),
            "gating_w": (c, heads, c_head), "gating_b": (heads, c_head), "output_w": (heads, c_head, c),
            "output_b": (c,)}  # fmt: skip


def _transition(c: int, factor: int) -> dict:
    return {"input_layer_norm": _norm(c), "transition1": _linear(c, c * factor), "transition2": _linear(c * factor, c)}


def _tri_mul(c: int, hidden: int) -> dict:
    return {"layer_norm_input": _norm(c), "left_projection": _linear(c, hidden), "right_projection": _linear(c, hidden),
            "left_gate": _linear(c, hidden), "right_gate": _linear(c, hidden), "center_layer_norm": _norm(hidden),
            "output_projection": _linear(hidden, c), "gating_linear": _linear(c, c)}  # fmt: skip


def _tri_att(c: int, heads: int, c_head: int) -> dict:
    return {"query_norm": _norm(c), "": {"feat_2d_weights": (c, heads)},
            "attention": _attention(c, c, heads, c_head, c)}  # fmt: skip


def _pair_updates(c_z: int, tri_mul: int, tri_heads: int, tri_head: int, factor: int) -> dict:
    return {
        "triangle_multiplication_outgoing": _tri_mul(c_z, tri_mul),
        "triangle_multiplication_incoming": _tri_mul(c_z, tri_mul),
        "triangle_attention_starting_node": _tri_att(c_z, tri_heads, tri_head),
        "triangle_attention_ending_node": _tri_att(c_z, tri_heads, tri_head),
        "pair_transition": _transition(c_z, factor),
    }


def _evoformer_iteration(c, extra: bool) -> dict:
    """modules.py ``EvoformerIteration`` (``c``: ScaleFold's stack config)."""
    c_m = c.c_e if extra else c.c_m
    block = {
        "msa_row_attention_with_pair_bias": {
            "query_norm": _norm(c_m), "feat_2d_norm": _norm(c.c_z), "": {"feat_2d_weights": (c.c_z, c.num_heads_msa)},
            "attention": _attention(c_m, c_m, c.num_heads_msa, c.c_hidden_msa_att, c_m),
        },
        "msa_transition": _transition(c_m, c.transition_n),
        "outer_product_mean": {
            "layer_norm_input": _norm(c_m), "left_projection": _linear(c_m, c.c_hidden_opm),
            "right_projection": _linear(c_m, c.c_hidden_opm),
            "": {"output_w": (c.c_hidden_opm, c.c_hidden_opm, c.c_z), "output_b": (c.c_z,)},
        },
        **_pair_updates(c.c_z, c.c_hidden_tri_mul, c.num_heads_tri, c.c_hidden_tri_att, c.transition_n),
    }  # fmt: skip
    if extra:
        block["msa_column_global_attention"] = {
            "query_norm": _norm(c_m), "attention": _global_attention(c_m, c.num_heads_msa, c.c_hidden_msa_att)}
    else:
        block["msa_column_attention"] = {
            "query_norm": _norm(c_m), "attention": _attention(c_m, c_m, c.num_heads_msa, c.c_hidden_msa_att, c_m)}
    return block


def _structure_module(cfg: AlphaFoldConfig) -> dict:
    """folding.py ``StructureModule``: one ``fold_iteration`` shared by all iterations."""
    sm = cfg.structure_module_config
    h, pv = sm.num_heads_ipa, sm.num_v_points
    ipa = {
        "q_scalar": _linear(sm.c_s, h * sm.c_hidden_ipa),
        "kv_scalar": _linear(sm.c_s, h * 2 * sm.c_hidden_ipa),
        "q_point_local": _linear(sm.c_s, h * 3 * sm.num_qk_points),
        "kv_point_local": _linear(sm.c_s, h * 3 * (sm.num_qk_points + pv)),
        "": {"trainable_point_weights": (h,)},
        "attention_2d": _linear(sm.c_z, h),
        "output_projection": _linear(h * (sm.c_hidden_ipa + sm.c_z + 4 * pv), sm.c_s),
    }
    r = sm.c_hidden_ang_res
    sidechain = {"input_projection": _linear(sm.c_s, r), "input_projection_1": _linear(sm.c_s, r),
                 "unnormalized_angles": _linear(r, 2 * sm.num_angles)}  # fmt: skip
    for k in range(sm.num_ang_res_blocks):  # haiku numbers a name used again in one module: name, name_1, ...
        suffix = f"_{k}" if k else ""
        sidechain[f"resblock1{suffix}"] = _linear(r, r)
        sidechain[f"resblock2{suffix}"] = _linear(r, r)
    fold = {"invariant_point_attention": ipa, "attention_layer_norm": _norm(sm.c_s),
            "transition": _linear(sm.c_s, sm.c_s), "transition_1": _linear(sm.c_s, sm.c_s),
            "transition_2": _linear(sm.c_s, sm.c_s), "transition_layer_norm": _norm(sm.c_s),
            "affine_update": _linear(sm.c_s, 6), "rigid_sidechain": sidechain}  # fmt: skip
    return {"single_layer_norm": _norm(sm.c_s), "initial_projection": _linear(sm.c_s, sm.c_s),
            "pair_layer_norm": _norm(sm.c_z), "fold_iteration": fold}  # fmt: skip


def _template_embedding(cfg: AlphaFoldConfig) -> tuple[dict, dict]:
    """(the template modules under ``evoformer/``, the template pair stack's block)."""
    tp, tpa = cfg.template_pair_stack_config, cfg.template_pointwise_attention_config
    modules = {
        "template_single_embedding": _linear(cfg.template_angle_embedder_config.ta_dim, cfg.evoformer_stack_config.c_m),
        "template_projection": _linear(cfg.evoformer_stack_config.c_m, cfg.evoformer_stack_config.c_m),
        "template_embedding": {
            "single_template_embedding": {
                "embedding2d": _linear(cfg.template_pair_embedder_config.tp_dim, tp.c_t),
                "output_layer_norm": _norm(tp.c_t),
            },
            "attention": _attention(tpa.c_z, tpa.c_t, tpa.num_heads, tpa.c_hidden, tpa.c_z, gated=False),
        },
    }
    block = _pair_updates(tp.c_t, tp.c_hidden_tri_mul, tp.num_heads_tri, tp.c_hidden_tri_att, tp.pair_transition_n)
    return modules, block


def _flatten(tree: Mapping, scope: str, out: Shapes, stack: int | None = None) -> None:
    """haiku's flat names: ``scope//param``; a ``""`` entry holds parameters of the enclosing module."""
    for name, value in tree.items():
        if isinstance(value, tuple):
            out[f"{scope}//{name}"] = ((stack,) if stack else ()) + value
        elif name == "":
            _flatten(value, scope, out, stack)
        else:
            _flatten(value, f"{scope}/{name}" if scope else name, out, stack)


def af2_shapes(cfg: AlphaFoldConfig, templates: bool = True, ptm: bool = False) -> Shapes:
    """Every key of the AlphaFold2 monomer parameter file of ``cfg``'s sizes, with its shape, in file order.

    ``templates=False``: ``model_3`` ... ``model_5`` (no template modules); ``ptm``: the ``_ptm`` files'
    predicted-aligned-error head."""
    ie, evo, ex = cfg.input_embedder_config, cfg.evoformer_stack_config, cfg.extra_msa_stack_config
    heads = cfg.auxiliary_heads_config
    top = {
        "left_single": _linear(ie.tf_dim, ie.c_z), "right_single": _linear(ie.tf_dim, ie.c_z),
        "preprocess_1d": _linear(ie.tf_dim, ie.c_m), "preprocess_msa": _linear(ie.msa_dim, ie.c_m),
        "pair_activiations": _linear(2 * ie.relpos_k + 1, ie.c_z),
        "prev_pos_linear": _linear(cfg.recycling_embedder_config.num_bins, ie.c_z),
        "prev_msa_first_row_norm": _norm(ie.c_m), "prev_pair_norm": _norm(ie.c_z),
        "extra_msa_activations": _linear(cfg.extra_msa_embedder_config.emsa_dim, ex.c_e),
        "single_activations": _linear(evo.c_m, evo.c_s),
    }  # fmt: skip
    out: Shapes = {}
    template_block = None
    if templates:
        template_modules, template_block = _template_embedding(cfg)
        top.update(template_modules)
    _flatten(top, PREFIX + "evoformer", out)
    if template_block is not None:
        stack = PREFIX + "evoformer/template_embedding/single_template_embedding/template_pair_stack/__layer_stack_no_state"
        _flatten(template_block, stack, out, stack=cfg.template_pair_stack_config.num_blocks)
    _flatten(_evoformer_iteration(ex, extra=True), PREFIX + "evoformer/extra_msa_stack", out, stack=ex.num_blocks)
    _flatten(_evoformer_iteration(evo, extra=False), PREFIX + "evoformer/evoformer_iteration", out, stack=evo.num_blocks)
    _flatten(_structure_module(cfg), PREFIX + "structure_module", out)
    lddt = heads.per_residue_lddt_ca_predictor_config
    head_tree = {
        "predicted_lddt_head": {"input_layer_norm": _norm(lddt.c_s), "act_0": _linear(lddt.c_s, lddt.c_hidden),
                                "act_1": _linear(lddt.c_hidden, lddt.c_hidden),
                                "logits": _linear(lddt.c_hidden, lddt.num_bins)},
        "distogram_head": {"half_logits": _linear(heads.distogram_head_config.c_z, heads.distogram_head_config.num_bins)},
        "masked_msa_head": {"logits": _linear(heads.masked_msa_head_config.c_m, heads.masked_msa_head_config.c_out)},
        "experimentally_resolved_head": {"logits": _linear(heads.experimentally_resolved_head_config.c_s,
                                                           heads.experimentally_resolved_head_config.c_out)},
    }  # fmt: skip
    if ptm:
        tm = heads.tm_score_head_config
        head_tree["predicted_aligned_error_head"] = {"logits": _linear(tm.c_z, tm.num_bins)}
    _flatten(head_tree, PREFIX.rstrip("/"), out)
    return out


STACKED_SCOPES = ("/extra_msa_stack/", "/evoformer_iteration/", "/__layer_stack_no_state/")


def _fan_in(key: str, shape: tuple[int, ...]) -> int:
    """Inputs per output of a weight array (0: not a weight); a stacked key's first axis is the block."""
    name = key.rsplit("//", 1)[1]
    shape = shape[1:] if any(scope in key for scope in STACKED_SCOPES) else shape
    if name == "output_w":
        return shape[0] * shape[1]  # [H, c_head, c_out]
    if name in ("weights", "feat_2d_weights", "query_w", "key_w", "value_w", "gating_w"):
        return shape[0]  # [c_in, ...]
    return 0


def af2_arrays(shapes: Mapping[str, tuple[int, ...]], seed: int = 0, values: str = "random") -> dict[str, np.ndarray]:
    """float32 arrays of ``shapes``: fixed-seed values (see the module docstring for ``values``)."""
    rng = np.random.default_rng(seed)
    if values == "unique":
        return _unique_arrays(shapes, rng)
    if values != "random":
        raise ValueError(f"values must be 'random' or 'unique', got {values!r}")
    arrays = {}
    for key, shape in shapes.items():
        name = key.rsplit("//", 1)[1]
        fan_in = _fan_in(key, shape)
        if fan_in:
            a = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))
        elif name == "scale":
            a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:  # biases, offsets, point weights
            a = 0.05 * rng.standard_normal(shape, dtype=np.float32)
        arrays[key] = a.astype(np.float32, copy=False)
    return arrays


def _unique_arrays(shapes: Mapping[str, tuple[int, ...]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    total = sum(int(np.prod(s)) for s in shapes.values())
    if total >= 2**24:
        raise ValueError(f"values='unique' needs fewer than 2**24 values, the file has {total:,}")
    scale = 2.0 ** int(np.ceil(np.log2(total)))
    codes = rng.permutation(total)
    arrays, start = {}, 0
    for key, shape in shapes.items():
        n = int(np.prod(shape))
        arrays[key] = ((codes[start : start + n] - total / 2) / scale).astype(np.float32).reshape(shape)
        start += n
    return arrays


def trace_index(arrays: Mapping[str, np.ndarray]) -> dict[float, tuple[str, tuple[int, ...]]]:
    """Value -> (key, index) for a ``values="unique"`` file: where every value sits in the file."""
    index: dict[float, tuple[str, tuple[int, ...]]] = {}
    for key, array in arrays.items():
        for flat, value in enumerate(array.reshape(-1).tolist()):
            index[value] = (key, tuple(int(i) for i in np.unravel_index(flat, array.shape)))
    if len(index) != sum(a.size for a in arrays.values()):
        raise ValueError("the values are not unique: write the file with values='unique'")
    return index


def af2_arrays_from_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: AlphaFoldConfig, templates: bool = True,
                               ptm: bool = False) -> dict[str, np.ndarray]:  # fmt: skip
    """A ScaleFold state dict written back in AlphaFold2's layout (the mapping run backwards), e.g. the demo's
    shipped weights as a demo-size AF2 file. Unlike the rest of this module this uses the import mapping, so
    a file written here shows the round trip, not the mapping's correctness (the tests' job)."""
    from scalefold.checkpoint import af2_mapping as mapping  # only here: the rest is independent of the mapping

    shapes = af2_shapes(cfg, templates=templates, ptm=ptm)
    entries, uncovered = mapping.expand(state_dict)
    if uncovered:
        raise ValueError(f"{len(uncovered)} parameters the mapping does not cover: {uncovered[:5]}")
    arrays = {key: np.zeros(shape, np.float32) for key, shape in shapes.items()}
    for entry in entries:
        tensor = state_dict[entry.target].detach().cpu().float().numpy()
        slot = arrays[entry.source][entry.block] if entry.block is not None else arrays[entry.source]
        flip = entry.transform in ("linear", "heads_in", "heads_out", "flat_out")
        slot[...] = (tensor.T if flip else tensor).reshape(slot.shape)
    return arrays


def write_af2_params(
    path: Union[str, os.PathLike], cfg: AlphaFoldConfig, templates: bool = True, ptm: bool = False,
    seed: int = 0, values: str = "random",
) -> dict[str, np.ndarray]:  # fmt: skip
    """Write an AlphaFold2-layout ``.npz`` of ``cfg``'s sizes (``np.savez``, as DeepMind's files are) and
    return its arrays."""
    arrays = af2_arrays(af2_shapes(cfg, templates=templates, ptm=ptm), seed=seed, values=values)
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)
    return arrays


__all__ = ["PREFIX", "af2_arrays", "af2_arrays_from_state_dict", "af2_shapes", "trace_index", "write_af2_params"]
