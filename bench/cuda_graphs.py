"""Benchmark: training step time, eager vs CUDA-graphed no-grad recycling passes (``--cuda-graphs``).

For each recycling count ``n`` (``0 .. R-1``) times forward (``n`` no-grad passes + the grad pass) +
loss + backward of one synthetic training-shaped batch, through the plain model and through
:class:`scalefold.compilation.graphed_step.GraphedStep` (graphs captured first, as before ``run_start``), and
the no-grad passes alone (eager vs replay). Needs a CUDA device; on CPU it says so and exits 0.

    python bench/cuda_graphs.py [--preset mlperf|demo|tiny] [--crop 256] [--precision bf16] [--steps 5]

Not measured yet (no GPU was available when this was written); record H100/H200 numbers in
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scalefold.compilation.graphed_step import GraphedStep, synthetic_step_batch  # noqa: E402
from scalefold.data.pipeline import FeatureConfig  # noqa: E402
from scalefold.losses import AlphaFoldLoss  # noqa: E402
from scalefold.model import AlphaFold, AlphaFoldConfig  # noqa: E402
from scalefold.model.precision import float_outputs, keep_fp32_regions  # noqa: E402


def timed(fn, steps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls (synchronised)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="demo", help="model preset (mlperf, demo, tiny)")
    ap.add_argument("--crop", type=int, default=None, help="crop size override")
    ap.add_argument("--recycling", type=int, default=3, help="num_recycling_iters (R - 1)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench/cuda_graphs.py: needs CUDA (CUDA graphs capture GPU work); no CUDA device here -- nothing measured"
        )
        return 0

    device = torch.device("cuda")
    overrides = {"num_recycling_iters": args.recycling}
    if args.crop:
        overrides["train_sequence_crop_size"] = args.crop
    cfg = AlphaFoldConfig.from_preset(args.preset, precision=args.precision, overrides=overrides)
    features = FeatureConfig.from_reference_config(cfg.to_dict())
    torch.manual_seed(0)
    model = AlphaFold(cfg, activation_checkpointing=args.activation_checkpointing).to(device).train()
    loss_fn = AlphaFoldLoss(cfg.loss_config)
    autocast = args.precision == "bf16"
    if autocast:  # as the training loop: the structure module and the heads stay fp32
        keep_fp32_regions(model)
    batch = synthetic_step_batch(features, model, device, torch.float32)

    t0 = time.perf_counter()
    step = GraphedStep(model, enabled=True, log=print)
    captured = step.warm_up(batch, autocast=autocast)
    print(f"warm-up (capture of {captured}): {time.perf_counter() - t0:.1f} s")
    if not step.active:
        print(f"graphs off: {step.reason}")
        return 1

    def train_step(forward, b):
        def run():
            model.zero_grad(set_to_none=False)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = forward(b)
            loss, _ = loss_fn(float_outputs(out) if autocast else out, b)
            loss.backward()

        return run

    def nograd(b, n, graphed):
        inputs = step._inputs(b, n)

        def run():
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                if graphed:
                    step.cache(inputs, tag=step._tag(n, "cuda"))
                else:
                    step._nograd_passes(inputs)

        return run

    print(f"preset {args.preset}, crop {features.train_sequence_crop_size}, clusters {features.max_msa_clusters}, "
          f"extra {features.max_extra_msa}, templates {features.max_templates}, {args.precision}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print(f"{'n':>3} {'step eager ms':>14} {'step graphed ms':>16} {'speed-up':>9} {'no-grad eager ms':>17} "
          f"{'replay ms':>10}")  # fmt: skip
    for n in range(features.num_ensembles):
        b = {k: v[..., : n + 1] for k, v in batch.items()}
        eager = timed(train_step(model, b), args.steps)
        graphed = timed(train_step(step, b), args.steps)
        ng = (timed(nograd(b, n, False), args.steps), timed(nograd(b, n, True), args.steps)) if n else (0.0, 0.0)
        print(f"{n:>3} {1e3 * eager:>14.1f} {1e3 * graphed:>16.1f} {eager / graphed:>8.2f}x {1e3 * ng[0]:>17.1f} "
              f"{1e3 * ng[1]:>10.1f}")  # fmt: skip
    print(step.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
