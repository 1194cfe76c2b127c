"""Checks of an AlphaFold2 import that do not use the mapping table: the tests' own knowledge of AF2's layout.

* :func:`trace_problems` -- every imported value traced back (``values="unique"`` file) to its source key
  and index; the index must follow the rule of the haiku parameter's *kind* (read here from its name and
  rank, not from the table's transform), and the block index of a stacked key must be the block number
  in the ScaleFold name; every value of the file must be used exactly once.
* :func:`module_problems` -- ScaleFold modules holding the imported weights against numpy
  re-implementations of AlphaFold's haiku modules (``modules.py``) computed from the file's arrays:
  MSA row attention with pair bias, global column attention, both triangle multiplications, the outer
  product mean. A swapped pair of same-shaped projections changes these outputs.
"""

from __future__ import annotations

import re

import numpy as np
import torch

P = "alphafold/alphafold_iteration/"
STACKED = ("/extra_msa_stack/", "/evoformer_iteration/", "/__layer_stack_no_state/")


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------


def expected_kind(key: str, rank: int) -> str:
    """The layout change a haiku parameter needs, from its name and (unstacked) rank alone."""
    scope, name = key.rsplit("//", 1)
    if name in ("bias", "scale", "offset", "output_b", "trainable_point_weights"):
        return "copy"
    if name in ("weights", "feat_2d_weights"):
        return "linear"
    if name in ("query_w", "key_w", "value_w", "gating_w"):
        return "heads_in" if rank == 3 else "linear"  # global attention: one shared key/value projection
    if name == "gating_b":
        return "heads_bias"
    if name == "output_w":
        return "flat_out"  # [heads, c_head, out] and the outer product's [c, c, out] alike
    raise AssertionError(f"unknown haiku parameter {key}")


