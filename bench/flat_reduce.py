"""Benchmark: the data-parallel gradient reduction, DDP (``--grad-reduce ddp``) vs the optimizer's flat buffers
(``--grad-reduce flat``: :class:`scalefold.optim.flat_reduce.FlatGradReducer`, overlapped with backward or after
it), on gloo processes (CPU), one thread per rank.

Two measurements per run, every rank doing the same:

* ``step``: the whole training step (:meth:`scalefold.train.step.TrainingStep.compute`, the Trainer's step:
  forward, loss, backward with the reduction, clip, agreement, Adam + SWA) on the preset's synthetic batch
  with ``n`` no-grad recycling passes (default 0), each path built as the Trainer builds it;
* ``reduce``: backward + reduction + clip alone on a synthetic "model" with the parameter shapes of
  ``--layout-preset`` (default ``mlperf``: 93 M parameters, 4,600+ tensors) whose backward is one elementwise
  product per parameter: the reduction-bound case, where the copies DDP makes and the bucket sizes matter.

Timings are the median over ``--rounds`` rounds, the paths interleaved within each round (a busy box drifts);
launches are counted once per path on an untimed step: the all-reduces of the gradients (``collectives``)
and every operator dispatched from the start of backward to the clip result (``ops``, the reduction's
share is the difference to ``local``: the same backward and clip with no reduction).

    python bench/flat_reduce.py [--presets tiny demo] [--ranks 2] [--steps 3] [--rounds 5]
                                [--layout-preset mlperf] [--no-layout]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scalefold.config.training import TrainConfig  # noqa: E402
from scalefold.distributed.launch import run_processes  # noqa: E402
from scalefold.optim.adam_swa import FlatAdamSWA  # noqa: E402
from scalefold.optim.clipping import GradClipper  # noqa: E402
from scalefold.optim.flat_reduce import FlatGradReducer  # noqa: E402
from scalefold.train.step import TrainingStep  # noqa: E402

PATHS = ("ddp", "flat", "flat-after")
_FLAT_OVERLAP: list = [None]  # the last flat reducer _wire built (the reduce-only case toggles its overlap)


class _Ops(TorchDispatchMode):
    """Counts dispatched operators, and the all-reduces on the storage of ``buffers``."""

    def __init__(self, buffers: list[torch.Tensor] | None) -> None:
        super().__init__()
        self.storages = None if buffers is None else {b.untyped_storage().data_ptr() for b in buffers}
        self.ops = self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops += 1
        if "allreduce" in str(func):
            tensor = args[0][0]
            # DDP reduces its own bucket tensors: every all-reduce that is not the model's own counts there
            self.collectives += 1 if self.storages is None or tensor.untyped_storage().data_ptr() in self.storages else 0
        return func(*args, **(kwargs or {}))


def _wire(path: str, model: torch.nn.Module, opt: FlatAdamSWA, group) -> tuple[torch.nn.Module, object, GradClipper]:
    """``(net, reduce, clipper)`` of ``path`` as the Trainer wires them (no DAP/BP here: no factors)."""
    clipper = GradClipper(process_group=group)
    if path == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=False)
        clipper.register(net)
        return net, clipper.compute, clipper
    if path == "local":
        return model, lambda: clipper.clip_flat_(opt.grad_buffers()), clipper
    reducer = FlatGradReducer(opt, group, overlap=path == "flat")
    reducer.broadcast_parameters()
    _FLAT_OVERLAP[0] = reducer
    return model, lambda: reducer.reduce_and_clip(clipper), clipper


def _order(k: int) -> tuple[str, ...]:
    """Round ``k``'s order of the paths: reversed every other round (no path always runs first on a busy box)."""
    return PATHS if k % 2 == 0 else PATHS[::-1]


def _timed(fn, steps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _count(path: str, backward, reduce, buffers: list[torch.Tensor]) -> dict:
    with _Ops(None if path == "ddp" else buffers) as ops:
        backward()
        reduce()
    return {"ops": ops.ops, "collectives": ops.collectives if path != "local" else 0}


def _step_bench(preset: str, n: int, steps: int, rounds: int) -> dict:
    cfg = TrainConfig.from_preset(preset, env={})
    world = dist.get_world_size()
    built = {}
    for path in (*PATHS, "local"):
        step = TrainingStep.build(cfg)  # same seed: the same model and batch on every rank
        net, reduce, clipper = _wire(path, step.model, step.opt, None)
        step.model, step.reduce, step.clipper, step.world_size = net, reduce, clipper, world
        built[path] = step
    batch = {p: s.sliced(n) for p, s in built.items()}

    def run(path):
        s = built[path]
        s.settle(s.compute(batch[path]).read(world))

    def phase(path):  # backward + reduction + clip alone, both ranks starting together
        s = built[path]
        s.opt.zero_grad()
        loss, _ = s.forward_loss(batch[path])
        dist.barrier()
        t0 = time.perf_counter()
        s.backward(loss)
        s.clip().grad_norm.item()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {p: [] for p in PATHS}
    phases: dict[str, list[float]] = {p: [] for p in PATHS}
    for path in PATHS:  # warm-up
        run(path)
    for k in range(rounds):
        for path in _order(k):
            times[path].append(_timed(lambda path=path: run(path), steps))
            phases[path].append(statistics.median(phase(path) for _ in range(steps)))
    counts = {}
    for path in (*PATHS, "local"):
        s = built[path]
        s.opt.zero_grad()
        torch.manual_seed(1)
        loss, _ = s.forward_loss(batch[path])
        reduce = s.reduce if path != "local" else (lambda s=s: s.clipper.clip_flat_(s.opt.grad_buffers()))
        if path == "local":  # its first clip allocates the accumulator: not the reduction's
            reduce()
        counts[path] = _count(path, loss.backward, reduce, s.opt.grad_buffers())
    return {"what": f"step {preset} n={n}", "params": built["ddp"].opt.num_params,
            "median_s": {p: statistics.median(t) for p, t in times.items()}, "all_s": times, "counts": counts,
            "phase_median_s": {p: statistics.median(t) for p, t in phases.items()}, "phase_all_s": phases}  # fmt: skip


def _layout_shapes(preset: str) -> list[torch.Size]:
    from scalefold.model.factory import build_model, build_model_config

    cfg = TrainConfig.from_preset(preset, env={})
    with torch.device("meta"):
        model = build_model(cfg, build_model_config(cfg), torch.device("meta"), torch.float32)
    return [p.shape for p in model.parameters()]


class _Layout(torch.nn.Module):
    """Parameters of the given shapes; ``forward(scale)`` = sum of ``(p * x_p * scale).sum()``: backward is one
    product per parameter, in reverse order."""

    def __init__(self, shapes: list[torch.Size], xs: list[torch.Tensor]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])
        self.xs = xs

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum((p * (x * scale)).sum() for p, x in zip(self.ps, self.xs))


