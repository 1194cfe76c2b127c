"""What a training step sends between ranks, per rank, and how long that takes on a cluster's links.

Three kinds of traffic (``scalefold estimate-step --dap D --dp N``, ``scalefold plan``):

* **DAP** (:func:`dap_collectives`): the collectives of the model's DAP switches
  (:mod:`scalefold.distributed.axial`), counted from the model's shapes as the code issues them, per stack
  (template pair, extra MSA, Evoformer) and phase. Per MSA block (extra MSA and Evoformer), forward: 6
  all-to-alls -- the MSA rows -> columns after the row attention and back after the outer product mean
  (overlapped with the pair stack), the pair four times between the triangle updates -- and 6 all-gathers
  (the row attention's pair bias, the outer product mean's right projection, the triangle
  multiplications' ``b`` outgoing and ``a`` incoming, both overlapped, the two triangle attentions' biases);
  per template pair block 4 all-to-alls and 4 all-gathers (no MSA). Each stack scatters its inputs on entry
  (no traffic forward, an all-gather of the gradient in backward) and all-gathers its outputs on exit
  (``split`` backward: none). Backward reverses every all-to-all (except the last extra-MSA block's MSA
  switch, whose output no one reads) and reduce-scatters every gathered tensor's gradient; a block that
  recomputes its activations in backward issues its forward collectives once more (but for its last
  all-to-all and the overlapped MSA switch: :func:`recomputed`); a no-grad recycling pass issues the forward
  ones. A rank sends ``(d-1)/d`` of its local tensor in an all-to-all and its chunk
  ``d-1`` times in an all-gather or reduce-scatter (the logical volume
  :class:`~scalefold.distributed.group.CommStats` counts; sizes padded on the sharded axis as the code pads).
  ``tests/perf/test_comm.py`` checks the count against the collectives the real code issues in the fake step
  (:func:`observe_collectives`) on small presets at DAP 2 and 4.
* **BP** (:func:`bp_collectives`): per Parallel Evoformer block, forward, each branch's output broadcast
  to the peer (:mod:`scalefold.distributed.branch_parallel`); backward, one all-reduce of both inputs'
  gradients over the pair.
* **Gradient all-reduce** (:func:`grad_allreduce`): the data-parallel mean over every training rank (DDP over
  the training group, ``scalefold.train.trainer``), of the model's gradients in their own dtype (fp32: the
  master weights are fp32 under bf16 autocast, so ScaleFold reduces 4 bytes per parameter; NVIDIA's
  ScaleFold reduces bf16, 2), in DDP's 25 MB buckets. Per rank a ring moves ``2(N-1)/N`` of it; the time is
  NCCL's hierarchical shape on a cluster: reduce-scatter and all-gather inside the node over its NVLink
  (``2(g-1)/g`` of the buffer), and between nodes each GPU's port carries ``1/g`` of it in a ring
  (``2(n-1)/n``, ``2(n-1)`` network steps) or a tree (the same bandwidth term, ``2 log2 n`` steps), the
  faster of the two.

**Time** (:func:`comm_seconds`): each collective costs its link's latency plus its bytes over the link's
effective bandwidth (:mod:`scalefold.perf.cluster`); ``exposed_s`` leaves out what the code overlaps with
compute (DAP's overlapped switches and gathers; the gradient all-reduce of an eager DDP step runs under
backward except its last bucket, a graphed step reduces after backward: all of it exposed).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from scalefold.perf.cluster import Card, Link

#: DDP's default bucket size (``bucket_cap_mb=25``), the unit of the gradient all-reduce's launches.
DDP_BUCKET_BYTES = 25 * 2**20
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8}
STACKS = ("template_pair_stack", "extra_msa_stack", "evoformer_stack")
PHASES = ("recycling", "forward", "backward")


@dataclass(frozen=True)
class BlockDims:
    """The sizes of one stack's blocks that DAP's collectives carry."""

    c_msa: int  # c_m / c_e; 0 for the template pair stack
    c_pair: int  # c_z / c_t
    heads_msa: int
    c_opm: int
    c_tri_mul: int
    heads_tri: int
    blocks: int


@dataclass(frozen=True)
class ModelDims:
    """The activation shapes of one training sample (what DAP shards) and the model's size."""

    n_res: int
    n_seq: int  # MSA rows the Evoformer sees (clusters + template torsion rows)
    n_extra: int
    n_templ: int
    stacks: dict[str, BlockDims]
    itemsize: int  # bytes per activation element (2 under bf16 autocast)
    parameters: int

    @classmethod
    def from_config(cls, cfg: Any) -> ModelDims:
        """The dims of a :class:`~scalefold.config.training.TrainConfig` (its model preset, crop, precision)."""
        from scalefold.model.factory import build_model_config

        d = build_model_config(cfg).to_dict()
        evo, extra, templ = d["evoformer_stack_config"], d["extra_msa_stack_config"], d["template_pair_stack_config"]
        templates = d["max_templates"] if d["templates_enabled"] else 0
        stacks = {
            "template_pair_stack": BlockDims(0, templ["c_t"], 0, 0, templ["c_hidden_tri_mul"], templ["num_heads_tri"],
                                             templ["num_blocks"] if templates else 0),
            "extra_msa_stack": BlockDims(extra["c_e"], extra["c_z"], extra["num_heads_msa"], extra["c_hidden_opm"],
                                         extra["c_hidden_tri_mul"], extra["num_heads_tri"], extra["num_blocks"]),
            "evoformer_stack": BlockDims(evo["c_m"], evo["c_z"], evo["num_heads_msa"], evo["c_hidden_opm"],
                                         evo["c_hidden_tri_mul"], evo["num_heads_tri"], evo["num_blocks"]),
        }  # fmt: skip
        torsion_rows = templates if d["embed_template_torsion_angles"] else 0
        return cls(n_res=d["train_sequence_crop_size"], n_seq=d["max_msa_clusters"] + torsion_rows,
                   n_extra=d["max_extra_msa"], n_templ=templates, stacks=stacks,
                   itemsize=ITEMSIZE[cfg.precision], parameters=parameter_count(cfg))  # fmt: skip


