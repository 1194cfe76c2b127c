"""Benchmark (GPU): the fused outer product mean and the Evoformer's attentions beside their PyTorch paths.

    python bench/fusions.py [--iters 50] [--shape mlperf|small]

One run, one card (named in the first line). At the MLPerf shapes (crop 256, 128 MSA rows, c_m 256,
c_z 128, bf16 autocast over fp32 parameters, as training runs them) it times each module's forward +
backward on both paths of the one dispatch point (``SCALEFOLD_KERNELS=triton``: the fused outer product mean
(``kernels.outer_product_mean``) and the attentions with their projections fused (``kernels.projections``)
and the Triton attention kernel; ``torch``: the reference's operators), and prints per module the median
milliseconds, the peak memory, the speed-up, and the agreement of the two paths (max |difference| of the
output and of the input's gradient, against the reference's max |value|):

* ``opm``       -- ``OuterProductMean(256, 128, 32)`` on ``m [1, 128, 256, 256]``;
* ``opm_extra`` -- the extra-MSA stack's: ``OuterProductMean(64, 128, 32)`` on ``[1, 1024, 256, 64]``;
* ``msa_row``   -- ``MSARowAttentionWithPairBias(256, 128, 32, 8)``;
* ``msa_col``   -- ``MSAColumnAttention(256, 32, 8)``;
* ``tri_start`` / ``tri_end`` -- ``TriangleAttention{Starting,Ending}Node(128, 32, 4)``.

Without CUDA it says so and exits 2; ``--shape small`` then runs every module once on the CPU (the Triton
kernels in the interpreter, fp32) as a smoke test: its timings mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import timeit  # noqa: E402  (bench/kernels.py: median of CUDA-event timings)
from scalefold.model.msa_attention import MSAColumnAttention, MSARowAttentionWithPairBias  # noqa: E402
from scalefold.model.outer_product_mean import OuterProductMean  # noqa: E402
from scalefold.model.triangle import TriangleAttentionEndingNode, TriangleAttentionStartingNode  # noqa: E402

#: (S, N, c_m, c_z, extra-MSA S, c_e)
SHAPES = {"mlperf": (128, 256, 256, 128, 1024, 64), "small": (5, 6, 16, 16, 7, 8)}


def modules(shape: str, device: str) -> dict:
    s, n, cm, cz, se, ce = SHAPES[shape]
    hid = 32 if shape == "mlperf" else 4

    def rand(*size):
        return torch.randn(*size, device=device)

    m, z, me = rand(1, s, n, cm), rand(1, n, n, cz), rand(1, se, n, ce)
    msa_mask = (torch.rand(1, s, n, device=device) > 0.05).float()
    extra_mask = (torch.rand(1, se, n, device=device) > 0.05).float()
    pair_mask = torch.ones(1, n, n, device=device)
    heads = 8 if shape == "mlperf" else 2
    return {
        "opm": (OuterProductMean(cm, cz, hid), (m,), (msa_mask,)),
        "opm_extra": (OuterProductMean(ce, cz, hid), (me,), (extra_mask,)),
        "msa_row": (MSARowAttentionWithPairBias(cm, cz, hid, heads), (m, z), (msa_mask,)),
        "msa_col": (MSAColumnAttention(cm, hid, heads), (m,), (msa_mask,)),
        "tri_start": (TriangleAttentionStartingNode(cz, hid, heads // 2), (z,), (pair_mask,)),
        "tri_end": (TriangleAttentionEndingNode(cz, hid, heads // 2), (z,), (pair_mask,)),
    }


def run(module, inputs, masks, dtype, path: str):
    """One forward + backward on ``path``: (output, the first input's gradient)."""
    os.environ["SCALEFOLD_KERNELS"] = path
    leaves = [t.detach().requires_grad_() for t in inputs]
    with torch.autocast(leaves[0].device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = module(*leaves, *masks)
    out.float().square().mean().backward()
    return out.detach().float(), leaves[0].grad.float()


def bench(name, module, inputs, masks, dtype, iters: int) -> None:
    times, peaks, results = {}, {}, {}
    for path in ("torch", "triton"):
        try:
            results[path] = run(module, inputs, masks, dtype, path)  # compiles / tunes first
            if CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times[path] = timeit(lambda: run(module, inputs, masks, dtype, path), iters)
            peaks[path] = torch.cuda.max_memory_allocated() / 2**20 if CUDA else float("nan")
            print(f"{name:10s} {path:7s} forward+backward {times[path]:9.3f} ms  peak {peaks[path]:9.1f} MiB", flush=True)
        except Exception as exc:  # report and go on with the other modules
            print(f"{name:10s} {path:7s} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    if len(results) == 2:
        (o, g), (o_ref, g_ref) = results["triton"], results["torch"]
        print(f"{name:10s} triton vs torch: x{times['torch'] / times['triton']:.2f}; max|d out| "
              f"{(o - o_ref).abs().max().item():.3g} (max|out| {o_ref.abs().max().item():.3g}), max|d grad| "
              f"{(g - g_ref).abs().max().item():.3g} (max|grad| {g_ref.abs().max().item():.3g})", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mlperf")
    parser.add_argument("--iters", type=int, default=50, help="measurement budget (ms) per variant on GPU")
    parser.add_argument("--module", action="append", help="only these modules (repeatable; default all)")
    args = parser.parse_args()
    if CUDA:
        device, dtype = "cuda", torch.bfloat16
        print(f"# device: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 autocast", flush=True)
    else:
        print("# This is a GPU benchmark: no CUDA device here.")
        if args.shape != "small":
            print("# Run it on a GPU, or pass --shape small for a CPU smoke test (interpreter, timings meaningless).")
            sys.exit(2)
        print("# CPU smoke test: Triton kernels run in the interpreter, fp32; the timings below mean nothing.")
        device, dtype = "cpu", torch.float32
    torch.manual_seed(0)
    for name, (module, inputs, masks) in modules(args.shape, device).items():
        if args.module and name not in args.module:
            continue
        module = module.to(device)
        with torch.no_grad():  # non-trivial weights (the final / gating inits are zeros and ones)
            for p in module.parameters():
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        bench(name, module, inputs, masks, dtype, args.iters)


if __name__ == "__main__":
    main()
