"""Benchmark: one Evoformer block's forward + backward under Dynamic Axial Parallelism.

For each DAP size (default 1, 2, 4) spawns that many processes (gloo on CPU; NCCL with one GPU per
rank when ``--cuda`` and enough GPUs), builds one Evoformer block with the MLPerf model's widths
(c_m 256, c_z 128, 8 MSA heads of 32, OPM 32, tri-mul 128, 4 triangle heads of 32), shards
``(m, z)`` by rows as the stack does, and times forward + backward of the block (median of
``--iters`` after ``--warmup``), with the bytes each rank sent (the collectives' counter) beside
the analytic volume (:func:`scalefold.distributed.volume.evoformer_block_bytes`, forward x 2).

    python bench/dap.py [--n-res 64] [--n-seq 32] [--dap 1 2 4] [--iters 3] [--no-overlap] [--cuda]

The training crop is N_res 256, N_seq 128 (plus 1024 extra-MSA rows in a cheaper stack); the
defaults here are smaller so that a shared CPU box finishes in about a minute.

Measured 2026-11-23 (2-vCPU Intel Xeon VM, torch 2.13.0+cpu, 1 thread per rank, gloo, fp32, the
box shared with ~6 other jobs: load average ~10, so times are noisy), ``python bench/dap.py``
(N_res 64, N_seq 32, full MLPerf widths); bytes are forward + backward of one block:

    dap  fwd+bwd ms  speedup  MB sent/rank  analytic MB   (overlap on)
      1         665     1.00          0.00         0.00
      2         831     0.80         11.01        11.01
      4         983     0.68         11.80        11.80
    ``--no-overlap --dap 2 4``: dap 2 806 ms, dap 4 791 ms (same bytes)

On 2 cores DAP 4 oversubscribes the machine (4 single-threaded ranks on 2 cores) and gloo's
loopback collectives cost CPU time, so no speedup is expected here: the point of this run is the
per-block volume (counter == analytic, 12 collectives forward + 12 backward) and a working
multi-process path. No GPU machine was lent to this task; the paper's anchor is ScaleFold
DAP-2/4/8 = 1.6x/2.4x/2.77x over DAP-1 per training step on H100.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scalefold.distributed.group import DAPGroup  # noqa: E402
from scalefold.distributed.launch import free_port  # noqa: E402
from scalefold.distributed.volume import evoformer_block_bytes  # noqa: E402
from scalefold.model.config import EvoformerStackConfig  # noqa: E402
from scalefold.model.evoformer import EvoformerBlock  # noqa: E402
from scalefold.model.parallel import enter_stack  # noqa: E402

WIDTHS = dict(c_m=256, c_z=128, c_hidden_msa_att=32, c_hidden_opm=32, c_hidden_tri_mul=128, c_hidden_tri_att=32,
              num_heads_msa=8, num_heads_tri=4, transition_n=4)  # fmt: skip


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    use_cuda = args.cuda  # checked in main: one GPU per rank
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        block = EvoformerBlock(EvoformerStackConfig(**WIDTHS, msa_dropout=0.15, pair_dropout=0.25)).to(device).train()
        with torch.no_grad():  # "final" inits are zero: give every path work and gradient
            for p in block.parameters():
                p.add_(0.02 * torch.randn_like(p))
        g = DAPGroup.world(overlap=not args.no_overlap) if world > 1 else None
        m_full = torch.randn(1, args.n_seq, args.n_res, WIDTHS["c_m"], device=device)
        z_full = torch.randn(1, args.n_res, args.n_res, WIDTHS["c_z"], device=device)
        msa_mask = torch.ones(1, args.n_seq, args.n_res, device=device)
        pair_mask = torch.ones(1, args.n_res, args.n_res, device=device)
        dap, m, z = enter_stack(g, m_full, z_full, args.n_seq)
        m, z = m.detach().requires_grad_(), z.detach().requires_grad_()
        times = []
        for it in range(args.warmup + args.iters):
            if g is not None:
                g.stats.reset()
            if use_cuda:
                torch.cuda.synchronize()
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            m_out, z_out = block(m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)
            (m_out.float().square().mean() + z_out.float().square().mean()).backward()
            if use_cuda:
                torch.cuda.synchronize()
            if it >= args.warmup:
                times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
        sent = g.stats.total if g is not None else 0
        if rank == 0:
            results.put((float(t), sent))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-res", type=int, default=64)
    ap.add_argument("--n-seq", type=int, default=32)
    ap.add_argument("--dap", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--no-overlap", action="store_true", help="synchronous collectives (no Duality Async Ops)")
    ap.add_argument("--cuda", action="store_true", help="NCCL, one GPU per rank (needs max(--dap) GPUs)")
    args = ap.parse_args()
    if args.cuda and torch.cuda.device_count() < max(args.dap):
        ap.error(f"--cuda needs max(--dap) = {max(args.dap)} GPUs, {torch.cuda.device_count()} visible")
    ctx = torch.multiprocessing.get_context("spawn")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{'cuda' if args.cuda else 'cpu gloo'}, N_res {args.n_res}, N_seq {args.n_seq}, fp32, "
          f"overlap {'off' if args.no_overlap else 'on'}")  # fmt: skip
    print(f"{'dap':>4} {'fwd+bwd ms':>11} {'speedup':>8} {'MB sent/rank':>13} {'analytic MB':>12}")
    base = None
    for d in args.dap:
        results = ctx.SimpleQueue()
        torch.multiprocessing.start_processes(
            _worker, args=(d, free_port(), args, results), nprocs=d, join=True, start_method="spawn"
        )
        seconds, sent = results.get()
        base = base or seconds
        dims = {k: WIDTHS[k] for k in ("c_m", "c_z", "num_heads_msa", "c_hidden_opm", "c_hidden_tri_mul", "num_heads_tri")}
        analytic = 2 * sum(evoformer_block_bytes(args.n_seq, args.n_res, d, **dims, itemsize=4).values())
        print(f"{d:>4} {seconds * 1e3:>11.0f} {base / seconds:>8.2f} {sent / 1e6:>13.2f} {analytic / 1e6:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
