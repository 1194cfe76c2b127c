"""``scalefold plan``: predicted time to train on N cards of one type, its breakdown, and (without a layout) the
best layouts for that many cards. The work is in :mod:`scalefold.perf.plan` (the time to train),
:mod:`scalefold.perf.layout_model` (the step at a layout) and :mod:`scalefold.perf.cluster` (cards and links);
this module parses and prints."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="predict the time to train (MLPerf's run_start -> run_stop) on N cards; without --dap, the best layouts",
        description="Predict MLPerf OpenFold's time to train on --count cards of type --card: the step at the layout "
        "(the step-time model per card, scalefold/perf/step_time.py, plus DAP's, BP's and the gradient all-reduce's "
        "communication on the card's NVLink/PCIe and InfiniBand, scalefold/perf/comm.py), the steps to lDDT-Ca 0.8 "
        "as a function of the global batch, the evaluation cadence (every 40 steps) and latency; calibrated on "
        "NVIDIA's two MLPerf HPC v3.0 runs (scalefold/perf/plan.py). Without --dap, ranks the layouts for that many "
        "cards. The first plan of a DAP size counts its step on fake tensors (minutes at MLPerf shapes; kept in "
        "~/.cache/scalefold/plan).",
    )  # fmt: skip
    p.add_argument("--card", required=True, help="h100, h200, a100-sxm, a100-pcie or b200")
    p.add_argument("--count", type=int, required=True, help="cards in the cluster")
    p.add_argument("--intra-link", help="the link inside a node instead of the card's (nvlink3, nvlink4, nvlink5, pcie4, pcie5)")
    p.add_argument("--inter-link", help="the link between nodes instead of the card's (ib-hdr, ib-ndr, ib-xdr)")
    p.add_argument("--dap", type=int, help="DAP size (1, 2, 4, 8; dividing the GPUs per node); without it, the best layouts")
    p.add_argument("--bp", type=int, default=1, help="branch parallelism: 1 or 2 (the Parallel Evoformer; default 1)")
    p.add_argument("--eval-ranks", type=int,
                   help="cards that evaluate asynchronously; 0: evaluation on the training ranks (synchronous). "
                   "Default with --dap: 32 where at least 256 cards, else 0")  # fmt: skip
    p.add_argument("--batch", type=int, help="global batch (default: one sample per data-parallel replica)")
    p.add_argument("--crop", type=int, default=256, help="crop size (default 256, MLPerf's)")
    p.add_argument("--recycling", type=int, help="recycling iterations (0..R drawn per step; default: the preset's, MLPerf 3)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="default bf16")
    p.add_argument("--preset", default="mlperf", help="training preset whose model is planned (default mlperf)")
    p.add_argument("--mode", choices=("graphed", "eager"), default="graphed",
                   help="the step as whole-step CUDA graphs or eager (default graphed)")  # fmt: skip
    p.add_argument("--step-seconds", type=float, help="a measured training step (seconds) instead of the predicted one")
    p.add_argument("--top", type=int, default=5, help="layouts listed without --dap (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_run)


def _check(args: argparse.Namespace) -> None:
    from scalefold.errors import UserError, require_range

    require_range(args.count, "--count", 1)
    require_range(args.crop, "--crop", 1)
    require_range(args.recycling, "--recycling", 0)
    require_range(args.top, "--top", 1)
    if args.step_seconds is not None and not args.step_seconds > 0:
        raise UserError(f"--step-seconds {args.step_seconds:g}: must be > 0")
    if args.step_seconds is not None and args.dap is None:
        raise UserError("--step-seconds needs --dap: a measured step is the step of one layout")
    if args.bp != 1 and (args.dap is None or args.step_seconds is None):
        raise UserError("--bp 2 needs --dap and --step-seconds: the step-time model counts no branch-parallel step")


def _config(args: argparse.Namespace) -> Any:
    from scalefold.config.training import TrainConfig

    overrides = {"precision": args.precision, "crop_size": args.crop, "num_recycling_iters": args.recycling}
    return TrainConfig.from_preset(args.preset, overrides={k: v for k, v in overrides.items() if v is not None}, env={})


def _run(args: argparse.Namespace) -> int:
    from scalefold.errors import UserError
    from scalefold.perf.cluster import card as card_named
    from scalefold.perf.cluster import with_links

    _check(args)
    card = with_links(card_named(args.card), args.intra_link, args.inter_link)
    try:
        out = _plan(args, card)
    except UserError:
        raise
    except ValueError as exc:  # an option the model cannot take (a preset's shapes, a policy)
        raise UserError(str(exc)) from exc
    out["ttt_minutes"] = out["plan"]["ttt_minutes"] if out["plan"] else None
    print(json.dumps(out, indent=1) if args.json else format_plan(out))
    return 0


def _plan(args: argparse.Namespace, card: Any) -> dict[str, Any]:
    from scalefold.perf.layout_model import Layout, validate_layout
    from scalefold.perf.plan import best_layouts, plan_layout

    if args.dap is not None:
        eval_ranks = args.eval_ranks if args.eval_ranks is not None else (32 if args.count >= 256 else 0)
        layout = validate_layout(Layout(args.count, args.dap, args.bp, eval_ranks, args.batch), card, args.crop)
        return {"plan": plan_layout(_config(args), card, layout, args.mode, args.step_seconds)}
    plans = best_layouts(_config(args), card, args.count, args.crop, args.mode, args.batch, args.bp, args.top,
                         eval_ranks=args.eval_ranks)  # fmt: skip
    return {"plan": plans[0] if plans else None, "best_layouts": plans}


def format_plan(out: dict[str, Any]) -> str:
    """The readable breakdown of a plan (and the ranked layouts)."""
    p = out["plan"]
    if p is None:
        return "no layout of these cards fits the calibrated batch range 128..256"
    lay, b = p["layout"], p["breakdown"]
    lines = [f"{lay['cards']} x {p['card']}: DAP {lay['dap']} x BP {lay['bp']} x DP {lay['dp']} = {lay['train_ranks']} "
             f"training ranks + {lay['eval_ranks']} evaluating ({'asynchronous' if lay['eval_ranks'] else 'synchronous'} "
             f"evaluation), global batch {lay['global_batch']}",
             f"time to train (run_start -> run_stop): {p['ttt_minutes']:.2f} min; init before it {p['init_minutes']:.1f} min "
             f"(NVIDIA's, not modelled)",
             f"  {b['steps']} steps to lDDT-Ca 0.8{' (batch outside 128..256: extrapolated)' if p['batch_extrapolated'] else ''} "
             f"x {b['step_s']:.3f} s ({p['step_source'] + (', ' + p['mode'] if p['step_source'] == 'predicted' else '')}) "
             f"= {b['train_s']:.1f} s",
             f"  startup {b['startup_s']:.1f} s, first cycle's warm-up {b['warmup_s']:.1f} s, hand-over between cycles "
             f"{b['handover_s']:.1f} s",
             f"  waiting on evaluation {b['eval_wait_s']:.1f} s (an evaluation {b['eval_s']:.1f} s, the first {b['first_eval_s']:.1f} s), "
             f"last evaluation's latency {b['last_eval_latency_s']:.1f} s"]  # fmt: skip
    if "predicted_step" in p:
        for mode, m in p["predicted_step"].items():
            lines.append(f"  predicted step, {mode}: {m['step_s']:.3f} s = compute {m['compute_s']:.3f} s + exposed "
                         f"communication {m['exposed_s'] * 1e3:.1f} ms (DAP {m['dap_exposed_s'] * 1e3:.1f}, gradient "
                         f"all-reduce {m['allreduce_exposed_s'] * 1e3:.1f}, host launches {m['host_launch_s'] * 1e3:.1f})")  # fmt: skip
    if out.get("best_layouts"):
        lines += ["", f"{'best layouts':<14}{'DAP':>5}{'BP':>4}{'DP':>6}{'eval':>6}{'batch':>7}{'cards':>7}{'step s':>9}{'TTT min':>9}"]
        for q in out["best_layouts"]:
            ql = q["layout"]
            lines.append(f"{'':<14}{ql['dap']:>5}{ql['bp']:>4}{ql['dp']:>6}{ql['eval_ranks']:>6}{ql['global_batch']:>7}"
                         f"{ql['cards']:>7}{q['breakdown']['step_s']:>9.3f}{q['ttt_minutes']:>9.2f}"
                         f"{'  * batch outside 128..256 (extrapolated)' if q['batch_extrapolated'] else ''}")  # fmt: skip
        lines.append("  (ranked by predicted time to train, layouts whose batch is within the calibrated 128..256 first)")
    return "\n".join(lines)


__all__ = ["add_parsers", "format_plan"]
