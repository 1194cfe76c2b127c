"""The predicted training step of one layout on one card: compute from the step-time model per card, plus the
communication the layout adds (:mod:`scalefold.perf.comm`), graphed and eager.

A layout is ``DAP x BP x DP`` training ranks (+ evaluation ranks) of one card type (:mod:`scalefold.perf.cluster`);
:func:`validate_layout` refuses one that cannot exist, naming the rule. :func:`step_profile` counts the step of a
DAP rank once (the fake step of :func:`scalefold.perf.flops.count_step`, minutes at MLPerf shapes) and keeps its
launch profile on disk (``~/.cache/scalefold/plan``, or ``$SCALEFOLD_FLOPS_CACHE/plan``; ``off``: not kept), keyed
on the step's options, the torch version and a digest of the code the count depends on. :func:`predict_step`
prices it on a card (:mod:`scalefold.perf.step_time`: the same launch roofline and host time per launch, with the
card's own peaks; the efficiencies and the host time are the H200-calibrated priors of that module) and adds
the communication: DAP's and BP's collectives inside the node, the gradient all-reduce over all training ranks.
A global batch larger than the data-parallel size runs ``batch / dp`` samples per replica one after the other
(the compute repeats, the all-reduce does not).

Importable by the Trainer or a later planner (floor 9, ``scalefold.perf``): :func:`predict_step` takes a
:class:`~scalefold.config.training.TrainConfig`, a card and the layout sizes and returns plain numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scalefold.errors import UserError
from scalefold.perf.cluster import Card
from scalefold.perf.comm import ModelDims, bp_collectives, comm_seconds, dap_collectives, grad_allreduce, totals
from scalefold.perf.step_time import BANDWIDTH_EFFICIENCY, FLOPS_EFFICIENCY, HOST_S_PER_LAUNCH, MIN_KERNEL_S, CardTiming

DAP_SIZES = (1, 2, 4, 8)
#: What ScaleFold's DDP reduces per parameter: the gradients of the fp32 master weights (bf16 autocast keeps
#: the parameters in fp32; ``scalefold.train.trainer`` wraps the model in DDP as it is).
GRAD_ITEMSIZE = 4


class PlanLayoutError(UserError, ValueError):
    """A layout that cannot exist on the cluster asked for (one line naming the rule)."""

    label = "invalid layout"


@dataclass(frozen=True)
class Layout:
    """``count`` cards: ``dp x bp x dap`` training ranks, ``eval_ranks`` evaluating, ``batch`` samples per step."""

    count: int
    dap: int = 1
    bp: int = 1
    eval_ranks: int = 0
    batch: int | None = None  # default: one sample per replica (dp)

    @property
    def train_ranks(self) -> int:
        return self.count - self.eval_ranks

    @property
    def dp(self) -> int:
        return self.train_ranks // (self.dap * self.bp)

    @property
    def global_batch(self) -> int:
        return self.batch if self.batch is not None else self.dp

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    def to_json(self) -> dict:
        return {"cards": self.count, "dap": self.dap, "bp": self.bp, "eval_ranks": self.eval_ranks,
                "train_ranks": self.train_ranks, "dp": self.dp, "global_batch": self.global_batch,
                "samples_per_replica": self.local_batch}  # fmt: skip


def validate_layout(layout: Layout, card: Card, crop: int | None = None) -> Layout:
    """``layout`` if it can exist on ``card``'s nodes, else :class:`PlanLayoutError` naming the rule."""
    g = card.gpus_per_node
    if layout.count < 1:
        raise PlanLayoutError(f"--count {layout.count}: at least one card")
    if layout.dap < 1 or g % layout.dap:
        raise PlanLayoutError(f"--dap {layout.dap} must divide the {g} GPUs per node of {card.name} (a DAP group stays inside a node)")
    if layout.bp not in (1, 2) or g % (layout.dap * layout.bp):
        raise PlanLayoutError(f"--bp {layout.bp}: BP is 1 or 2, and bp x dap = {layout.bp * layout.dap} must divide the {g} GPUs per node")
    if crop is not None and crop % layout.dap:
        raise PlanLayoutError(f"--dap {layout.dap} does not divide the crop size {crop}")
    if not 0 <= layout.eval_ranks < layout.count:
        raise PlanLayoutError(f"--eval-ranks {layout.eval_ranks}: must be >= 0 and fewer than the {layout.count} cards")
    group = layout.dap * layout.bp
    if layout.train_ranks % group:
        raise PlanLayoutError(f"{layout.train_ranks} training ranks ({layout.count} cards - {layout.eval_ranks} eval) "
                              f"are not divisible by bp x dap = {group}")  # fmt: skip
    if layout.batch is not None and (layout.batch < 1 or layout.batch % layout.dp):
        raise PlanLayoutError(f"--batch {layout.batch} is not divisible by the data-parallel size {layout.dp} "
                              f"({layout.train_ranks} training ranks / bp x dap {group})")  # fmt: skip
    return layout


