"""The anchor kernels beside ours: NVIDIA's cuEquivariance triangle kernels, ScaleFold's Triton kernels and the
PyTorch reference, forward + backward at MLPerf shapes, one table, one process.

    python bench/anchor_kernels.py [--crop 256] [--dtype bf16] [--iters 50]

Four cases at crop 256 (c_z 128; bf16 by default): triangle multiplication outgoing and incoming (c_hidden 128,
the Evoformer's) and triangle attention around the starting and the ending node (4 heads x 32, the pair bias,
the row mask and the sigmoid gate; the ending node's inputs built from the transposed pair, as the model does).
Per case and implementation: the output and every input gradient checked first against the PyTorch reference
computed in float32 from the same values (max |difference| over max |reference|, <= 3e-2 to be timed; the bf16
reference's own error printed for scale), then forward + backward timed (``triton.testing.do_bench``, median)
and the peak memory above the inputs.

* ``reference``  -- ``scalefold.kernels.reference`` (PyTorch operators) in ``--dtype``;
* ``scalefold``  -- ``scalefold.kernels.triton_ops`` (the fused Triton kernels the model dispatches to);
* ``cuequivariance`` -- ``cuequivariance_torch.triangle_multiplicative_update`` (ScaleFold's weights mapped
  onto its ``p_in`` = [a_p; b_p], ``g_in`` = [a_g; b_g], ``p_out`` = linear_z, ``g_out`` = linear_g) and
  ``cuequivariance_torch.triangle_attention`` (its layout [B, N, H, Q, D] is the model's; the gate applied
  after it with PyTorch operators: its kernel has none).

cuEquivariance is an optional extra, never a dependency of the default install: ``pip install
'scalefold[cueq]'`` (``cuequivariance-torch`` + ``cuequivariance-ops-torch-cu12``; CUDA 13: the ``-cu13``
ops wheel) where an index is reachable, else its wheels carried and installed with ``pip --no-index``. Where it
is not installed, or there is no CUDA device, one line says so (no CUDA: nothing is timed, exit 0).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOLERANCE = 3e-2  # relative, bf16 against the float32 reference (the GPU attention probe's bound)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cuequivariance() -> tuple[object | None, str]:
    """``(cuequivariance_torch or None, what was found)``."""
    try:
        import cuequivariance_torch as cuet
    except Exception as exc:  # noqa: BLE001 -- absent, or its ops wheel does not load: said in one line
        return None, f"not installed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return cuet, f"cuequivariance_torch {getattr(cuet, '__version__', '?')}"


def trimul_case(n: int, c_z: int, c: int, dtype: torch.dtype, outgoing: bool, cuet,
                device: str = "cuda") -> tuple[list, dict]:  # fmt: skip
    """Leaves and ``{implementation: fn(*leaves) -> output}`` of the triangle multiplication."""
    from scalefold.kernels import reference, triton_ops

    dev = dict(device=device, dtype=dtype)
    z = torch.randn(1, n, n, c_z, **dev)
    mask = (torch.rand(1, n, n, device=device) > 0.1).to(dtype)
    dims = dict(ln_in=(c_z,), a_p=(c, c_z), a_g=(c, c_z), b_p=(c, c_z), b_g=(c, c_z), g=(c_z, c_z),
                ln_out=(c,), z=(c_z, c))  # fmt: skip
    weights = []
    for name, dim in dims.items():
        scale = 1.0 if name.startswith("ln") else dim[-1] ** -0.5
        weights += [torch.randn(*dim, **dev) * scale + (1.0 if name.startswith("ln") else 0.0),
                    torch.randn(dim[0], **dev) * 0.1]  # fmt: skip
    leaves = [z, *weights]

    def ours(fn):
        return lambda z, *w: fn(z, mask, reference.TrimulWeights(*w), outgoing)

    impls = {"reference": ours(reference.triangle_multiplication), "scalefold": ours(triton_ops.triangle_multiplication)}
    if cuet is not None:
        impls["cuequivariance"] = lambda z, *w: _cueq_trimul(cuet, z, mask, reference.TrimulWeights(*w), outgoing)
    return leaves, impls


def _cueq_trimul(cuet, z, mask, w, outgoing: bool) -> torch.Tensor:
    """ScaleFold's weights mapped onto cuEquivariance's fused triangle multiplicative update (in the timed region:
    two small concatenations, the price of the mapping)."""
    return cuet.triangle_multiplicative_update(
        z, direction="outgoing" if outgoing else "incoming", mask=mask,
        norm_in_weight=w.ln_in_w, norm_in_bias=w.ln_in_b,
        p_in_weight=torch.cat([w.a_p_w, w.b_p_w]), p_in_bias=torch.cat([w.a_p_b, w.b_p_b]),
        g_in_weight=torch.cat([w.a_g_w, w.b_g_w]), g_in_bias=torch.cat([w.a_g_b, w.b_g_b]),
        norm_out_weight=w.ln_out_w, norm_out_bias=w.ln_out_b, p_out_weight=w.z_w, p_out_bias=w.z_b,
        g_out_weight=w.g_w, g_out_bias=w.g_b, eps=1e-5,
    )  # fmt: skip


def attention_case(n: int, heads: int, d: int, dtype: torch.dtype, starting: bool, cuet,
                   device: str = "cuda") -> tuple[list, dict]:  # fmt: skip
    """Leaves (the projections q, k, v, gate ``[1, N, N, H*D]`` and the bias ``[1, N, N, H]``, of the pair or, for
    the ending node, of its transpose) and ``{implementation: fn(*leaves) -> output [1, N, H, N, D]}``."""
    from scalefold.kernels import reference, triton_ops

    dev = dict(device=device, dtype=dtype)
    pair = torch.randn(1, n, n, heads * d * 4 + heads, **dev)
    mask = (torch.rand(1, n, n, device=device) > 0.1).to(dtype)
    if not starting:  # the model's ending node: the transposed pair and mask
        pair, mask = pair.transpose(-2, -3), mask.transpose(-1, -2)
    q, k, v, g, b = (t.contiguous() for t in pair.split([heads * d] * 4 + [heads], dim=-1))
    row_mask = mask[..., :, None, None, :]  # [1, N_i, 1, 1, N_k]

    def heads_(x):  # [1, N_i, N_j, H*D] -> [1, N_i, H, N_j, D], the model's view
        return x.view(x.shape[:-1] + (heads, d)).transpose(-2, -3)

    def ours(fn):
        return lambda q, k, v, g, b: fn(heads_(q), heads_(k), heads_(v), bias=b.movedim(-1, -3).unsqueeze(-4),
                                        mask=row_mask, gate=heads_(g))  # fmt: skip

    impls = {"reference": ours(reference.attention), "scalefold": ours(triton_ops.attention)}
    if cuet is not None:
        def cueq(q, k, v, g, b):
            o = cuet.triangle_attention(heads_(q), heads_(k), heads_(v), b.movedim(-1, -3).unsqueeze(-4),
                                        mask=row_mask.bool())  # fmt: skip
            return o * torch.sigmoid(heads_(g))

        impls["cuequivariance"] = cueq
    return [q, k, v, g, b], impls


def check(fn: Callable, leaves: list, want: list[torch.Tensor]) -> float:
    """The largest relative error (max |difference| / max |reference|) of the output and every input gradient."""
    xs = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, _grad_out(out))
    got = [out, *grads]
    return max(float((a.detach().float() - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want))


def _grad_out(out: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=out.device).manual_seed(1)
    return torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32).to(out.dtype)


def reference_fp32(fn: Callable, leaves: list) -> list[torch.Tensor]:
    """The float32 truth: the reference implementation on the leaves' values upcast, output and gradients."""
    xs = [t.detach().float().requires_grad_() for t in leaves]
    out = fn(*xs)
    grad = _grad_out(out.to(leaves[0].dtype)).float()
    return [out.detach(), *torch.autograd.grad(out, xs, grad)]


