"""Analytic communication volume of one DAP Evoformer block (per rank: S(d-1)/d^2 per all-to-all of a tensor of S elements over d ranks).

Per block and rank, forward: 6 all_to_all (MSA rows->cols, MSA cols->rows, then z four times) and
6 all_gather (MSA row-attention pair bias, outer-product-mean right projection, tri-mul outgoing
``b`` / incoming ``a``, triangle-attention biases around the starting / ending node). A rank sends
``(d-1)/d`` of its local tensor in an all_to_all and its local chunk ``d-1`` times in an
all_gather, i.e. ``S(d-1)/d^2`` and ``S(d-1)/d`` of a whole tensor of ``S`` bytes. The backward
pass moves the same volume (reverse all_to_all; the reduce-scatter of a "sum" gather).

Sizes not divisible by ``d`` are padded on the sharded axis only (``scalefold.distributed.axial``),
which is what :func:`evoformer_block_bytes` counts.
"""

from __future__ import annotations


def _pad(n: int, d: int) -> int:
    return -(-n // d) * d


def evoformer_block_bytes(
    n_seq: int,
    n_res: int,
    d: int,
    *,
    c_m: int,
    c_z: int,
    num_heads_msa: int,
    c_hidden_opm: int,
    c_hidden_tri_mul: int,
    num_heads_tri: int,
    itemsize: int,
    batch: int = 1,
) -> dict[str, int]:
    """Bytes one rank sends in the forward pass of one (monomer-order) Evoformer block."""
    if d == 1:
        return {"all_to_all": 0, "all_gather": 0}
    s_, r_ = _pad(n_seq, d), _pad(n_res, d)
    k = batch * itemsize
    a2a = (
        s_ // d * r_ * c_m  # m rows -> cols (columns padded)
        + s_ * r_ // d * c_m  # m cols -> rows (rows padded)
        + 4 * (r_ // d * r_ * c_z)  # z: 2 x rows -> cols, 2 x cols -> rows
    ) * (d - 1) // d
    gather = (
        r_ // d * n_res * num_heads_msa  # pair bias of MSA row attention, gathered over i
        + n_seq * r_ // d * c_hidden_opm  # outer product mean right projection, over r
        + 2 * (r_ // d * n_res * c_hidden_tri_mul)  # tri-mul b (outgoing) and a (incoming)
        + 2 * (r_ // d * n_res * num_heads_tri)  # triangle attention biases
    ) * (d - 1)
    return {"all_to_all": a2a * k, "all_gather": gather * k}


__all__ = ["evoformer_block_bytes"]