def card_timing(card: Card) -> CardTiming:
    """The step-time model's launch pricing on ``card`` (its peaks; the priors and host time of
    :mod:`scalefold.perf.step_time`)."""
    return CardTiming(card.spec, FLOPS_EFFICIENCY, BANDWIDTH_EFFICIENCY, MIN_KERNEL_S, HOST_S_PER_LAUNCH)


# ---------------------------------------------------------------------------------------------
# The counted step of one DAP rank, kept on disk
# ---------------------------------------------------------------------------------------------

_DEPENDS_ON = ("model", "losses", "kernels", "distributed", "optim")
_DEPENDS_ON_FILES = ("perf/flops.py", "perf/memory.py", "train/step.py")


def _digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    paths = [p for folder in _DEPENDS_ON for p in sorted((root / folder).glob("*.py"))]
    for path in paths + [root / f for f in _DEPENDS_ON_FILES]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_file(cfg: Any, target: str, kernels: str | None) -> Path | None:
    import torch

    from scalefold.perf.flops import FLOPS_CACHE_ENV, cache_key

    where = os.environ.get(FLOPS_CACHE_ENV, "")
    if where.strip().lower() == "off":
        return None
    base = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scalefold"
    key = repr((cache_key(cfg, target, kernels), torch.__version__, _digest()))
    return base / "plan" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


@dataclass(frozen=True)
class StepProfile:
    """One DAP rank's counted step: ``{n: {signature: calls}}`` per recycling count, and what was counted."""

    profiles: dict[int, dict[tuple[int, ...], int]]
    settings: dict[str, Any]
    seconds: float  # what the count took

    def to_json(self) -> dict:
        return {"settings": self.settings, "seconds": self.seconds,
                "profiles": {str(n): [[*sig, calls] for sig, calls in p.items()] for n, p in self.profiles.items()}}  # fmt: skip

    @classmethod
    def from_count(cls, step: Any) -> StepProfile:
        """The profile of a :class:`~scalefold.perf.flops.StepCount`."""
        settings = {k: v for k, v in step.settings.items() if isinstance(v, (int, float, str, bool, dict, list))}
        return cls({n: step.launch_profile(n) for n in step.recycling_counts()}, settings, round(step.seconds, 1))

    @classmethod
    def from_json(cls, data: dict) -> StepProfile:
        profiles = {int(n): {tuple(row[:-1]): row[-1] for row in rows} for n, rows in data["profiles"].items()}
        return cls(profiles, data["settings"], data["seconds"])


def step_profile(cfg: Any, target: str = "cuda", kernels: str | None = None) -> StepProfile:
    """The launch profile of one training step of ``cfg`` (per DAP rank), from the disk cache or one fake step."""
    path = _cache_file(cfg, target, kernels)
    if path is not None and path.is_file():
        try:
            return StepProfile.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # counted again below
    from scalefold.perf.flops import count_step

    prof = StepProfile.from_count(count_step(cfg, target=target, kernels=kernels))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(prof.to_json()))
            tmp.replace(path)
        except OSError:
            pass  # a cache that cannot be written costs the next plan a count, nothing else
    return prof


# ---------------------------------------------------------------------------------------------
# The step at a layout
# ---------------------------------------------------------------------------------------------


def layout_config(cfg: Any, dap: int) -> Any:
    """``cfg`` at DAP size ``dap`` (the step a DAP rank runs)."""
    return replace(cfg, dap=dap)


