"""Numerics of a training run: master dtypes, bf16 autocast with fp32 regions, TF32 and determinism.

* :func:`setup_precision` -- the run's master/compute dtype and whether bf16 autocast is on (sets the
  TF32 switches and, for ``--deterministic``, deterministic algorithms);
* :func:`set_deterministic_algorithms` -- ``torch.use_deterministic_algorithms`` without importing inductor;
* :func:`keep_fp32_regions` / :func:`run_in_fp32` -- the structure module and the heads compute in fp32
  inside a bf16 autocast region (ScaleFold / the MLPerf reference);
* :func:`float_outputs` -- the loss runs in fp32 under bf16 autocast.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence

import torch

MASTER_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}
#: cuBLAS workspace configuration that makes its GEMMs deterministic; PyTorch's deterministic mode
#: raises at the first cuBLAS call (CUDA >= 10.2) without it (``:16:8`` works too, with less memory).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def deterministic_environment(env: MutableMapping[str, str] | None = None) -> None:
    """Environment deterministic CUDA needs, set where unset (an explicit value is kept):
    ``CUBLAS_WORKSPACE_CONFIG`` (:data:`CUBLAS_WORKSPACE_CONFIG`). Call it before the first cuBLAS
    handle is created; :func:`scalefold.train.trainer.train` calls it before the distributed runtime
    initialises CUDA, :func:`setup_precision` again (idempotent)."""
    env = os.environ if env is None else env
    if not env.get("CUBLAS_WORKSPACE_CONFIG"):
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG


#: inductor's switch of its deterministic mode, read when ``torch._inductor.config`` is imported
INDUCTOR_DETERMINISTIC_ENV = "TORCHINDUCTOR_DETERMINISTIC"


def set_deterministic_algorithms(mode: bool) -> None:
    """``torch.use_deterministic_algorithms(mode)`` with the same effect, without its import of
    ``torch._inductor`` (dynamo, sympy: ~3 CPU s of the start of every process of a ``--deterministic`` run
    that compiles nothing). Inductor's ``deterministic`` follows ``mode`` as torch's call sets it: on its
    config where inductor is loaded, through :data:`INDUCTOR_DETERMINISTIC_ENV` (read when it loads) where not."""
    torch._C._set_deterministic_algorithms(mode)
    config = sys.modules.get("torch._inductor.config")
    if config is not None and hasattr(config, "deterministic"):  # torch < 2.7's inductor has no such mode
        config.deterministic = mode
    if mode:
        os.environ[INDUCTOR_DETERMINISTIC_ENV] = "1"
    elif os.environ.get(INDUCTOR_DETERMINISTIC_ENV) == "1":
        del os.environ[INDUCTOR_DETERMINISTIC_ENV]


def setup_precision(precision: str, deterministic: bool) -> tuple[torch.dtype, bool]:
    """(master/compute dtype of the model, whether bf16 autocast is on); sets the TF32 switches.

    ``bf16``: fp32 master weights and bf16 autocast (the structure module and the heads run in fp32,
    :func:`keep_fp32_regions`, and so does the loss, :func:`float_outputs`); ``tf32``: fp32 with TF32 tensor-core matmuls/convolutions (CUDA); ``fp64``: CPU reference.
    """
    if precision not in MASTER_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(MASTER_DTYPES)}")
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        deterministic_environment()  # before use_deterministic_algorithms: cuBLAS needs its workspace config
        set_deterministic_algorithms(True)
    return MASTER_DTYPES[precision], precision == "bf16"


def float_outputs(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss runs in fp32 under bf16 autocast."""
    return {k: v.float() if v.is_floating_point() and v.dtype != torch.float64 else v for k, v in outputs.items()}


#: Regions that stay in fp32 under bf16 autocast (ScaleFold / the MLPerf reference): the structure
#: module (frames, IPA geometry) and the output heads (pLDDT, distogram, masked MSA, ...).
FP32_REGIONS = ("structure_module", "auxiliary_heads")
_REDUCED = (torch.bfloat16, torch.float16)


def _to_fp32(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype in _REDUCED else x
    if isinstance(x, Mapping):
        return {k: _to_fp32(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fp32(v) for v in x)
    return x


def run_in_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Make ``module`` compute in fp32 inside a bf16 autocast region: its forward runs with autocast
    disabled and its reduced-precision floating inputs cast to fp32 (parameters are fp32 master
    weights already). Idempotent; returns ``module``."""
    if getattr(module, "_scalefold_fp32", False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: object, **kwargs: object) -> object:
        device_type = next((p.device.type for p in module.parameters()), "cpu")
        with torch.autocast(device_type, enabled=False):
            return inner(*_to_fp32(args), **_to_fp32(kwargs))

    module.forward = forward
    module._scalefold_fp32 = True
    return module


def keep_fp32_regions(model: torch.nn.Module, regions: Sequence[str] = FP32_REGIONS) -> list[str]:
    """Apply :func:`run_in_fp32` to the named submodules of ``model`` that exist; returns their names."""
    done = []
    for name in regions:
        sub = getattr(model, name, None)
        if isinstance(sub, torch.nn.Module):
            run_in_fp32(sub)
            done.append(name)
    return done



__all__ = [
    "CUBLAS_WORKSPACE_CONFIG", "FP32_REGIONS", "MASTER_DTYPES", "deterministic_environment", "float_outputs",
    "INDUCTOR_DETERMINISTIC_ENV", "keep_fp32_regions", "run_in_fp32", "set_deterministic_algorithms", "setup_precision",
]  # fmt: skip
