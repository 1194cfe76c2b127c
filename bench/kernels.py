"""Benchmark: ScaleFold's Triton kernels vs PyTorch eager, ``torch.compile`` and (attention) SDPA.

    python bench/kernels.py --kernel attention|layernorm|adam|trimul --shape mlperf|small [--dtype bf16]

This is a GPU benchmark. For every variant it reports the forward and forward+backward time
(attention, LayerNorm) or the step time (Adam+SWA), achieved FLOP/s (attention) or bandwidth
(LayerNorm, Adam) and the peak CUDA memory. Variants:

* attention -- ``triton`` (ours), ``eager`` (``reference.attention``), ``compile``
  (``torch.compile`` of the reference), ``sdpa`` (``F.scaled_dot_product_attention`` with the
  bias + mask as a float ``attn_mask`` that requires grad: the memory-efficient backend computes
  the bias gradient; gate applied outside);
* layernorm -- ``triton``, ``eager`` (``F.layer_norm``), ``compile``;
* adam      -- ``triton`` (one fused kernel), ``eager`` (``reference.adam_swa_``), ``compile``;
* trimul    -- the triangle multiplication (outgoing and incoming): ``triton`` (the fused kernels),
  ``eager`` (``reference.triangle_multiplication``), ``module`` (the model's operators before the fused
  kernel), ``compile``; then triton's speed-up over each, forward and forward+backward.

Without CUDA it says so; ``--shape small`` then runs every variant once on the CPU (the Triton
kernels in the interpreter) as a smoke test -- its timings mean nothing.

MLPerf shapes (crop 256 residues, 128 MSA clusters, c_m 256, c_z 128, bf16):
MSA row attention ``[1, 128, 8, 256, 32]`` + bias ``[1, 1, 8, 256, 256]``; MSA column attention
``[1, 256, 8, 128, 32]``; triangle attention ``[1, 256, 4, 256, 32]`` + bias ``[1, 1, 4, 256, 256]``;
LayerNorm ``[128*256, 256]`` and ``[256*256, 128]``; Adam over 93,229,082 parameters; triangle
multiplication ``z [1, 256, 256, 128]``, c_hidden 128 (the Evoformer's and the extra-MSA stack's) and
``[1, 4, 256, 256, 64]``, c_hidden 64 (the template pair stack's).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scalefold.kernels import reference  # noqa: E402

ATTENTION_SHAPES = {
    # name: (batch, H, N_q, N_k, D, bias shape or None)
    "mlperf": [
        ("msa_row", (1, 128), 8, 256, 256, 32, (1, 1, 8, 256, 256)),
        ("msa_col", (1, 256), 8, 128, 128, 32, None),
        ("triangle", (1, 256), 4, 256, 256, 32, (1, 1, 4, 256, 256)),
    ],
    "small": [("msa_row", (1, 2), 2, 17, 17, 16, (1, 1, 2, 17, 17)), ("msa_col", (1, 2), 2, 5, 5, 8, None)],
}
LAYER_NORM_SHAPES = {"mlperf": [(128 * 256, 256), (256 * 256, 128)], "small": [(100, 96)]}
TRIMUL_SHAPES = {
    # name: (batch, N_res, c_z, c_hidden)
    "mlperf": [("pair", (1,), 256, 128, 128), ("template", (1, 4), 256, 64, 64)],
    "small": [("pair", (1,), 8, 16, 16)],
}
ADAM_NUMEL = {"mlperf": 93_229_082, "small": 5_000}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timeit(fn, iters: int) -> float:
    """Median milliseconds per call (CUDA events on GPU, wall clock on CPU)."""
    if not CUDA:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(5, iters // 4), rep=max(25, iters), return_mode="median")


def peak_memory(fn) -> float:
    """Peak CUDA memory (MiB) allocated during one call, above what was allocated before."""
    if not CUDA:
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def report(kernel: str, case: str, variant: str, ms: float, work: float, unit: str, mem: float) -> None:
    rate = work / (ms * 1e-3) if ms > 0 else float("nan")
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    print(f"{kernel:10s} {case:10s} {variant:8s} {ms:10.3f} ms  {rate / scale:9.2f} {unit:8s} peak {mem:9.1f} MiB")


def bench_attention(shape: str, dtype: torch.dtype, device: str, iters: int) -> None:
    from scalefold.kernels import triton_ops

    compiled = torch.compile(reference.attention)

    def sdpa(q, k, v, bias, mask, gate):
        attn_mask = bias if bias is not None else None
        if mask is not None:
            offset = (mask - 1.0) * 1e9
            attn_mask = offset if attn_mask is None else attn_mask + offset
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return o * torch.sigmoid(gate)

    variants = {
        "triton": triton_ops.attention,
        "eager": reference.attention,
        "compile": compiled,
        "sdpa": sdpa,
    }
    for case, batch, H, NQ, NK, D, bias_shape in ATTENTION_SHAPES[shape]:
        new = dict(device=device, dtype=dtype, requires_grad=True)
        q, k, v = (torch.randn(*batch, H, n, D, **new) for n in (NQ, NK, NK))
        gate = torch.randn(*batch, H, NQ, D, **new)
        bias = torch.randn(*bias_shape, **new) if bias_shape else None
        mask = (torch.rand(*batch, 1, 1, NK, device=device) > 0.1).to(dtype)
        do = torch.randn(*batch, H, NQ, D, device=device, dtype=dtype)
        leaves = [t for t in (q, k, v, bias, gate) if t is not None]
        fwd_flops = 4.0 * math.prod(batch) * H * NQ * NK * D
        for name, fn in variants.items():
            try:
                run_variant("attention", case, name, fn, (q, k, v, bias, mask, gate), leaves, do, iters,
                            fwd_work=fwd_flops, bwd_work=3.5 * fwd_flops, unit="TFLOP/s")  # fmt: skip
            except Exception as exc:  # e.g. SDPA without a backend for this dtype/device
                print(f"attention  {case:10s} {name:8s} failed: {type(exc).__name__}: {str(exc)[:120]}")


def run_variant(kernel, case, name, fn, args, leaves, grad_out, iters, *, fwd_work, bwd_work, unit) -> None:
    """Time forward (no grad) and forward+backward of ``fn(*args)``, compiling/tuning first."""

    def fwd():
        with torch.no_grad():
            fn(*args)

    def fwd_bwd():
        torch.autograd.grad(fn(*args), leaves, grad_out)

    fwd()
    fwd_bwd()
    ms_f, ms_fb = timeit(fwd, iters), timeit(fwd_bwd, iters)
    report(kernel, case, name + ":f", ms_f, fwd_work, unit, peak_memory(fwd))
    report(kernel, case, name + ":fb", ms_fb, bwd_work, unit, peak_memory(fwd_bwd))
    return ms_f, ms_fb


def bench_layer_norm(shape: str, dtype: torch.dtype, device: str, iters: int) -> None:
    from scalefold.kernels import triton_ops

    eager = reference.layer_norm
    variants = {"triton": triton_ops.layer_norm, "eager": eager, "compile": torch.compile(eager)}
    for M, C in LAYER_NORM_SHAPES[shape]:
        x = torch.randn(M, C, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(C, device=device, requires_grad=True)
        b = torch.zeros(C, device=device, requires_grad=True)
        dy = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        for name, fn in variants.items():
            # forward moves x and y; forward + backward at least x, y, x, dy, dx
            run_variant("layernorm", f"{M}x{C}", name, fn, (x, w, b, 1e-5), [x, w, b], dy, iters,
                        fwd_work=2 * nbytes, bwd_work=5 * nbytes, unit="GB/s")  # fmt: skip


def bench_adam(shape: str, dtype: torch.dtype, device: str, iters: int) -> None:
    from scalefold.kernels import triton_ops

    n = ADAM_NUMEL[shape]
    compute_dtype = dtype if dtype != torch.float32 else None
    f32 = dict(device=device, dtype=torch.float32)
    param, m, swa = torch.randn(n, **f32), torch.zeros(n, **f32), torch.randn(n, **f32)
    v = torch.zeros(n, **f32)
    grad = torch.randn(n, device=device, dtype=compute_dtype or torch.float32) * 1e-3
    compute = torch.empty(n, device=device, dtype=compute_dtype) if compute_dtype else None
    scalars = dict(lr=torch.tensor(1e-3, dtype=torch.float64, device=device),
                   step=torch.tensor(10.0, dtype=torch.float64, device=device),
                   clip_scale=torch.tensor(0.5, device=device))  # fmt: skip
    # bytes per parameter: read p, m, v, swa (16) + g; write p, m, v, swa (16) + compute copy
    per_param = 32 + grad.element_size() + (compute.element_size() if compute is not None else 0)
    variants = {
        "triton": triton_ops.adam_swa_update_,
        "eager": reference.adam_swa_,
        "compile": torch.compile(reference.adam_swa_),
    }
    for name, fn in variants.items():
        step = functools.partial(fn, param, grad, m, v, swa, compute, **scalars)
        step()
        report("adam", f"{n}", name, timeit(step, iters), per_param * n, "GB/s", peak_memory(step))


def bench_trimul(shape: str, dtype: torch.dtype, device: str, iters: int) -> None:
    """The triangle multiplication, outgoing and incoming: ``triton`` (the fused kernels), ``eager``
    (``reference.triangle_multiplication``: PyTorch operators, ``F.layer_norm``), ``module`` (the model's
    operators as they ran before the fused kernel: the dispatch point's PyTorch path, Triton LayerNorm on a
    GPU) and ``compile`` (``torch.compile`` of the reference); the last lines give triton's speed-up."""
    from scalefold import kernels
    from scalefold.kernels import triton_ops

    variants = {
        "triton": triton_ops.triangle_multiplication,
        "eager": reference.triangle_multiplication,
        "module": functools.partial(kernels.triangle_multiplication, backend="torch"),
        "compile": torch.compile(reference.triangle_multiplication),
    }
    for case, batch, n, c_z, c in TRIMUL_SHAPES[shape]:
        new = dict(device=device, dtype=dtype)
        z = torch.randn(*batch, n, n, c_z, **new).requires_grad_()
        mask = (torch.rand(*batch, n, n, device=device) > 0.1).to(dtype)
        dims = dict(ln_in=(c_z,), a_p=(c, c_z), a_g=(c, c_z), b_p=(c, c_z), b_g=(c, c_z), g=(c_z, c_z),
                    ln_out=(c,), z=(c_z, c))  # fmt: skip
        tensors = []
        for name, dim in dims.items():
            scale = 1.0 if name.startswith("ln") else dim[-1] ** -0.5
            tensors += [
                (torch.randn(*dim, **new) * scale).requires_grad_(),
                torch.randn(dim[0], **new).requires_grad_(),
            ]
        w = reference.TrimulWeights(*tensors)
        dout = torch.randn_like(z)
        m = math.prod(batch) * n * n
        fwd_flops = 2.0 * m * c_z * (4 * c + c_z) + 2.0 * math.prod(batch) * c * n**3 + 2.0 * m * c * c_z
        for outgoing in (True, False):
            label = f"{case}:{'out' if outgoing else 'in'}"
            times = {}
            for name, fn in variants.items():
                try:
                    times[name] = run_variant("trimul", label, name, fn, (z, mask, w, outgoing), [z, *w], dout,
                                              iters, fwd_work=fwd_flops, bwd_work=3 * fwd_flops, unit="TFLOP/s")  # fmt: skip
                except Exception as exc:  # e.g. torch.compile without a working backend here
                    print(f"trimul     {label:10s} {name:8s} failed: {type(exc).__name__}: {str(exc)[:120]}")
            _trimul_agreement(label, variants, (z, mask, w, outgoing), z, dout)
            for base in ("eager", "module", "compile"):
                if "triton" in times and base in times:
                    (tf, tfb), (bf, bfb) = times["triton"], times[base]
                    print(
                        f"trimul     {label:10s} triton vs {base:7s}: forward x{bf / tf:.2f}, forward+backward x{bfb / tfb:.2f}"
                    )


