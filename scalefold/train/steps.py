"""Components of one training step, kept out of :mod:`scalefold.train.loop` so the loop reads top to bottom.

* :func:`sample_pairs` -- the ``(index, seed)`` stream of a data-parallel rank, indexed by position
  (independent of ``--max-steps``, so a resumed run continues the same stream);
* :func:`recycling_count`, :func:`forward_seed` -- per-step randomness as pure functions;
* :func:`setup_precision`, :func:`compile_blocks` -- numerics and ``torch.compile`` of selected regions;
* :func:`allreduce_step_stats` -- one small all-reduce per step over the training group: the mean
  loss and whether any rank was asked to stop (so every rank takes the same decisions).
"""

from __future__ import annotations

import functools
import os
import random
import warnings
from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from scalefold.data.loader import Sampler

SEED_MODULUS = 2**63 - 1
STREAM_BLOCK = 1024  # samples per rank and block of the position-indexed stream


# ---------------------------------------------------------------------------------------------
# Per-step randomness
# ---------------------------------------------------------------------------------------------


def sample_pairs(
    weights: Sequence[float] | np.ndarray, seed: int, start: int, stop: int, rank: int = 0, world_size: int = 1
) -> list[tuple[int, int]]:
    """``(chain index, sample seed)`` for positions ``start .. stop-1`` of data-parallel ``rank``.

    The global stream is cut into blocks of ``STREAM_BLOCK * world_size`` draws, each drawn by a
    :class:`~scalefold.data.loader.Sampler` seeded from (seed, block); rank ``r`` takes every
    ``world_size``-th draw of a block starting at ``r`` (strided). Position ``p`` of a rank is thus a
    function of (seed, rank, world size, p) only: neither ``--max-steps`` nor a resume changes it.
    """
    if not 0 <= start <= stop:
        raise ValueError(f"bad position range [{start}, {stop})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    pairs: list[tuple[int, int]] = []
    for block in range(start // STREAM_BLOCK, -(-stop // STREAM_BLOCK)):
        block_seed = random.Random(f"stream:{seed}:{block}").randrange(SEED_MODULUS)
        drawn = Sampler(weights, num_samples=STREAM_BLOCK * world_size, seed=block_seed, rank=rank, world_size=world_size)
        lo = max(start - block * STREAM_BLOCK, 0)
        hi = min(stop - block * STREAM_BLOCK, STREAM_BLOCK)
        pairs.extend(drawn.pairs[lo:hi])
    return pairs


def recycling_count(seed: int, step: int, num_ensembles: int) -> int:
    """Recycling iterations of 1-based ``step``: uniform on ``{0 .. R-1}``, a pure function of (seed, step),
    hence identical on every rank and after a resume."""
    return random.Random(f"recycling:{seed}:{step}").randrange(num_ensembles)


def forward_seed(seed: int, rank: int, step: int) -> int:
    """Per-step seed of the forward pass (dropout) from (seed, data-parallel rank, step)."""
    return random.Random(f"forward:{seed}:{rank}:{step}").randrange(SEED_MODULUS)


def to_device(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Move a batch; floating features take the run's compute dtype."""
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}


def step_batch(batch: dict[str, torch.Tensor], n: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The first ``n + 1`` recycling slices of a loader batch ``[..., R]``, on ``device``."""
    return to_device({k: v[..., : n + 1] for k, v in batch.items()}, device, dtype)


# ---------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------

MASTER_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}
#: cuBLAS workspace configuration that makes its GEMMs deterministic; PyTorch's deterministic mode
#: raises at the first cuBLAS call (CUDA >= 10.2) without it (``:16:8`` works too, with less memory).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def deterministic_environment(env: MutableMapping[str, str] | None = None) -> None:
    """Environment deterministic CUDA needs, set where unset (an explicit value is kept):
    ``CUBLAS_WORKSPACE_CONFIG`` (:data:`CUBLAS_WORKSPACE_CONFIG`). Call it before the first cuBLAS
    handle is created; :func:`scalefold.train.loop.train` calls it before the distributed runtime
    initialises CUDA, :func:`setup_precision` again (idempotent)."""
    env = os.environ if env is None else env
    if not env.get("CUBLAS_WORKSPACE_CONFIG"):
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG


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
        torch.use_deterministic_algorithms(True)
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


#: Regions ``--compile`` compiles: the blocks of these stacks (each block's ``forward`` separately,
#: so one compiled graph serves all blocks of a stack with equal shapes).
COMPILE_REGIONS = ("evoformer_stack", "extra_msa_stack", "template_pair_stack")


def compile_blocks(model: torch.nn.Module, regions: Sequence[str] = COMPILE_REGIONS, backend: str = "inductor") -> int:
    """``torch.compile`` the forward of every block of the ``regions`` stacks; returns how many.

    The eager module stays the reference (the compiled forward computes the same function, equal up to
    rounding; ``tests/train/test_precision_compile.py`` compares them). A block whose compilation fails
    at run time falls back to eager (``torch._dynamo`` ``suppress_errors``), so ``--compile`` never
    breaks a run.
    """
    if not hasattr(torch, "compile"):
        warnings.warn("torch.compile is unavailable: running eager", stacklevel=2)
        return 0
    from torch import _dynamo

    _dynamo.config.suppress_errors = True
    count = 0
    for stack_name in regions:
        stack = getattr(model, stack_name, None)
        for block in getattr(stack, "blocks", []):
            if getattr(block, "_scalefold_compiled", False):
                continue
            block.forward = torch.compile(block.forward, dynamic=False, backend=backend)
            block._scalefold_compiled = True
            count += 1
    return count


def warm_up(model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast: bool = False) -> None:
    """One training forward (a no-grad recycling pass, then the grad pass) and backward on ``batch``,
    gradients discarded: ``torch.compile`` traces and compiles its regions for both grad modes here,
    before ``run_start``, not in the timed run. ``batch`` needs >= 2 recycling slices for the no-grad
    pass. The model's weights and the optimizer state are not touched (no step)."""
    was_training = model.training
    model.train()
    device_type = batch["aatype"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        outputs = model(batch)
    loss = sum(v.float().mean() for v in outputs.values() if v.is_floating_point() and v.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()  # in place: the optimizer's flat gradient views stay attached
    model.train(was_training)


# ---------------------------------------------------------------------------------------------
# Per-step agreement between ranks
# ---------------------------------------------------------------------------------------------


def nonfinite_terms_to_nan(loss: torch.Tensor, terms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The detached ``loss``, or NaN if any reported loss term is non-finite.

    :class:`~scalefold.losses.AlphaFoldLoss` replaces a non-finite term by a constant 0 (as the
    reference does), which can leave a finite loss, even zero gradients, on a step whose model output
    was garbage; the loop treats such a step as non-finite and skips it. No host synchronisation.
    """
    loss = loss.detach()
    if not terms:
        return loss
    finite = torch.stack([v.detach().to(loss.device, torch.float64).reshape(()) for v in terms.values()]).isfinite().all()
    return torch.where(finite, loss, torch.full_like(loss, float("nan")))


def allreduce_step_stats(
    loss: torch.Tensor, stop: bool, group: dist.ProcessGroup | None, world_size: int, count: int = 0
) -> tuple[float, bool, int]:
    """(mean loss over the training ranks, any rank asked to stop, sum of ``count`` over the ranks):
    one all-reduce of three numbers (``count``: e.g. the samples this rank's loader replaced)."""
    stats = torch.tensor([0.0, float(stop), float(count)], dtype=torch.float64, device=loss.device)
    stats[0] = loss.detach().to(torch.float64)
    if world_size > 1:
        dist.all_reduce(stats, group=group)
    mean_loss, stops, total = stats.tolist()
    return mean_loss / world_size, stops > 0, int(round(total))


def broadcast_float(value: float, src: int, group: dist.ProcessGroup | None, device: torch.device, distributed: bool) -> float:
    """``value`` of rank ``src`` on every rank of ``group`` (the evaluation result: all ranks stop together)."""
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=src, group=group)
    return float(t.item())


__all__ = [
    "sample_pairs", "recycling_count", "forward_seed", "to_device", "step_batch", "setup_precision",
    "float_outputs", "run_in_fp32", "keep_fp32_regions", "FP32_REGIONS", "COMPILE_REGIONS", "compile_blocks", "warm_up", "nonfinite_terms_to_nan", "allreduce_step_stats", "broadcast_float",
    "deterministic_environment", "CUBLAS_WORKSPACE_CONFIG",
]  # fmt: skip
