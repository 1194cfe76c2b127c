"""AlphaFold2's released JAX (haiku) parameters -> ScaleFold parameters: the mapping, written once, as data.

AlphaFold2 stores its parameters in an ``.npz`` whose keys are ``<haiku module path>//<parameter>``, all
under ``alphafold/alphafold_iteration/`` (left out below). Its linear layers store weights input-first
``[c_in, c_out]``; attention projections as ``[c_in, heads, c_head]`` (output ``[heads, c_head, c_out]``,
gating bias ``[heads, c_head]``); the blocks of a stack (Evoformer, extra-MSA stack, template pair stack) are
stacked on a leading axis. ScaleFold's model (the MLPerf reference, OpenFold's layout) stores
``torch.nn.Linear`` weights ``[c_out, c_in]`` with heads flattened head-major, one tensor per block.

Each row of the tables below is one ScaleFold parameter: ``(ScaleFold name, haiku path//name, transform)``;
``{i}`` in both names is a block index (the haiku array's index ``i`` on axis 0). :data:`TRANSFORMS` lists
the transforms; :func:`expand` turns the rows into one :class:`Entry` per parameter of a given model,
and ``scalefold import-weights --mapping`` prints them all (the table a reader checks line by line).

The differences the rows encode, besides the layouts:

* the incoming triangle multiplication: AlphaFold computes ``sum_k left_kj right_ki``, so its
  ``left_*`` are ScaleFold's ``b`` projections and its ``right_*`` the ``a`` ones (outgoing: as named);
* the structure module's side-chain ResNet: ``input_projection`` reads the current single representation
  (``linear_in``), ``input_projection_1`` the initial one (``linear_initial``); haiku numbers the repeated
  layers ``resblock1``, ``resblock1_1``, ...; the three transition layers are ``transition``,
  ``transition_1``, ``transition_2``;
* the fused projections are fused the same way in both (IPA's ``kv_scalar`` ``[H, k|v]`` and point
  projections ``[x|y|z]``; the outer product's ``[c, c]`` flattening, left channel major), so no
  monomer parameter needs a split or a concatenation; AlphaFold-Multimer's fused triangle projections
  (``projection``/``gate``) would, and multimer files are refused (:mod:`scalefold.checkpoint.af2_import`).

Optional groups: ``templates`` (absent from ``model_3`` ... ``model_5``) and ``pae_head`` (the ``_ptm``
files' predicted-aligned-error head, ScaleFold's TM head).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

#: Every key of an AlphaFold2 monomer parameter file starts with this.
AF2_PREFIX = "alphafold/alphafold_iteration/"


# --------------------------------------------------------------------------------------------
# Transforms: haiku array (one block's slice for a stacked row) -> ScaleFold tensor
# --------------------------------------------------------------------------------------------


def _copy(w: np.ndarray) -> np.ndarray:
    return w


def _linear(w: np.ndarray) -> np.ndarray:
    return w.T  # [c_in, c_out] -> [c_out, c_in]


def _heads_in(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], -1).T  # [c_in, H, c] -> [H*c, c_in]


def _heads_bias(w: np.ndarray) -> np.ndarray:
    return w.reshape(-1)  # [H, c] -> [H*c]


def _flat_out(w: np.ndarray) -> np.ndarray:
    return w.reshape(-1, w.shape[-1]).T  # [a, b, c_out] -> [c_out, a*b] (a major)


@dataclass(frozen=True)
class Transform:
    """One kind of layout change: the function, the shape it gives (from the haiku shape alone), and the
    layouts it reads and writes (for messages)."""

    fn: Callable[[np.ndarray], np.ndarray]
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    source_layout: str
    target_layout: str

    @property
    def ndim(self) -> int:
        return self.source_layout.count(",") + 1


TRANSFORMS: dict[str, Transform] = {
    # biases, LayerNorm scale/offset, IPA point weights
    "copy": Transform(_copy, lambda s: tuple(s), "[n]", "[n]"),
    "linear": Transform(_linear, lambda s: (s[1], s[0]), "[c_in, c_out]", "[c_out, c_in]"),
    "heads_in": Transform(_heads_in, lambda s: (s[1] * s[2], s[0]), "[c_in, heads, c_head]", "[heads*c_head, c_in]"),
    "heads_bias": Transform(_heads_bias, lambda s: (s[0] * s[1],), "[heads, c_head]", "[heads*c_head]"),
    "heads_out": Transform(_flat_out, lambda s: (s[2], s[0] * s[1]), "[heads, c_head, c_out]", "[c_out, heads*c_head]"),
    "flat_out": Transform(_flat_out, lambda s: (s[2], s[0] * s[1]), "[c_left, c_right, c_out]",
                          "[c_out, c_left*c_right]"),  # fmt: skip
}


# --------------------------------------------------------------------------------------------
# The rows. Building blocks first (a linear layer, a LayerNorm, an attention), then the model.
# --------------------------------------------------------------------------------------------

Row = tuple[str, str, str]  # (ScaleFold name, haiku "path//name" under AF2_PREFIX, transform)


def linear(sf: str, hk: str, bias: bool = True) -> list[Row]:
    """A linear layer: haiku ``weights`` [in, out] / ``bias``."""
    return [(f"{sf}.weight", f"{hk}//weights", "linear")] + ([(f"{sf}.bias", f"{hk}//bias", "copy")] if bias else [])


def layer_norm(sf: str, hk: str) -> list[Row]:
    """A LayerNorm: haiku ``scale`` / ``offset``."""
    return [(f"{sf}.weight", f"{hk}//scale", "copy"), (f"{sf}.bias", f"{hk}//offset", "copy")]


def attention(sf: str, hk: str, gated: bool = True) -> list[Row]:
    """AlphaFold's ``Attention``: q/k/v ``[c, H, c_head]`` (no biases), output ``[H, c_head, c]`` + bias, and
    (gated) the sigmoid gate ``[c, H, c_head]`` + ``[H, c_head]``."""
    rows = [
        (f"{sf}.linear_q.weight", f"{hk}//query_w", "heads_in"),
        (f"{sf}.linear_k.weight", f"{hk}//key_w", "heads_in"),
        (f"{sf}.linear_v.weight", f"{hk}//value_w", "heads_in"),
        (f"{sf}.linear_o.weight", f"{hk}//output_w", "heads_out"),
        (f"{sf}.linear_o.bias", f"{hk}//output_b", "copy"),
    ]
    if gated:
        rows += [
            (f"{sf}.linear_g.weight", f"{hk}//gating_w", "heads_in"),
            (f"{sf}.linear_g.bias", f"{hk}//gating_b", "heads_bias"),
        ]
    return rows


def global_attention(sf: str, hk: str) -> list[Row]:
    """AlphaFold's ``GlobalAttention``: per-head queries, one shared key and value ``[c, c_head]``."""
    return [
        (f"{sf}.linear_q.weight", f"{hk}//query_w", "heads_in"),
        (f"{sf}.linear_k.weight", f"{hk}//key_w", "linear"),
        (f"{sf}.linear_v.weight", f"{hk}//value_w", "linear"),
        (f"{sf}.linear_g.weight", f"{hk}//gating_w", "heads_in"),
        (f"{sf}.linear_g.bias", f"{hk}//gating_b", "heads_bias"),
        (f"{sf}.linear_o.weight", f"{hk}//output_w", "heads_out"),
        (f"{sf}.linear_o.bias", f"{hk}//output_b", "copy"),
    ]