def expected_source_index(kind: str, target_index: tuple[int, ...], source_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Where the ScaleFold element at ``target_index`` sits in the (unstacked) haiku array."""
    if kind == "copy":
        return target_index
    if kind == "linear":
        out, inp = target_index
        return (inp, out)
    if kind == "heads_in":  # [c_in, H, c] -> row h*c + k
        row, inp = target_index
        c = source_shape[2]
        return (inp, row // c, row % c)
    if kind == "heads_bias":
        (row,) = target_index
        c = source_shape[1]
        return (row // c, row % c)
    if kind == "flat_out":  # [a, b, out] -> column a*b_size + b
        out, col = target_index
        b = source_shape[1]
        return (col // b, col % b, out)
    raise AssertionError(kind)


def _block_of(target: str) -> int | None:
    match = re.search(r"\.(?:blocks|layers)\.(\d+)\.", target)
    return int(match.group(1)) if match else None


def trace_problems(state_dict, arrays, trace) -> list[str]:
    """Every element of every imported tensor against the rule of its source's kind (empty: all right)."""
    problems: list[str] = []
    used: set[tuple[str, tuple[int, ...]]] = set()
    for target, tensor in state_dict.items():
        values = tensor.detach().numpy().reshape(-1).tolist()
        first = trace.get(values[0])
        if first is None:
            problems.append(f"{target}: value not in the file")
            continue
        key = first[0]
        stacked = any(s in key for s in STACKED)
        shape = arrays[key].shape[1:] if stacked else arrays[key].shape
        kind = expected_kind(key, len(shape))
        block = _block_of(target)
        for flat, value in enumerate(values):
            where = trace.get(value)
            if where is None or where[0] != key:
                problems.append(f"{target}: element {flat} from {where}, the rest from {key}")
                break
            idx = where[1]
            if stacked:
                if idx[0] != block:
                    problems.append(f"{target}: from block {idx[0]} of {key}")
                    break
                idx = idx[1:]
            elif "angle_resnet.layers." in target and not re.search(
                    r"resblock[12]" + (f"_{block}" if block else "") + "$", key.split("//")[0]):  # fmt: skip
                problems.append(f"{target}: from {key}, which is haiku's side-chain layer of another index")
                break
            t_idx = tuple(int(i) for i in np.unravel_index(flat, tensor.shape))
            if idx != expected_source_index(kind, t_idx, shape):
                problems.append(f"{target}{list(t_idx)} comes from {key}{list(where[1])}: not the {kind} rule")
                break
            used.add(where)
    total = sum(a.size for a in arrays.values())
    if not problems and len(used) != total:
        problems.append(f"{total - len(used)} values of the file unused or used twice")
    return problems


# --------------------------------------------------------------------------------------------
# AlphaFold's modules in numpy (float64), from the haiku arrays
# --------------------------------------------------------------------------------------------


def _p(arrays, key: str, block: int | None) -> np.ndarray:
    a = arrays[P + key].astype(np.float64)
    return a[block] if block is not None else a


def _ln(x, arrays, scope, block):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * _p(arrays, scope + "//scale", block) + _p(arrays, scope + "//offset", block)


def _lin(x, arrays, scope, block):
    return x @ _p(arrays, scope + "//weights", block) + _p(arrays, scope + "//bias", block)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def af2_attention(q_data, m_data, bias, arrays, scope, block):
    """modules.py ``Attention`` (gated): batch b, queries q, keys k."""
    w = lambda n: _p(arrays, f"{scope}//{n}", block)  # noqa: E731
    c = w("query_w").shape[-1]
    q = np.einsum("bqa,ahc->bqhc", q_data, w("query_w")) * c**-0.5
    k = np.einsum("bka,ahc->bkhc", m_data, w("key_w"))
    v = np.einsum("bka,ahc->bkhc", m_data, w("value_w"))
    weights = _softmax(np.einsum("bqhc,bkhc->bhqk", q, k) + bias)
    out = np.einsum("bhqk,bkhc->bqhc", weights, v)
    out = out * _sigmoid(np.einsum("bqc,chv->bqhv", q_data, w("gating_w")) + w("gating_b"))
    return np.einsum("bqhc,hco->bqo", out, w("output_w")) + w("output_b")


def af2_msa_row_attention(msa, pair, arrays, block):
    scope = "evoformer/evoformer_iteration/msa_row_attention_with_pair_bias"
    m = _ln(msa, arrays, scope + "/query_norm", block)
    z = _ln(pair, arrays, scope + "/feat_2d_norm", block)
    bias = np.einsum("qkc,ch->hqk", z, _p(arrays, scope + "//feat_2d_weights", block))[None]
    return af2_attention(m, m, bias, arrays, scope + "/attention", block)


def af2_global_column_attention(msa, arrays, block):
    scope = "evoformer/extra_msa_stack/msa_column_global_attention"
    x = np.swapaxes(_ln(msa, arrays, scope + "/query_norm", block), 0, 1)  # [N_res, N_seq, c]
    w = lambda n: _p(arrays, f"{scope}/attention//{n}", block)  # noqa: E731
    c = w("key_w").shape[-1]
    q = np.einsum("ba,ahc->bhc", x.mean(1), w("query_w")) * c**-0.5
    k = np.einsum("bka,ac->bkc", x, w("key_w"))
    v = np.einsum("bka,ac->bkc", x, w("value_w"))
    out = np.einsum("bhk,bkc->bhc", _softmax(np.einsum("bhc,bkc->bhk", q, k)), v)
    out = out[:, None] * _sigmoid(np.einsum("bqc,chv->bqhv", x, w("gating_w")) + w("gating_b"))
    return np.swapaxes(np.einsum("bqhc,hco->bqo", out, w("output_w")) + w("output_b"), 0, 1)


def af2_triangle_multiplication(pair, arrays, block, outgoing):
    scope = "evoformer/evoformer_iteration/triangle_multiplication_" + ("outgoing" if outgoing else "incoming")
    x = _ln(pair, arrays, scope + "/layer_norm_input", block)
    left = _lin(x, arrays, scope + "/left_projection", block) * _sigmoid(_lin(x, arrays, scope + "/left_gate", block))
    right = _lin(x, arrays, scope + "/right_projection", block) * _sigmoid(_lin(x, arrays, scope + "/right_gate", block))
    act = np.einsum("ikc,jkc->ijc" if outgoing else "kjc,kic->ijc", left, right)
    act = _lin(_ln(act, arrays, scope + "/center_layer_norm", block), arrays, scope + "/output_projection", block)
    return act * _sigmoid(_lin(x, arrays, scope + "/gating_linear", block))


def af2_outer_product_mean(msa, arrays, block):
    scope = "evoformer/evoformer_iteration/outer_product_mean"
    x = _ln(msa, arrays, scope + "/layer_norm_input", block)
    left, right = _lin(x, arrays, scope + "/left_projection", block), _lin(x, arrays, scope + "/right_projection", block)
    act = np.einsum("sic,sje,cef->ijf", left, right, _p(arrays, scope + "//output_w", block))
    act = act + _p(arrays, scope + "//output_b", block)
    return act / (1e-3 + msa.shape[0])


def module_problems(model, arrays, seed: int = 0, tol: float = 1e-7) -> list[str]:
    """ScaleFold's modules (``model`` holding the imported weights, float64) against AF2's, on random inputs
    (agreement ~1e-9 relative at most; a wrong weight gives O(1))."""
    rng = np.random.default_rng(seed)
    evo, extra = model.evoformer_stack.blocks, model.extra_msa_stack.blocks
    c_m, c_z = evo[0].msa_att_row.layer_norm_m.weight.shape[0], evo[0].msa_att_row.layer_norm_z.weight.shape[0]
    c_e = extra[0].msa_att_col.layer_norm_m.weight.shape[0]
    n_seq, n_res = 5, 7
    msa, pair = rng.standard_normal((n_seq, n_res, c_m)), rng.standard_normal((n_res, n_res, c_z))
    extra_msa = rng.standard_normal((n_seq, n_res, c_e))
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    ones_msa, ones_pair = torch.ones(n_seq, n_res, dtype=torch.float64), torch.ones(n_res, n_res, dtype=torch.float64)
    problems = []
    with torch.no_grad():
        for b in range(len(evo)):
            core = evo[b].core
            cases = {
                f"msa_row_attention block {b}": (evo[b].msa_att_row(t(msa), t(pair), ones_msa),
                                                 af2_msa_row_attention(msa, pair, arrays, b)),
                f"triangle_multiplication_outgoing block {b}": (core.tri_mul_out(t(pair), ones_pair),
                                                                af2_triangle_multiplication(pair, arrays, b, True)),
                f"triangle_multiplication_incoming block {b}": (core.tri_mul_in(t(pair), ones_pair),
                                                                af2_triangle_multiplication(pair, arrays, b, False)),
                f"outer_product_mean block {b}": (core.outer_product_mean(t(msa), ones_msa),
                                                  af2_outer_product_mean(msa, arrays, b)),
            }  # fmt: skip
            if b < len(extra):
                cases[f"msa_column_global_attention extra block {b}"] = (
                    extra[b].msa_att_col(t(extra_msa), ones_msa), af2_global_column_attention(extra_msa, arrays, b))
            for name, (ours, theirs) in cases.items():
                err = float(np.abs(ours.numpy() - theirs).max() / max(np.abs(theirs).max(), 1e-30))
                if not err < tol:
                    problems.append(f"{name}: relative difference {err:.2e}")
    return problems