def time_fwd_bwd(fn: Callable, leaves: list, iters: int) -> tuple[float, float]:
    """(median ms of forward + backward, peak MiB above the inputs)."""
    import triton.testing

    xs = [t.detach().clone().requires_grad_() for t in leaves]
    grad = _grad_out(fn(*xs))

    def step():
        torch.autograd.grad(fn(*xs), xs, grad)

    step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=max(5, iters // 4), rep=max(25, iters), return_mode="median")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(label: str, leaves: list, impls: dict, iters: int) -> list[str]:
    """One case's rows: each implementation checked against the float32 reference, then timed if it agrees."""
    want = reference_fp32(impls["reference"], leaves)
    rows, base = [], None
    for name, fn in impls.items():
        try:
            err = check(fn, leaves, want)
            if not err <= TOLERANCE:
                rows.append(f"{label:<22} {name:<15} {'-':>9} {'-':>9} {'-':>8} {err:>9.2e}  disagrees with the reference: not timed")
                continue
            ms, mib = time_fwd_bwd(fn, leaves, iters)
        except Exception as exc:  # noqa: BLE001 -- one implementation failing leaves the others' rows
            rows.append(f"{label:<22} {name:<15} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}")
            continue
        base = ms if name == "reference" else base
        speed = f"x{base / ms:.2f}" if base else "-"
        rows.append(f"{label:<22} {name:<15} {ms:>9.3f} {mib:>9.1f} {speed:>8} {err:>9.2e}")
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    cuet, found = cuequivariance()
    if not torch.cuda.is_available():
        print(f"anchor_kernels: cuEquivariance not available here: no CUDA device (cuEquivariance: {found}); nothing "
              "timed -- run it on a GPU machine (bench/gpu_session.sh PARTS=bench_anchor)")  # fmt: skip
        return 0
    if cuet is None:
        print(f"anchor_kernels: cuEquivariance {found}: its column is left out (pip install 'scalefold[cueq]', or its "
              "wheels carried: pip install --no-index cuequivariance_torch-*.whl cuequivariance_ops_torch_*.whl)")  # fmt: skip
    dtype, n = DTYPES[args.dtype], args.crop
    print(f"anchor_kernels on {torch.cuda.get_device_name()}, crop {n}, {args.dtype}; cuEquivariance: {found}")
    header = (f"{'case':<22} {'implementation':<15} {'fwd+bwd ms':>9} {'peak MiB':>9} {'vs ref':>8} {'max rel err':>9}  "
              f"(err: output and input gradients against the float32 reference, <= {TOLERANCE:g} to be timed)")  # fmt: skip
    print(header)
    rows = []
    for outgoing in (True, False):
        torch.manual_seed(0)
        rows += run_case(f"trimul {'outgoing' if outgoing else 'incoming'}", *trimul_case(n, 128, 128, dtype, outgoing, cuet),
                         args.iters)  # fmt: skip
    for starting in (True, False):
        torch.manual_seed(0)
        rows += run_case(f"tri-attn {'starting' if starting else 'ending'}", *attention_case(n, 4, 32, dtype, starting, cuet),
                         args.iters)  # fmt: skip
    print("\n" + header + "\n" + "\n".join(rows))
    failed = [r for r in rows if "failed" in r or "disagrees" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