def _layout_bench(preset: str, steps: int, rounds: int) -> dict:
    """DDP and one flat reducer (its overlap off for ``flat-after``, its reduction skipped for ``local``),
    interleaved. Each holds a 93 M-element optimizer at the MLPerf layout (five buffers of 373 MB)."""
    shapes = _layout_shapes(preset)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen) for s in shapes]
    scale = torch.tensor(1.0 + dist.get_rank())  # different gradients per rank
    built = {}
    for path in ("ddp", "flat"):
        model = _Layout(shapes, xs)
        opt = FlatAdamSWA(list(model.named_parameters()))
        built[path] = (*_wire(path, model, opt, None), opt)
    reducer = _FLAT_OVERLAP[0]
    local_clipper = GradClipper()

    def backward(path):
        net, _, _, opt = built["ddp" if path == "ddp" else "flat"]
        if path != "ddp":
            reducer.set_overlap(path == "flat")
        opt.zero_grad()
        net(scale).backward()

    def reduce(path):
        if path == "local":
            return local_clipper.clip_flat_(built["flat"][3].grad_buffers())
        return built["ddp" if path == "ddp" else "flat"][1]()

    def run(path):
        backward(path)
        reduce(path)

    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for path in PATHS:
        run(path)
    for k in range(rounds):
        for path in _order(k):
            times[path].append(_timed(lambda path=path: run(path), steps))
    reduce("local")  # its first clip allocates the accumulator: not the reduction's
    counts = {p: _count(p, lambda p=p: backward(p), lambda p=p: reduce(p), built["flat"][3].grad_buffers())
              for p in (*PATHS, "local")}  # fmt: skip
    diffs = {}
    for path in ("flat", "flat-after"):
        run("ddp")
        run(path)
        got, ref = torch.cat(built["flat"][3].grad_buffers()), torch.cat(built["ddp"][3].grad_buffers())
        diffs[path] = (got - ref).abs().max().item()
    return {"what": f"reduce-only, {preset} layout", "params": int(sum(x.numel() for x in xs)), "tensors": len(shapes),
            "median_s": {p: statistics.median(t) for p, t in times.items()}, "all_s": times, "counts": counts,
            "max_abs_diff_vs_ddp": diffs}  # fmt: skip


def _worker(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    results = [_step_bench(p, args.n, args.steps, args.rounds) for p in args.presets]
    if args.layout_preset:
        results.append(_layout_bench(args.layout_preset, args.layout_steps, args.rounds))
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="*", default=["tiny", "demo"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--n", type=int, default=0, help="no-grad recycling passes of the timed steps")
    ap.add_argument("--steps", type=int, default=3, help="steps per timing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layout-preset", default="mlperf", help="parameter layout of the reduce-only case ('' : off)")
    ap.add_argument("--layout-steps", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        run_processes(_worker, args.ranks, args, out)
        results = json.loads(Path(out).read_text())
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), torch {torch.__version__}, "
          f"gloo, {args.ranks} ranks x 1 thread")  # fmt: skip
    for r in results:
        print(f"\n{r['what']} ({r['params']:,} parameters)")
        ddp, pddp = r["median_s"]["ddp"], r.get("phase_median_s", {}).get("ddp")
        for path in (*PATHS, "local"):
            c = r["counts"][path]
            t = r["median_s"].get(path)
            timing = f"{t * 1e3:9.1f} ms  x{t / ddp:5.2f}  min {min(r['all_s'][path]) * 1e3:8.1f}" if t is not None else " " * 37
            if pddp is not None:
                pt = r["phase_median_s"].get(path)
                timing += f"   bwd+reduce {pt * 1e3:7.1f} ms x{pt / pddp:5.2f}" if pt is not None else " " * 29
            extra = c["ops"] - r["counts"]["local"]["ops"]
            print(f"  {path:10s} {timing}   all-reduces {c['collectives']:3d}   ops bwd..clip {c['ops']:6d} "
                  f"(reduction's {extra:+d})")  # fmt: skip
        if "max_abs_diff_vs_ddp" in r:
            print(f"  max |flat - ddp| of the reduced gradients: {r['max_abs_diff_vs_ddp']}")
    print("\nraw:", json.dumps(results))


if __name__ == "__main__":
    main()