def _trimul_agreement(label: str, variants: dict, args: tuple, z: torch.Tensor, dout: torch.Tensor) -> None:
    """One line: the fused kernels' output and dz against the eager reference's (max |difference|, and the
    reference's max |value| for scale)."""
    results = []
    for name in ("triton", "eager"):
        out = variants[name](*args)
        results.append((out.detach().float(), torch.autograd.grad(out, z, dout)[0].float()))
    (o, dz), (o_ref, dz_ref) = results
    print(f"trimul     {label:10s} triton vs eager: max|d out| {(o - o_ref).abs().max().item():.3g} "
          f"(max|out| {o_ref.abs().max().item():.3g}), max|d dz| {(dz - dz_ref).abs().max().item():.3g} "
          f"(max|dz| {dz_ref.abs().max().item():.3g})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=["attention", "layernorm", "adam", "trimul"], required=True)
    parser.add_argument("--shape", choices=["mlperf", "small"], default="mlperf")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if CUDA else "fp32")
    parser.add_argument("--iters", type=int, default=100, help="measurement budget (ms) per variant on GPU")
    args = parser.parse_args()
    if CUDA:
        device = "cuda"
        print(f"# device: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}")
    else:
        print("# This is a GPU benchmark: no CUDA device here.")
        if args.shape != "small":
            print("# Run it on a GPU, or pass --shape small for a CPU smoke test (interpreter, timings meaningless).")
            sys.exit(2)
        print("# CPU smoke test: Triton kernels run in the interpreter; the timings below mean nothing.")
        device = "cpu"
        if args.dtype == "bf16":  # the interpreter's bf16 dot is wrong
            args.dtype = "fp32"
    dtype = DTYPES[args.dtype]
    bench = {"attention": bench_attention, "layernorm": bench_layer_norm, "adam": bench_adam,
             "trimul": bench_trimul}[args.kernel]  # fmt: skip
    bench(args.shape, dtype, device, args.iters)


if __name__ == "__main__":
    main()