def transition(sf: str, hk: str) -> list[Row]:
    """MSA / pair transition."""
    return layer_norm(f"{sf}.layer_norm", f"{hk}/input_layer_norm") + linear(f"{sf}.linear_1", f"{hk}/transition1") \
        + linear(f"{sf}.linear_2", f"{hk}/transition2")  # fmt: skip


def triangle_multiplication(sf: str, hk: str, outgoing: bool) -> list[Row]:
    """Triangle multiplication; incoming: AlphaFold's left projection/gate are ScaleFold's ``b``."""
    left, right = ("a", "b") if outgoing else ("b", "a")
    return (
        layer_norm(f"{sf}.layer_norm_in", f"{hk}/layer_norm_input")
        + linear(f"{sf}.linear_{left}_p", f"{hk}/left_projection")
        + linear(f"{sf}.linear_{right}_p", f"{hk}/right_projection")
        + linear(f"{sf}.linear_{left}_g", f"{hk}/left_gate")
        + linear(f"{sf}.linear_{right}_g", f"{hk}/right_gate")
        + layer_norm(f"{sf}.layer_norm_out", f"{hk}/center_layer_norm")
        + linear(f"{sf}.linear_z", f"{hk}/output_projection")
        + linear(f"{sf}.linear_g", f"{hk}/gating_linear")
    )


