"""Triton kernel: fused Adam + SWA (+ gradient-clip scale) over flat buffers.

One 1-D kernel reads each element's gradient, master weight and both moments once and writes
the master weight, both moments, the optional low-precision compute copy and the SWA weight
(~36 bytes per fp32 parameter with a bf16 copy: the bandwidth floor of the step). Per element,
in the master dtype and in :func:`scalefold.kernels.reference.adam_swa_`'s order:

    g    = grad * clip_scale
    m    = lerp(m, g, 1 - beta1)                         # torch.optim.Adam
    v    = v * beta2 + (1 - beta2) * g * g
    p    = p + (m * -lr/bc1) / (sqrt(v) / sqrt(bc2) + eps)
    copy = p  (compute dtype)
    swa  = p                      if n_averaged == 0     # AveragedModel's first update
         = swa + (p - swa) * (1 - decay)  otherwise  # the MLPerf reference's AveragedModel form

The CPU reference computes the SWA update as ``swa.lerp_(p, 1 - decay)`` (the form training has always
used; within an ulp of this one per step), so kernel and reference agree within tolerance, not bitwise.

``-lr/bc1``, ``sqrt(bc2)`` and the clip scale are read from device tensors, the hyper-parameters
from a cached device tensor, so a captured CUDA graph replays correct steps. Divisions and square
roots are IEEE-rounded (``div_rn`` / ``sqrt_rn``) like PyTorch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalefold.kernels import autotune

# Index of each hyper-parameter in the HYPER device tensor.
_LERP_WEIGHT, _BETA2, _ONE_MINUS_BETA2, _EPS, _SWA_WEIGHT = range(5)


@triton.jit
def _adam_swa(
    PARAM,
    GRAD,
    EXP_AVG,
    EXP_AVG_SQ,
    SWA,
    COMPUTE,
    CLIP_SCALE,
    NEG_STEP_SIZE,
    BC2_SQRT,
    HYPER,
    numel,
    HAS_CLIP: tl.constexpr,
    HAS_COMPUTE: tl.constexpr,
    SWA_COPY: tl.constexpr,
    FP64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    p = tl.load(PARAM + offs, mask=ok, other=0.0)
    dtype = p.dtype
    g = tl.load(GRAD + offs, mask=ok, other=0.0).to(dtype)
    if HAS_CLIP:
        g = g * tl.load(CLIP_SCALE).to(dtype)
    lerp_weight = tl.load(HYPER + 0)
    beta2 = tl.load(HYPER + 1)
    one_minus_beta2 = tl.load(HYPER + 2)
    eps = tl.load(HYPER + 3)
    swa_weight = tl.load(HYPER + 4)
    m = tl.load(EXP_AVG + offs, mask=ok, other=0.0)
    v = tl.load(EXP_AVG_SQ + offs, mask=ok, other=0.0)
    m = tl.fma(lerp_weight, g - m, m)  # torch.lerp for a weight < 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    bc2_sqrt = tl.load(BC2_SQRT).to(dtype)
    step = m * tl.load(NEG_STEP_SIZE).to(dtype)
    if FP64:  # fp64 sqrt and division are IEEE-rounded already
        p = p + step / (tl.sqrt(v) / bc2_sqrt + eps)
    else:
        p = p + tl.div_rn(step, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(PARAM + offs, p, mask=ok)
    tl.store(EXP_AVG + offs, m, mask=ok)
    tl.store(EXP_AVG_SQ + offs, v, mask=ok)
    if HAS_COMPUTE:
        tl.store(COMPUTE + offs, p.to(COMPUTE.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)
    if SWA_COPY:
        tl.store(SWA + offs, p, mask=ok)
    else:
        swa = tl.load(SWA + offs, mask=ok, other=0.0)
        tl.store(SWA + offs, swa + (p - swa) * swa_weight, mask=ok)


ADAM_CONFIGS = [
    {"BLOCK": 1024, "num_warps": 4},
    {"BLOCK": 2048, "num_warps": 8},
    {"BLOCK": 4096, "num_warps": 8},
]
INTERPRETER_CONFIG = {"BLOCK": 4096, "num_warps": 1}

_hyper_cache: dict[tuple, torch.Tensor] = {}


def _hyper(beta1: float, beta2: float, eps: float, swa_decay: float, dtype: torch.dtype, device) -> torch.Tensor:
    """Hyper-parameters as a device tensor, created once per value set (not inside a graph capture)."""
    key = (beta1, beta2, eps, swa_decay, dtype, str(device))
    if key not in _hyper_cache:
        values = [0.0] * 5
        values[_LERP_WEIGHT] = 1 - beta1
        values[_BETA2] = beta2
        values[_ONE_MINUS_BETA2] = 1 - beta2
        values[_EPS] = eps
        values[_SWA_WEIGHT] = 1.0 - swa_decay
        _hyper_cache[key] = torch.tensor(values, dtype=dtype, device=device)
    return _hyper_cache[key]


def adam_swa_launch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    swa: torch.Tensor,
    compute: torch.Tensor | None,
    clip_scale: torch.Tensor | None,
    neg_step_size: torch.Tensor,
    bias_correction2_sqrt: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    swa_decay: float,
    swa_copy: bool,
) -> None:
    """Launch the fused step in place on contiguous 1-D buffers of equal length."""
    if 1 - beta1 >= 0.5:
        raise ValueError("the fused Adam kernel implements lerp for 1 - beta1 < 0.5 only")
    numel = param.numel()
    if numel == 0:
        return
    hyper = _hyper(beta1, beta2, eps, swa_decay, param.dtype, param.device)

    def launch(cfg: dict, tensors=(param, grad, exp_avg, exp_avg_sq, swa, compute)) -> None:
        _adam_swa[(triton.cdiv(numel, cfg["BLOCK"]),)](
            *tensors, clip_scale, neg_step_size, bias_correction2_sqrt, hyper, numel,
            HAS_CLIP=clip_scale is not None, HAS_COMPUTE=compute is not None, SWA_COPY=swa_copy,
            FP64=param.dtype == torch.float64, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
        )  # fmt: skip

    scratch: list = []

    def bench(cfg: dict) -> None:  # in-place kernel: time it on scratch copies of the state
        if not scratch:
            scratch.extend(None if t is None else t.clone() for t in (param, exp_avg, exp_avg_sq, swa, compute))
        launch(cfg, (scratch[0], grad, *scratch[1:]))

    shape = dict(
        numel=autotune.size_class(numel), master=autotune.dtype_label(param.dtype), compute=compute is not None
    )
    key = autotune.make_key(shape, grad)  # the dtype label: the gradients' (the training dtype)
    autotune.get_tuner("adam_swa", ADAM_CONFIGS, INTERPRETER_CONFIG).run(key, launch, bench)
