"""``scalefold estimate-step``: the step's FLOPs, bytes, launches, roofline floor, predicted time and peak memory, and the
activation-checkpointing policy that fits a device. The work is in :mod:`scalefold.perf.flops`,
:mod:`scalefold.perf.recompute` and :mod:`scalefold.perf.devices`; this module parses and prints."""

from __future__ import annotations

import argparse
import json
from typing import Any

EXIT_BAD_INPUT = 3
GiB = 2**30


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``estimate-memory`` and ``estimate-step`` share."""
    p.add_argument("--preset", default="mlperf", help="training preset (mlperf, demo, tiny; default mlperf)")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="default: the preset's")
    p.add_argument("--crop", type=int, help="crop size (default: the preset's; MLPerf 256)")
    p.add_argument("--dap", type=int, default=1, help="DAP size: the prediction is per rank (default 1)")
    p.add_argument("--kernels", choices=("triton", "torch"), help="kernel path (default: triton for --target cuda)")
    p.add_argument("--target", choices=("cuda", "cpu"), default="cuda",
                   help="allocator and autocast rules of this device (default cuda)")  # fmt: skip
    p.add_argument("--cuda-graphs", choices=("auto", "off"), default="auto",
                   help="count the CUDA-graph pool where --cuda-graphs auto would capture (default auto)")  # fmt: skip
    p.add_argument("--activation-checkpointing", metavar="POLICY",
                   help="on, off, N (the first N blocks in forward order recompute: template pair, extra MSA, "
                   "Evoformer) or auto (the fewest that fit --device-memory-gib or the CUDA device); default: the preset's")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate-step",
        help="count the FLOPs and bytes of one training step, its roofline floor and peak memory (no GPU needed)",
        description="Run one training step on fake tensors (as estimate-memory) counting every operator's "
        "matrix and elementwise FLOPs, the bytes it reads and writes and the kernels it launches, for each recycling "
        "count, by module; print the roofline floor on H100 / H200 / A100, the predicted step time on H100 / H200 "
        "(eager and graphed: scalefold/perf/step_time.py) and the predicted peak memory. With "
        "--device-memory-gib (or on CUDA) the activation-checkpointing policy is checked against the device: "
        "auto picks the fewest recomputing blocks that fit; a policy that cannot fit is refused, naming the "
        "smallest N that does. See scalefold/perf/flops.py for what is counted.",
    )  # fmt: skip
    add_common_arguments(p)
    p.add_argument("--device-memory-gib", type=float,
                   help="check the policy against a device of this many GiB (default: the CUDA device, if any)")  # fmt: skip
    p.add_argument("--depth", type=int, default=1, help="module levels in the per-module table (default 1)")
    p.add_argument("--compile", action="store_true",
                   help="count the run of --compile (the elementwise chains compiled: one kernel each, forward and "
                   "backward, their bytes at the boundary)")  # fmt: skip
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas: with --dap D the layout of D x N training ranks whose communication is "
                   "reported per rank and step (DAP's collectives per block and in all, the gradient all-reduce: bytes, "
                   "launches, seconds on --card's links) and added to the predicted step (default 1)")  # fmt: skip
    p.add_argument("--card", default="h100",
                   help="the cluster's card for the communication report: h100, h200, a100-sxm, a100-pcie, b200 "
                   "(their NVLink / PCIe and InfiniBand tables: scalefold/perf/cluster.py; default h100)")  # fmt: skip
    p.set_defaults(handler=_run)


def train_config(args: argparse.Namespace, **extra: Any) -> Any:
    """The :class:`~scalefold.config.training.TrainConfig` of the shared options."""
    from scalefold.config.training import TrainConfig

    overrides = {"precision": args.precision, "crop_size": args.crop, "dap": args.dap, "cuda_graphs": args.cuda_graphs,
                 "activation_checkpointing": args.activation_checkpointing}  # fmt: skip
    overrides.update(extra)
    return TrainConfig.from_preset(args.preset, overrides={k: v for k, v in overrides.items() if v is not None}, env={})


def check_arguments(args: argparse.Namespace) -> str | None:
    """A message for an option no estimate can use, else None."""
    from scalefold.config.recompute import parse_checkpointing
    from scalefold.config.training import PRESETS

    if args.preset not in PRESETS:
        return f"unknown preset {args.preset!r}; expected one of {sorted(PRESETS)}"
    if args.dap < 1:
        return f"--dap {args.dap}: must be >= 1"
    if getattr(args, "dp", 1) < 1:
        return f"--dp {args.dp}: must be >= 1"
    if getattr(args, "device_memory_gib", None) is not None and not args.device_memory_gib > 0:
        return f"--device-memory-gib {args.device_memory_gib:g}: must be > 0"
    try:
        parse_checkpointing(args.activation_checkpointing)
    except ValueError as exc:
        return f"--activation-checkpointing: {exc}"
    return None


def resolve(args: argparse.Namespace, cfg: Any, estimate: Any = None) -> tuple[Any, Any]:
    """``(cfg with the policy resolved, PolicyChoice or None)`` against --device-memory-gib or the CUDA
    device; raises ``ValueError`` (``PolicyDoesNotFit``) for a policy that cannot fit."""
    from dataclasses import replace

    from scalefold.perf.recompute import resolve_policy

    capacity = int(args.device_memory_gib * GiB) if getattr(args, "device_memory_gib", None) else None
    choice = resolve_policy(cfg, capacity_bytes=capacity, estimate=estimate)
    if choice is not None:
        cfg = replace(cfg, activation_checkpointing=choice.policy)
    return cfg, choice


def _run(args: argparse.Namespace) -> int:
    from scalefold.perf.flops import count_step

    problem = check_arguments(args)
    if problem:
        return _bad(problem)
    card, layout = _cluster(args)
    try:
        cfg = train_config(args, **({"compile": True} if getattr(args, "compile", False) else {}))
        cfg, choice = resolve(args, cfg, estimate=lambda c: count_step(c, target=args.target, kernels=args.kernels))
        step = count_step(cfg, target=args.target, kernels=args.kernels)
    except ValueError as exc:  # a policy that cannot fit, a layout DAP cannot take, a bad option value
        return _bad(str(exc))
    out = report(step, choice, depth=args.depth)
    out["communication"] = _communication(cfg, card, layout, step)
    print(json.dumps(out, indent=1) if args.json else format_report(out) + "\n\n" + format_communication(out["communication"]))
    return 0


def _cluster(args: argparse.Namespace) -> tuple[Any, Any]:
    """The card and the layout of ``--card``, ``--dap``, ``--dp`` (a layout that cannot exist is refused)."""
    from scalefold.perf.cluster import card as card_named
    from scalefold.perf.layout_model import Layout, validate_layout

    card = card_named(args.card)
    return card, validate_layout(Layout(count=args.dap * args.dp, dap=args.dap), card, args.crop)


def _communication(cfg: Any, card: Any, layout: Any, step: Any) -> dict[str, Any]:
    from scalefold.perf.layout_model import StepProfile, communication_report

    return communication_report(cfg, card, layout, StepProfile.from_count(step))


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _per_n(step: Any, fn: Any) -> dict[str, float]:
    return {str(n): fn(n) for n in step.recycling_counts()}


def _modules(step: Any, depth: int, precision: str) -> dict[str, Any]:
    from scalefold.perf.flops import CATEGORIES, FIELDS, LAUNCHES, floor_table, group

    grouped: dict[str, dict[int, dict[str, list[int]]]] = {}
    for n in step.recycling_counts():
        for category in CATEGORIES:
            for module, counts in step.by_module(n, (category,)).items():
                slot = grouped.setdefault(group(module, depth), {}).setdefault(n, {})
                acc = slot.setdefault(category, [0] * len(FIELDS))
                for i, v in enumerate(counts):
                    acc[i] += v
    out = {}
    for name, per_n in grouped.items():
        def totals(n: int, per_n=per_n) -> list[int]:
            return [sum(c[i] for c in per_n.get(n, {}).values()) for i in range(len(FIELDS))]

        out[name] = {
            "flops": _per_n(step, lambda n: sum(totals(n)[:3])),
            "flops_by_category": {c: sum(v[:3]) for c, v in per_n.get(0, {}).items()},  # at n = 0
            "bytes": _per_n(step, lambda n: totals(n)[4] + totals(n)[5]),
            "launches": _per_n(step, lambda n: totals(n)[LAUNCHES]),
            "launches_by_category": {c: v[LAUNCHES] for c, v in per_n.get(min(1, max(step.recycling_counts())), {}).items()},
            "floor_s": {card: v["floor_s"]["mean"] for card, v in floor_table(totals, step.recycling_counts(), precision).items()},
        }
    return dict(sorted(out.items(), key=lambda kv: -sum(kv[1]["flops"].values())))


def report(step: Any, choice: Any = None, depth: int = 1) -> dict[str, Any]:
    """The JSON of ``estimate-step``: per recycling count ``n`` (keys ``"0"`` ..) the matrix FLOPs
    (``flops``, recomputation included; ``model_flops`` without), elementwise FLOPs, bytes, and the
    roofline floor per card (``floor_s``, the larger of ``compute_s`` and ``memory_s``); their means over
    the training's uniform recycling counts; the predicted peak, the policy and its recomputing blocks;
    the same per module; kernel launches (``launches``, per ``n``; per module, and per phase at ``n`` = 1,
    ``launches_by_category``; the operators launched most at ``n`` = 1, ``launches_by_op``); the predicted
    step time per card, eager and graphed (``predicted_s``: :func:`scalefold.perf.step_time.predict`); and
    the policy search."""
    from scalefold.perf.step_time import predict

    precision = step.settings["precision"]
    mem = step.memory
    out = {
        "settings": step.settings, "recycling_counts": list(step.recycling_counts()),
        "flops": _per_n(step, step.flops), "flops_mean": step.flops_mean,
        "model_flops": _per_n(step, step.model_flops), "model_flops_mean": step.mean(step.model_flops),
        "flops_by_dtype": _per_n(step, step.flops_by_dtype),
        "flops_elementwise": _per_n(step, step.elementwise_flops), "bytes": _per_n(step, step.bytes),
        "bytes_mean": step.mean(step.bytes), "launches": _per_n(step, step.launches),
        "launches_mean": step.mean(step.launches),
        "launches_by_op": step.launches_by_op(min(1, max(step.recycling_counts()))),
        "predicted_s": predict(step), "peak_bytes": mem.peak_bytes, "peak_gib": round(mem.peak_gib, 3),
        "memory_breakdown": mem.breakdown, "activation_checkpointing": step.settings["activation_checkpointing"],
        "checkpointed_blocks": step.settings["checkpointed_blocks"],
        "modules": _modules(step, depth, precision), "seconds": round(step.seconds, 1),
    }  # fmt: skip
    floors = step.floors()
    for kind in ("floor_s", "compute_s", "memory_s"):  # means over n, then per n
        out[kind] = {card: v[kind]["mean"] for card, v in floors.items()}
        out[f"{kind}_by_recycling"] = {card: {n: s for n, s in v[kind].items() if n != "mean"} for card, v in floors.items()}
    if choice is not None:
        out["policy"] = choice.to_json()
    return out


def _unit(value: float, units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    """The largest unit (name, scale) in which ``value`` is at least 0.1."""
    for name, scale in units:
        if value >= 0.1 * scale:
            return name, scale
    return units[-1]


_FLOP_UNITS = (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6))
_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6))
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))


def _memory(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def format_report(out: dict[str, Any]) -> str:
    """The readable table of :func:`report`."""
    from scalefold.perf.devices import DEVICES

    s, ns = out["settings"], [str(n) for n in out["recycling_counts"]]
    blocks = ", ".join(f"{k} {v}" for k, v in out["checkpointed_blocks"].items())
    flop, flop_scale = _unit(out["flops_mean"], _FLOP_UNITS)
    byte, byte_scale = _unit(out["bytes_mean"], _BYTE_UNITS)
    sec, sec_scale = _unit(max(out["floor_s"].values()), _TIME_UNITS)
    lines = [f"{s['preset']} crop {s['crop']} {s['precision']} DAP {s['dap']} (target {s['target']}, kernels {s['kernels']}): "
             f"activation checkpointing {out['activation_checkpointing']} (recomputing blocks: {blocks})",
             f"predicted peak memory {_memory(out['peak_bytes'])} per rank; per rank and step:", ""]  # fmt: skip

    def row(label: str, per_n: dict[str, float], scale: float, fmt: str = "{:10.3f}") -> str:
        vals = [per_n[n] / scale for n in ns]
        return f"{label:<28}" + "".join(fmt.format(v) for v in vals) + fmt.format(sum(vals) / len(vals))

    lines += [f"{'recycling passes n':<28}" + "".join(f"{n:>10}" for n in ns) + f"{'mean':>10}",
              row(f"matrix {flop}", out["flops"], flop_scale), row("  without recomputation", out["model_flops"], flop_scale),
              row(f"elementwise {flop}", out["flops_elementwise"], flop_scale), row(f"bytes moved ({byte})", out["bytes"], byte_scale),
              row("kernel launches", out["launches"], 1.0, "{:10.0f}")]  # fmt: skip
    for card, modes in out["predicted_s"].items():
        for mode, per_n in modes.items():
            lines.append(row(f"predicted {DEVICES[card].name.split()[0]} {mode} (s)", per_n, 1.0))
    for card, per_n in out["floor_s_by_recycling"].items():
        lines.append(row(f"floor {DEVICES[card].name} ({sec})", per_n, sec_scale))
        lines.append(row("  compute (matrix FLOPs)", out["compute_s_by_recycling"][card], sec_scale))
        lines.append(row("  memory (bytes moved)", out["memory_s_by_recycling"][card], sec_scale))
    lines += ["", f"{'by module (mean over n)':<42} {flop:>8} {'fwd':>8} {'recomp':>8} {'bwd':>8} {byte:>8} {'H100 ' + sec:>8} {'launches':>9}"]
    for name, m in list(out["modules"].items())[:30]:
        cat = m["flops_by_category"]
        mean = sum(m["flops"].values()) / len(m["flops"]) / flop_scale
        part = [cat.get(c, 0) / flop_scale for c in ("forward", "recompute", "backward")]
        moved = sum(m["bytes"].values()) / len(m["bytes"]) / byte_scale
        launches = sum(m["launches"].values()) / len(m["launches"])
        lines.append(f"  {name[:40]:<40} {mean:8.3f} {part[0]:8.3f} {part[1]:8.3f} {part[2]:8.3f} {moved:8.2f} "
                     f"{m['floor_s'].get('h100-sxm', 0) / sec_scale:8.3f} {launches:9.0f}")  # fmt: skip
    lines.append("  (fwd / recomp / bwd: the grad pass's forward, its recomputation and its backward at n = 0)")
    if "policy" in out:
        lines += ["", _format_policy(out["policy"], flop, flop_scale)]
    return "\n".join(lines)


def _format_policy(p: dict[str, Any], flop: str, scale: float) -> str:
    lines = [f"policy for a {p['capacity_bytes'] / GiB:g} GiB device ({_memory(p['usable_bytes'])} usable; margin "
             f"{p['margin']:.2f}x on activations): {p['policy']} = {p['blocks']} of {p['total_blocks']} blocks recompute, "
             f"predicted peak {_memory(p['peak_bytes'])} ({_memory(p['calibrated_peak_bytes'])} with the margin)"]  # fmt: skip
    flops = {n: probe["flops_mean"] for n, probe in p["probes"].items() if "flops_mean" in probe}
    for n, probe in p["probes"].items():
        f = f", {flops[n] / scale:.3f} {flop} mean" if n in flops else ""
        lines.append(f"  N = {n:>3}: predicted {_memory(probe['peak_bytes']):>10}, with the margin "
                     f"{_memory(probe['calibrated_peak_bytes']):>10}, {'fits' if probe['fits'] else 'does not fit'}{f}")  # fmt: skip
    on, mine = flops.get(str(p["total_blocks"])), flops.get(str(p["blocks"]))
    if on and mine is not None:
        lines.append(f"  saves {(on - mine) / scale:.3f} {flop} per step (mean) against on ({(on - mine) / on:.1%})")
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for name, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{n:.0f} B"


def format_communication(c: dict[str, Any]) -> str:
    """The readable table of the communication report (``report()["communication"]``)."""
    lay, card, ar = c["layout"], c["card"], c["gradient_allreduce"]
    intra, inter = card["intra_node"], card["inter_node"]
    lines = [f"communication per rank and step: DAP {lay['dap']} x DP {lay['dp']} = {lay['train_ranks']} training ranks on "
             f"{card['name']} nodes ({card['gpus_per_node']} x {card['gpu']}); inside a node {intra['description']} "
             f"({intra['gb_per_s']:g} GB/s per direction, {intra['efficiency']:.0%} reached, {intra['latency_us']:g} us per "
             f"collective), between nodes {inter['description']} ({inter['gb_per_s']:g} GB/s per port, {card['nics_per_node']} "
             f"ports per node, {inter['efficiency']:.0%}, {inter['latency_us']:g} us per step); activations "
             f"{c['activation_itemsize']} bytes/element, gradients {c['grad_itemsize']}"]  # fmt: skip
    for stack, kinds in c["per_block_forward"].items():
        parts = ", ".join(f"{v['calls']} {k} {_bytes(v['bytes'])}" for k, v in kinds.items())
        lines.append(f"  one {stack} block, forward: {parts}")
    lines.append("  per step (mean over the recycling counts; forward, recycling, recomputation and backward):")
    for key, v in c["per_step_mean"].items():
        lines.append(f"    {key:<24} {_bytes(v['bytes']):>12} in {v['calls']:8.0f} calls")
    lines.append(f"    gradient all-reduce      {_bytes(ar['bytes']):>12} buffer ({c['parameters']:,} parameters), "
                 f"{ar['buckets']} buckets, ring {_bytes(ar['ring_bytes_per_rank'])} per rank; {ar['intra_node_s'] * 1e3:.2f} ms "
                 f"inside the node + {min(ar['inter_node_ring_s'], ar['inter_node_tree_s']) * 1e3:.2f} ms between "
                 f"({ar['inter_node_algorithm']})")  # fmt: skip
    for mode, per_n in c["predicted_step_s"].items():
        m = per_n["mean"]
        lines.append(f"  predicted {card['name']} {mode} step (mean): {m['step_s']:.3f} s = compute {m['compute_s']:.3f} s + "
                     f"exposed communication {m['exposed_s'] * 1e3:.1f} ms (DAP {m['dap_s'] * 1e3:.1f} ms, "
                     f"{m['dap_exposed_s'] * 1e3:.1f} exposed; all-reduce {m['allreduce_s'] * 1e3:.1f} ms, "
                     f"{m['allreduce_exposed_s'] * 1e3:.1f} exposed; host launches {m['host_launch_s'] * 1e3:.1f} ms; "
                     f"{m['launches']:.0f} collective launches)")  # fmt: skip
    return "\n".join(lines)


def _bad(message: str) -> int:
    from scalefold.errors import UserError

    raise UserError(message, label="")  # scalefold estimate-step: <message>, exit 3


__all__ = ["add_common_arguments", "add_parser", "check_arguments", "format_communication", "format_report", "report", "resolve", "train_config"]