def communication(cfg: Any, card: Card, layout: Layout, recycling: int, dims: ModelDims | None = None,
                  recompute: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """The layout's collectives per rank and step with ``recycling`` no-grad passes: DAP's (per block and in
    all), BP's and the gradient all-reduce, with their bytes, launches and seconds on ``card``'s links."""
    from scalefold.perf.comm import per_block

    dims = dims or ModelDims.from_config(cfg)
    recompute = recompute if recompute is not None else checkpointed_blocks(cfg, dims)
    colls = dap_collectives(dims, layout.dap, recycling, recompute)
    if layout.bp > 1:
        colls += bp_collectives(dims, layout.dap, recycling, recompute.get("evoformer_stack", 0))
    ar = grad_allreduce(dims.parameters, GRAD_ITEMSIZE, layout.train_ranks, card)
    return {"collectives": colls, "allreduce": ar, "per_block": per_block(dims, layout.dap), "dims": dims,
            "recompute": recompute, "totals": totals(colls)}  # fmt: skip


def checkpointed_blocks(cfg: Any, dims: ModelDims) -> dict[str, int]:
    """Blocks per stack that recompute in backward under ``cfg``'s policy (``on``: all; ``off``: none; ``N``:
    the first N in forward order -- template pair, extra MSA, Evoformer; ``auto``: taken as ``on``)."""
    from scalefold.config.recompute import parse_checkpointing

    parsed = parse_checkpointing(cfg.activation_checkpointing)
    left = sum(dims.stacks[s].blocks for s in dims.stacks) if parsed in (True, "auto") else (0 if parsed is False else int(parsed))
    out = {}
    for stack in ("template_pair_stack", "extra_msa_stack", "evoformer_stack"):
        out[stack] = min(left, dims.stacks[stack].blocks)
        left -= out[stack]
    return out


def predict_step(cfg: Any, card: Card, layout: Layout, profile: StepProfile | None = None,
                 dims: ModelDims | None = None) -> dict[str, Any]:  # fmt: skip
    """``{"graphed": {...}, "eager": {...}}`` of one training step at ``layout`` on ``card``: per recycling
    count ``n`` and the mean over the uniform draw, the compute (the counted step priced on the card, times the
    samples per replica), the exposed communication and their sum (``step_s``)."""
    from scalefold.perf.step_time import step_seconds

    profile = profile or step_profile(layout_config(cfg, layout.dap))
    timing = card_timing(card)
    dims = dims or ModelDims.from_config(cfg)
    recompute = profile.settings.get("checkpointed_blocks") or checkpointed_blocks(cfg, dims)
    out: dict[str, Any] = {"graphed": {}, "eager": {}}
    for n, prof in sorted(profile.profiles.items()):
        compute = step_seconds(prof, timing, cfg.precision)
        comm = communication(cfg, card, layout, n, dims, recompute)
        for mode in ("graphed", "eager"):
            c = comm_seconds(comm["collectives"], comm["allreduce"], card, graphed=mode == "graphed",
                             host_s_per_launch=timing.host_s_per_launch)  # fmt: skip
            compute_s = compute[mode] * layout.local_batch
            out[mode][str(n)] = {"compute_s": compute_s, **c, "step_s": compute_s + c["exposed_s"]}
    for mode in ("graphed", "eager"):
        rows = list(out[mode].values())
        out[mode]["mean"] = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    return out


def communication_report(cfg: Any, card: Card, layout: Layout, profile: StepProfile) -> dict[str, Any]:
    """What ``estimate-step --dp`` prints: the layout and the card's links, per block and per step (each
    recycling count and the mean) the bytes and launches of each collective, the gradient all-reduce, and the
    predicted step (compute + exposed communication), graphed and eager."""
    dims = ModelDims.from_config(cfg)
    recompute = profile.settings.get("checkpointed_blocks") or checkpointed_blocks(cfg, dims)
    by_n = {}
    for n in sorted(profile.profiles):
        comm = communication(cfg, card, layout, n, dims, recompute)
        by_n[str(n)] = {"collectives": comm["totals"], "by_stack": totals(comm["collectives"], ("group", "kind", "stack")),
                        "by_phase": totals(comm["collectives"], ("group", "kind", "phase"))}  # fmt: skip
    ar = comm["allreduce"]
    keys = {k for v in by_n.values() for k in v["collectives"]}
    mean = {k: {f: sum(v["collectives"].get(k, {}).get(f, 0) for v in by_n.values()) / len(by_n) for f in ("bytes", "calls")}
            for k in sorted(keys)}  # fmt: skip
    return {"card": card.to_json(), "layout": layout.to_json(), "parameters": dims.parameters,
            "grad_itemsize": GRAD_ITEMSIZE, "activation_itemsize": dims.itemsize, "recompute": recompute,
            "per_block_forward": comm["per_block"], "per_step": by_n, "per_step_mean": mean,
            "gradient_allreduce": ar.to_json(), "predicted_step_s": predict_step(cfg, card, layout, profile, dims)}  # fmt: skip


__all__ = [
    "DAP_SIZES", "communication_report", "GRAD_ITEMSIZE", "Layout", "PlanLayoutError", "StepProfile", "card_timing", "checkpointed_blocks",
    "communication", "layout_config", "predict_step", "step_profile", "validate_layout",
]  # fmt: skip