_PARAMETERS: dict[str, int] = {}


def parameter_count(cfg: Any) -> int:
    """Trainable parameters of the run's model (built once per model configuration on the ``meta`` device: no
    memory, no initialisation)."""
    import torch

    from scalefold.model.factory import build_model, build_model_config

    model_cfg = build_model_config(cfg)
    key = repr((model_cfg.to_dict(), cfg.parallel_evoformer))
    if key not in _PARAMETERS:
        with torch.device("meta"):  # built there: no initialisation runs
            model = build_model(cfg, model_cfg, torch.device("meta"), torch.float32, training=False)
        _PARAMETERS[key] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _PARAMETERS[key]


@dataclass(frozen=True)
class Collective:
    """``calls`` collectives of one kind that one rank issues per step, ``bytes`` sent by it in all."""

    group: str  # dap, bp, dp
    kind: str  # all_to_all, all_gather, reduce_scatter, broadcast, all_reduce
    stack: str
    phase: str  # recycling, forward, backward
    bytes: int
    calls: int
    overlapped: bool = False  # the code overlaps it with compute

    def to_json(self) -> dict:
        return {"group": self.group, "kind": self.kind, "stack": self.stack, "phase": self.phase,
                "bytes": self.bytes, "calls": self.calls, "overlapped": self.overlapped}  # fmt: skip