def triangle_attention(sf: str, hk: str) -> list[Row]:
    """Triangle attention around the starting / ending node."""
    return layer_norm(f"{sf}.layer_norm", f"{hk}/query_norm") + [(f"{sf}.linear.weight", f"{hk}//feat_2d_weights",
                                                                  "linear")] + attention(f"{sf}.mha", f"{hk}/attention")  # fmt: skip


def pair_core(sf: str, hk: str) -> list[Row]:
    """The pair updates shared by the Evoformer, extra-MSA and template pair blocks (ScaleFold's order)."""
    return (
        triangle_multiplication(f"{sf}tri_mul_out", f"{hk}triangle_multiplication_outgoing", outgoing=True)
        + triangle_multiplication(f"{sf}tri_mul_in", f"{hk}triangle_multiplication_incoming", outgoing=False)
        + triangle_attention(f"{sf}tri_att_start", f"{hk}triangle_attention_starting_node")
        + triangle_attention(f"{sf}tri_att_end", f"{hk}triangle_attention_ending_node")
        + transition(f"{sf}pair_transition", f"{hk}pair_transition")
    )


def msa_block(sf: str, hk: str, extra: bool) -> list[Row]:
    """An Evoformer block (``extra``: an extra-MSA block, whose column attention is global)."""
    row, col = f"{sf}msa_att_row", f"{sf}msa_att_col"
    rows = (
        layer_norm(f"{row}.layer_norm_m", f"{hk}msa_row_attention_with_pair_bias/query_norm")
        + layer_norm(f"{row}.layer_norm_z", f"{hk}msa_row_attention_with_pair_bias/feat_2d_norm")
        + [(f"{row}.linear_z.weight", f"{hk}msa_row_attention_with_pair_bias//feat_2d_weights", "linear")]
        + attention(f"{row}.mha", f"{hk}msa_row_attention_with_pair_bias/attention")
    )
    if extra:
        rows += layer_norm(f"{col}.layer_norm_m", f"{hk}msa_column_global_attention/query_norm")
        rows += global_attention(f"{col}.global_attention", f"{hk}msa_column_global_attention/attention")
    else:
        rows += layer_norm(f"{col}.layer_norm_m", f"{hk}msa_column_attention/query_norm")
        rows += attention(f"{col}.mha", f"{hk}msa_column_attention/attention")
    opm = f"{hk}outer_product_mean"
    return (
        rows
        + transition(f"{sf}core.msa_transition", f"{hk}msa_transition")
        + layer_norm(f"{sf}core.outer_product_mean.layer_norm", f"{opm}/layer_norm_input")
        + linear(f"{sf}core.outer_product_mean.linear_1", f"{opm}/left_projection")
        + linear(f"{sf}core.outer_product_mean.linear_2", f"{opm}/right_projection")
        + [(f"{sf}core.outer_product_mean.linear_out.weight", f"{opm}//output_w", "flat_out"),
           (f"{sf}core.outer_product_mean.linear_out.bias", f"{opm}//output_b", "copy")]
        + pair_core(f"{sf}core.", hk)
    )  # fmt: skip


EVO = "evoformer/"
TEMPLATE = "evoformer/template_embedding/"
TEMPLATE_STACK = TEMPLATE + "single_template_embedding/template_pair_stack/__layer_stack_no_state/"
FOLD = "structure_module/fold_iteration/"
SIDECHAIN = FOLD + "rigid_sidechain/"

#: group -> rows. ``core`` is every model; ``templates`` the template embedding; ``pae_head`` the ``_ptm`` head.
ROWS: dict[str, list[Row]] = {
    "core": (
        linear("input_embedder.linear_tf_z_i", EVO + "left_single")
        + linear("input_embedder.linear_tf_z_j", EVO + "right_single")
        + linear("input_embedder.linear_tf_m", EVO + "preprocess_1d")
        + linear("input_embedder.linear_msa_m", EVO + "preprocess_msa")
        + linear("input_embedder.linear_relpos", EVO + "pair_activiations")  # sic: AlphaFold's spelling
        + linear("recycling_embedder.linear", EVO + "prev_pos_linear")
        + layer_norm("recycling_embedder.layer_norm_m", EVO + "prev_msa_first_row_norm")
        + layer_norm("recycling_embedder.layer_norm_z", EVO + "prev_pair_norm")
        + linear("extra_msa_embedder.linear", EVO + "extra_msa_activations")
        + msa_block("extra_msa_stack.blocks.{i}.", EVO + "extra_msa_stack/", extra=True)
        + msa_block("evoformer_stack.blocks.{i}.", EVO + "evoformer_iteration/", extra=False)
        + linear("evoformer_stack.linear", EVO + "single_activations")
        + layer_norm("structure_module.layer_norm_s", "structure_module/single_layer_norm")
        + layer_norm("structure_module.layer_norm_z", "structure_module/pair_layer_norm")
        + linear("structure_module.linear_in", "structure_module/initial_projection")
        + [("structure_module.ipa.head_weights", FOLD + "invariant_point_attention//trainable_point_weights", "copy")]
        + linear("structure_module.ipa.linear_q", FOLD + "invariant_point_attention/q_scalar")
        + linear("structure_module.ipa.linear_kv", FOLD + "invariant_point_attention/kv_scalar")
        + linear("structure_module.ipa.linear_q_points", FOLD + "invariant_point_attention/q_point_local")
        + linear("structure_module.ipa.linear_kv_points", FOLD + "invariant_point_attention/kv_point_local")
        + linear("structure_module.ipa.linear_b", FOLD + "invariant_point_attention/attention_2d")
        + linear("structure_module.ipa.linear_out", FOLD + "invariant_point_attention/output_projection")
        + layer_norm("structure_module.layer_norm_ipa", FOLD + "attention_layer_norm")
        + linear("structure_module.transition.linear_1", FOLD + "transition")
        + linear("structure_module.transition.linear_2", FOLD + "transition_1")
        + linear("structure_module.transition.linear_3", FOLD + "transition_2")
        + layer_norm("structure_module.transition.layer_norm", FOLD + "transition_layer_norm")
        + linear("structure_module.bb_update.linear", FOLD + "affine_update")
        + linear("structure_module.angle_resnet.linear_in", SIDECHAIN + "input_projection")
        + linear("structure_module.angle_resnet.linear_initial", SIDECHAIN + "input_projection_1")
        + linear("structure_module.angle_resnet.layers.{i}.linear_1", SIDECHAIN + "resblock1{_i}")
        + linear("structure_module.angle_resnet.layers.{i}.linear_2", SIDECHAIN + "resblock2{_i}")
        + linear("structure_module.angle_resnet.linear_out", SIDECHAIN + "unnormalized_angles")
        + layer_norm("auxiliary_heads.plddt.layer_norm", "predicted_lddt_head/input_layer_norm")
        + linear("auxiliary_heads.plddt.linear_1", "predicted_lddt_head/act_0")
        + linear("auxiliary_heads.plddt.linear_2", "predicted_lddt_head/act_1")
        + linear("auxiliary_heads.plddt.linear_3", "predicted_lddt_head/logits")
        + linear("auxiliary_heads.distogram.linear", "distogram_head/half_logits")
        + linear("auxiliary_heads.masked_msa.linear", "masked_msa_head/logits")
        + linear("auxiliary_heads.experimentally_resolved.linear", "experimentally_resolved_head/logits")
    ),
    "templates": (
        linear("template_angle_embedder.linear_1", EVO + "template_single_embedding")
        + linear("template_angle_embedder.linear_2", EVO + "template_projection")
        + linear("template_pair_embedder.linear", TEMPLATE + "single_template_embedding/embedding2d")
        + pair_core("template_pair_stack.blocks.{i}.", TEMPLATE_STACK)
        + layer_norm("template_pair_stack.layer_norm", TEMPLATE + "single_template_embedding/output_layer_norm")
        + attention("template_pointwise_attention.mha", TEMPLATE + "attention", gated=False)
    ),
    "pae_head": linear("auxiliary_heads.tm.linear", "predicted_aligned_error_head/logits"),
}

#: The ScaleFold name prefix that marks each optional group's parameters in a model.
GROUP_MARKERS = {"templates": "template_", "pae_head": "auxiliary_heads.tm."}