def _pad(n: int, d: int) -> int:
    return -(-n // d) * d


def _a2a(numel: int, itemsize: int, d: int) -> int:
    return numel * itemsize * (d - 1) // d  # as CommStats counts it (primitives.start_all_to_all)


def block_collectives(dims: ModelDims, stack: str, d: int) -> list[tuple[str, int, bool]]:
    """``(kind, bytes, overlapped)`` of one block's forward collectives on one rank of a DAP-``d`` group,
    in the order the code issues them."""
    b, k, n = dims.stacks[stack], dims.itemsize, dims.n_res
    r = _pad(n, d) // d  # this rank's rows (or columns) of the pair
    rp = _pad(n, d)
    pair = [("all_to_all", _a2a(r * rp * b.c_pair, k, d), False)]
    tri = [
        ("all_gather", r * n * b.c_tri_mul * k * (d - 1), True),  # tri-mul outgoing b (overlapped)
        *pair,
        ("all_gather", r * n * b.c_tri_mul * k * (d - 1), True),  # tri-mul incoming a (overlapped)
        *pair,
        ("all_gather", r * n * b.heads_tri * k * (d - 1), False),  # triangle attention, starting node: bias
        *pair,
        ("all_gather", r * n * b.heads_tri * k * (d - 1), False),  # ending node: bias
        *pair,
    ]
    if stack == "template_pair_stack":  # attention first, then the multiplications; T templates at once
        t = dims.n_templ
        att = [("all_gather", t * r * n * b.heads_tri * k * (d - 1), False), ("all_to_all", _a2a(t * r * rp * b.c_pair, k, d), False)]
        mul = [("all_gather", t * r * n * b.c_tri_mul * k * (d - 1), True), ("all_to_all", _a2a(t * r * rp * b.c_pair, k, d), False)]
        return att + att + mul + mul
    s = _pad(dims.n_extra if stack == "extra_msa_stack" else dims.n_seq, d)
    rows = dims.n_extra if stack == "extra_msa_stack" else dims.n_seq
    msa = [
        ("all_gather", r * n * b.heads_msa * k * (d - 1), False),  # row attention's pair bias
        ("all_to_all", _a2a(s // d * rp * b.c_msa, k, d), False),  # MSA rows -> columns
        ("all_gather", rows * r * b.c_opm * k * (d - 1), True),  # outer product mean, right projection
        ("all_to_all", _a2a(s * r * b.c_msa, k, d), True),  # MSA columns -> rows, under the pair stack
    ]
    return msa + tri


def _stack_edges(dims: ModelDims, stack: str, d: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((entry bytes, calls), (exit bytes, calls))`` of one stack call: the gradient all-gathers of the entry
    scatters (backward: one per input, MSA and pair) and the exit all-gathers (forward: the outputs read)."""
    b, k, n = dims.stacks[stack], dims.itemsize, dims.n_res
    r = _pad(n, d) // d
    pair = r * n * b.c_pair * (dims.n_templ if stack == "template_pair_stack" else 1) * k * (d - 1)
    if stack == "template_pair_stack":
        return (pair, 1), (pair, 1)
    s = _pad(dims.n_extra if stack == "extra_msa_stack" else dims.n_seq, d) // d
    msa = s * n * b.c_msa * k * (d - 1)
    return (msa + pair, 2), ((pair, 1) if stack == "extra_msa_stack" else (msa + pair, 2))


def _forward_pass(dims: ModelDims, d: int, phase: str, passes: int, out: list[Collective]) -> None:
    for stack in STACKS:
        blocks = dims.stacks[stack].blocks
        if not blocks or not passes:
            continue
        _add(out, "dap", stack, phase, block_collectives(dims, stack, d), blocks * passes)
        nbytes, calls = _stack_edges(dims, stack, d)[1]
        out.append(Collective("dap", "all_gather", stack, phase, nbytes * passes, calls * passes))


def _add(out: list[Collective], group: str, stack: str, phase: str, items: Iterable[tuple[str, int, bool]], times: int) -> None:
    acc: dict[tuple[str, bool], list[int]] = defaultdict(lambda: [0, 0])
    for kind, nbytes, overlapped in items:
        acc[(kind, overlapped)][0] += nbytes * times
        acc[(kind, overlapped)][1] += times
    for (kind, overlapped), (nbytes, calls) in acc.items():
        out.append(Collective(group, kind, stack, phase, nbytes, calls, overlapped))


def recomputed(fwd: list[tuple[str, int, bool]], stack: str) -> list[tuple[str, int, bool]]:
    """The forward collectives a block recomputing in backward issues again: all but the block's last
    all-to-all (checkpointing stops recomputing once every saved tensor is back, and the block's output is
    not saved) and, in an MSA block, the overlapped MSA switch back to rows (its output is the block's
    output; :mod:`scalefold.distributed.async_ops` issues no overlapped collective while recomputing)."""
    keep = fwd[:-1]
    return keep if stack == "template_pair_stack" else keep[:3] + keep[4:]


def _backward(dims: ModelDims, d: int, recompute: dict[str, int], out: list[Collective]) -> None:
    for stack in STACKS:
        blocks = dims.stacks[stack].blocks
        if not blocks:
            continue
        fwd = block_collectives(dims, stack, d)
        bwd = [("reduce_scatter" if kind == "all_gather" else kind, nbytes, over) for kind, nbytes, over in fwd]
        _add(out, "dap", stack, "backward", bwd, blocks)
        if stack == "extra_msa_stack":  # the last block's MSA switch back to rows: its output is never read
            kind, nbytes, over = bwd[3]
            out.append(Collective("dap", kind, stack, "backward", -nbytes, -1, over))
        n_re = min(recompute.get(stack, 0), blocks)
        if n_re:
            _add(out, "dap", stack, "backward", recomputed(fwd, stack), n_re)
        nbytes, calls = _stack_edges(dims, stack, d)[0]
        out.append(Collective("dap", "all_gather", stack, "backward", nbytes, calls))


def dap_collectives(dims: ModelDims, d: int, recycling: int, recompute: dict[str, int] | None = None) -> list[Collective]:
    """Per rank, every DAP collective of a training step with ``recycling`` no-grad passes, DAP size ``d``,
    and ``recompute[stack]`` blocks of each stack recomputing in backward (see the module docstring)."""
    if d < 1:
        raise ValueError(f"DAP size must be >= 1, got {d}")
    out: list[Collective] = []
    if d == 1:
        return out
    _forward_pass(dims, d, "recycling", recycling, out)
    _forward_pass(dims, d, "forward", 1, out)
    _backward(dims, d, recompute or {}, out)
    return merge(out)


def bp_collectives(dims: ModelDims, d: int, recycling: int, recompute: int = 0) -> list[Collective]:
    """Per rank, Branch Parallelism's collectives (Parallel Evoformer, a BP pair; DAP size ``d`` inside each
    branch): per block forward the two branches' outputs broadcast to the peer (2 calls; a rank sends the
    larger, which bounds the time), in every pass and once more per recomputed block; backward the block
    inputs' gradients all-reduced over the pair (``m + z`` per rank: ``2(N-1)/N`` of it for ``N = 2``)."""
    b, k = dims.stacks["evoformer_stack"], dims.itemsize
    m = _pad(dims.n_seq, d) // d * dims.n_res * b.c_msa * k
    z = _pad(dims.n_res, d) // d * dims.n_res * b.c_pair * k
    grad_blocks = b.blocks + min(recompute, b.blocks)
    return [
        Collective("bp", "broadcast", "evoformer_stack", "recycling", max(m, z) * b.blocks * recycling, 2 * b.blocks * recycling),
        Collective("bp", "broadcast", "evoformer_stack", "forward", max(m, z) * grad_blocks, 2 * grad_blocks),
        Collective("bp", "all_reduce", "evoformer_stack", "backward", (m + z) * b.blocks, b.blocks),
    ]


def merge(items: Iterable[Collective]) -> list[Collective]:
    """Collectives of the same group, kind, stack, phase and overlap summed into one entry."""
    acc: dict[tuple, list[int]] = {}
    for c in items:
        key = (c.group, c.kind, c.stack, c.phase, c.overlapped)
        slot = acc.setdefault(key, [0, 0])
        slot[0] += c.bytes
        slot[1] += c.calls
    return [Collective(*key[:4], nbytes, calls, key[4]) for key, (nbytes, calls) in acc.items() if calls]


def totals(items: Iterable[Collective], by: tuple[str, ...] = ("group", "kind")) -> dict[str, dict[str, int]]:
    """``{"group/kind": {"bytes": .., "calls": ..}}`` (or keyed by the fields ``by``)."""
    out: dict[str, dict[str, int]] = {}
    for c in items:
        slot = out.setdefault("/".join(str(getattr(c, f)) for f in by), {"bytes": 0, "calls": 0})
        slot["bytes"] += c.bytes
        slot["calls"] += c.calls
    return out


def per_block(dims: ModelDims, d: int) -> dict[str, dict[str, dict[str, int]]]:
    """``{stack: {kind: {"bytes", "calls"}}}`` of one block's forward collectives (per rank)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for stack in STACKS:
        if not dims.stacks[stack].blocks or d == 1:
            continue
        slot = out.setdefault(stack, {})
        for kind, nbytes, _ in block_collectives(dims, stack, d):
            entry = slot.setdefault(kind, {"bytes": 0, "calls": 0})
            entry["bytes"] += nbytes
            entry["calls"] += 1
    return out


# ---------------------------------------------------------------------------------------------
# The gradient all-reduce
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduce:
    """The data-parallel gradient all-reduce of one step, per rank, on a cluster of ``ranks`` GPUs."""

    size_bytes: int  # the gradient buffer
    ranks: int
    gpus_per_node: int
    buckets: int
    ring_bytes: int  # what one rank sends in a flat ring: 2 (N-1)/N of the buffer
    intra_s: float
    inter_ring_s: float
    inter_tree_s: float
    seconds: float  # intra + the faster inter-node algorithm
    last_bucket_s: float
    algorithm: str
    links: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"bytes": self.size_bytes, "ranks": self.ranks, "buckets": self.buckets, "ring_bytes_per_rank": self.ring_bytes,
                "intra_node_s": self.intra_s, "inter_node_ring_s": self.inter_ring_s, "inter_node_tree_s": self.inter_tree_s,
                "seconds": self.seconds, "last_bucket_s": self.last_bucket_s, "inter_node_algorithm": self.algorithm,
                "links": self.links}  # fmt: skip


def _hierarchical(size: float, ranks: int, g: int, intra: Link, inter: Link, port_share: float) -> tuple[float, float, float]:
    """``(intra-node, inter ring, inter tree)`` seconds of an all-reduce of ``size`` bytes."""
    g = min(g, ranks)
    nodes = max(1, math.ceil(ranks / g))
    intra_s = (2 * (g - 1) / g * size / intra.effective_bandwidth + 2 * intra.latency_s) if g > 1 else 0.0
    if nodes == 1:
        return intra_s, 0.0, 0.0
    per_port = size / g * port_share  # each GPU's share goes through its (possibly shared) port
    bw = 2 * (nodes - 1) / nodes * per_port / inter.effective_bandwidth
    ring = bw + 2 * (nodes - 1) * inter.latency_s
    tree = bw + 2 * math.ceil(math.log2(nodes)) * inter.latency_s
    return intra_s, ring, tree


def grad_allreduce(parameters: int, itemsize: int, ranks: int, card: Card, bucket_bytes: int = DDP_BUCKET_BYTES) -> AllReduce:
    """The gradient all-reduce of ``parameters`` gradients of ``itemsize`` bytes over ``ranks`` training
    ranks on ``card``'s nodes (see the module docstring)."""
    size = parameters * itemsize
    port_share = card.gpus_per_node / card.nics_per_node
    links = {"intra_node": card.intra_link.to_json(), "inter_node": card.inter_link.to_json()}
    if ranks <= 1:
        return AllReduce(size, ranks, card.gpus_per_node, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, "none", links)
    intra, ring, tree = _hierarchical(size, ranks, card.gpus_per_node, card.intra_link, card.inter_link, port_share)
    buckets = math.ceil(size / bucket_bytes)
    last = sum(_hierarchical(min(bucket_bytes, size), ranks, card.gpus_per_node, card.intra_link, card.inter_link, port_share)[:2])
    algorithm = "none" if ranks <= card.gpus_per_node else ("tree" if tree < ring else "ring")
    seconds = intra + min(ring, tree)
    # latency per bucket: each bucket is its own collective
    seconds += (buckets - 1) * (2 * card.intra_link.latency_s)
    return AllReduce(size, ranks, card.gpus_per_node, buckets, int(2 * (ranks - 1) * size // ranks), intra, ring, tree,
                     seconds, last, algorithm, links)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Time on the links
# ---------------------------------------------------------------------------------------------


def collective_seconds(items: Iterable[Collective], link: Link) -> dict[str, float]:
    """``{"total_s", "exposed_s"}`` of collectives on ``link``: per call the latency, plus the bytes over the
    effective bandwidth; ``exposed_s`` without the overlapped ones."""
    total = exposed = 0.0
    for c in items:
        s = c.calls * link.latency_s + c.bytes / link.effective_bandwidth
        total += s
        exposed += 0.0 if c.overlapped else s
    return {"total_s": total, "exposed_s": exposed}


def comm_seconds(
    collectives: list[Collective], allreduce: AllReduce, card: Card, graphed: bool, host_s_per_launch: float = 0.0
) -> dict[str, float]:
    """The step's communication seconds on ``card``'s links: DAP and BP inside the node, the gradient
    all-reduce (exposed in full for a graphed step, its last bucket for an eager DDP step); ``eager`` adds the
    host's launch time of each collective (``host_s_per_launch``)."""
    dap = collective_seconds([c for c in collectives if c.group == "dap"], card.intra_link)
    bp = collective_seconds([c for c in collectives if c.group == "bp"], card.intra_link)
    ar_exposed = allreduce.seconds if graphed else min(allreduce.last_bucket_s, allreduce.seconds)
    calls = sum(c.calls for c in collectives) + allreduce.buckets
    host = 0.0 if graphed else calls * host_s_per_launch
    exposed = dap["exposed_s"] + bp["exposed_s"] + ar_exposed + host
    return {"dap_s": dap["total_s"], "dap_exposed_s": dap["exposed_s"], "bp_s": bp["total_s"],
            "bp_exposed_s": bp["exposed_s"], "allreduce_s": allreduce.seconds, "allreduce_exposed_s": ar_exposed,
            "host_launch_s": host, "launches": calls, "exposed_s": exposed}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The real code's collectives, observed on the fake step
# ---------------------------------------------------------------------------------------------


def observe_collectives(cfg: Any, target: str = "cuda", kernels: str | None = None) -> dict[str, dict[str, int]]:
    """``{kind: {"bytes", "calls"}}`` the DAP group's counter (:class:`~scalefold.distributed.group.CommStats`)
    records over one fake training step of ``cfg`` (:func:`scalefold.perf.memory.estimate_memory`: one no-grad
    recycling pass where the run recycles, the grad pass, backward): what :func:`dap_collectives` predicts
    for ``recycling=1``."""
    from scalefold.perf.memory import estimate_memory

    seen: dict[str, dict[str, int]] = {}

    @contextlib.contextmanager
    def observe(step: Any, tracker: Any) -> Iterator[None]:
        groups = {id(s.dap_group): s.dap_group for s in step.model.parallel_stacks() if s.dap_group is not None}
        for g in groups.values():
            g.stats.reset()
        yield
        for g in groups.values():
            for kind, nbytes in g.stats.bytes.items():
                slot = seen.setdefault(kind, {"bytes": 0, "calls": 0})
                slot["bytes"] += nbytes
                slot["calls"] += g.stats.calls[kind]

    estimate_memory(cfg, target=target, kernels=kernels, observe=observe)
    return seen


__all__ = [
    "DDP_BUCKET_BYTES", "AllReduce", "BlockDims", "Collective", "ModelDims", "block_collectives", "bp_collectives",
    "collective_seconds", "comm_seconds", "dap_collectives", "grad_allreduce", "merge", "observe_collectives",
    "parameter_count", "per_block", "totals",
]  # fmt: skip