# --------------------------------------------------------------------------------------------
# Expansion: rows -> one entry per parameter of a model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One ScaleFold parameter: where it comes from in the AlphaFold2 file and how.

    ``block``: the index on the haiku array's axis 0 (stacked rows), else ``None``; the haiku side of a
    repeated but unstacked layer (the side-chain ResNet's ``resblock1_1``) is spelled out in ``source``.
    """

    target: str
    source: str  # full npz key
    transform: str
    block: int | None
    group: str

    def describe(self) -> str:
        where = f"[{self.block}]" if self.block is not None else ""
        return f"{self.target}\t{self.source}{where}\t{self.transform}"


def _row_pattern(target: str) -> re.Pattern[str]:
    return re.compile("^" + r"(\d+)".join(re.escape(part) for part in target.split("{i}")) + "$")


def expand(target_names: Iterable[str], groups: Iterable[str] | None = None) -> tuple[list[Entry], list[str]]:
    """One :class:`Entry` per name of ``target_names`` that a row of ``groups`` (default: all) covers, in the
    names' order, and the names no row covers. A name two rows cover raises ``ValueError`` (a table error)."""
    chosen = list(ROWS) if groups is None else list(groups)
    compiled = [(_row_pattern(t), s, tf, g) for g in chosen for (t, s, tf) in ROWS[g]]
    entries: list[Entry] = []
    uncovered: list[str] = []
    for name in target_names:
        hits = [(m, s, tf, g) for pattern, s, tf, g in compiled if (m := pattern.match(name))]
        if not hits:
            uncovered.append(name)
            continue
        if len(hits) > 1:
            raise ValueError(f"mapping table error: {name} is covered by {len(hits)} rows")
        match, source, transform, group = hits[0]
        entries.append(_entry(name, match, source, transform, group))
    return entries, uncovered


def _entry(name: str, match: re.Match[str], source: str, transform: str, group: str) -> Entry:
    block = int(match.group(1)) if match.groups() else None
    if "{_i}" in source:  # haiku's numbering of a layer repeated in one module: name, name_1, name_2, ...
        return Entry(name, AF2_PREFIX + source.replace("{_i}", f"_{block}" if block else ""), transform, None, group)
    return Entry(name, AF2_PREFIX + source, transform, block, group)


def source_keys(entries: Iterable[Entry]) -> dict[str, list[Entry]]:
    """Haiku key -> the entries reading it (a stacked key: one per block, in block order)."""
    keys: dict[str, list[Entry]] = {}
    for entry in entries:
        keys.setdefault(entry.source, []).append(entry)
    return keys


def convert(entry: Entry, source: np.ndarray) -> np.ndarray:
    """The ScaleFold tensor of ``entry`` from its haiku array (the whole stacked array for a stacked entry)."""
    array = source[entry.block] if entry.block is not None else source
    if array.ndim != TRANSFORMS[entry.transform].ndim:
        raise ValueError(f"rank {array.ndim}, expected {TRANSFORMS[entry.transform].source_layout}")
    return np.ascontiguousarray(TRANSFORMS[entry.transform].fn(array))


def converted_shape(entry: Entry, source_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape ``entry``'s transform gives from a haiku array of ``source_shape`` (``None``: wrong rank)."""
    shape = tuple(source_shape[1:]) if entry.block is not None else tuple(source_shape)
    transform = TRANSFORMS[entry.transform]
    return transform.shape(shape) if len(shape) == transform.ndim else None


def coverage(entries: Iterable[Entry], shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, dict[str, int]]:
    """Per transform kind (and ``stacked`` for the per-block slices): parameters and values counted."""
    counts: dict[str, dict[str, int]] = {}
    for entry in entries:
        numel = int(np.prod(shapes[entry.target])) if shapes is not None else 0
        for kind in (entry.transform,) + (("stacked",) if entry.block is not None else ()):
            slot = counts.setdefault(kind, {"parameters": 0, "values": 0})
            slot["parameters"] += 1
            slot["values"] += numel
    return counts


__all__ = [
    "AF2_PREFIX", "Entry", "GROUP_MARKERS", "ROWS", "TRANSFORMS", "Transform", "convert", "converted_shape", "coverage",
    "expand",
    "source_keys",
]  # fmt: skip
