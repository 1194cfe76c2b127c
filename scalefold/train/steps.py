"""Components of one training step, kept out of :mod:`scalefold.train.loop` so the loop reads top to bottom.

* :func:`sample_pairs` -- the ``(index, seed)`` stream of a data-parallel rank, indexed by position
  (independent of ``--max-steps``, so a resumed run continues the same stream);
* :func:`recycling_count`, :func:`forward_seed` -- per-step randomness as pure functions;
* :func:`setup_precision`, :func:`compile_blocks` -- numerics and ``torch.compile`` of selected regions;
* :class:`StopRequest` -- SIGTERM / SIGUSR1 (Slurm pre-emption) turned into "checkpoint and stop
  at the end of this step";
* :func:`allreduce_step_stats` -- one small all-reduce per step over the training group: the mean
  loss and whether any rank was asked to stop (so every rank takes the same decisions).
"""

from __future__ import annotations

import random
import signal
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from scalefold.data.loader import Sampler

SEED_MODULUS = 2**63 - 1
STREAM_BLOCK = 1024  # samples per rank and block of the position-indexed stream
STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


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


def setup_precision(precision: str, deterministic: bool) -> tuple[torch.dtype, bool]:
    """(master/compute dtype of the model, whether bf16 autocast is on); sets the TF32 switches.

    ``bf16``: fp32 master weights and bf16 autocast (the structure module, and the loss here, run in
    fp32); ``tf32``: fp32 with TF32 tensor-core matmuls/convolutions (CUDA); ``fp64``: CPU reference.
    """
    if precision not in MASTER_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(MASTER_DTYPES)}")
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return MASTER_DTYPES[precision], precision == "bf16"


def float_outputs(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss runs in fp32 under bf16 autocast."""
    return {k: v.float() if v.is_floating_point() and v.dtype != torch.float64 else v for k, v in outputs.items()}


def compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` the forward of every Evoformer and extra-MSA block; returns how many.

    Compilation errors fall back to eager (``torch._dynamo`` ``suppress_errors``), so ``--compile``
    never breaks a run; the loss stays that of the eager model up to rounding.
    """
    if not hasattr(torch, "compile"):
        warnings.warn("torch.compile is unavailable: running eager", stacklevel=2)
        return 0
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    count = 0
    for stack_name in ("evoformer_stack", "extra_msa_stack"):
        stack = getattr(model, stack_name, None)
        for block in getattr(stack, "blocks", []):
            block.forward = torch.compile(block.forward, dynamic=False)
            count += 1
    return count


# ---------------------------------------------------------------------------------------------
# Stop requests and per-step agreement between ranks
# ---------------------------------------------------------------------------------------------


class StopRequest:
    """SIGTERM / SIGUSR1 set a flag; the loop checkpoints at the end of the current step and exits.

    Use as a context manager: the previous handlers are restored on exit.
    """

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum

    def __enter__(self) -> StopRequest:
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with whoever owns them
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def allreduce_step_stats(
    loss: torch.Tensor, stop: bool, group: dist.ProcessGroup | None, world_size: int
) -> tuple[float, bool]:
    """(mean loss over the training ranks, any rank asked to stop): one all-reduce of two numbers."""
    stats = torch.stack([loss.detach().to(torch.float64), torch.tensor(float(stop), dtype=torch.float64, device=loss.device)])
    if world_size > 1:
        dist.all_reduce(stats, group=group)
    mean_loss, stops = stats.tolist()
    return mean_loss / world_size, stops > 0


def broadcast_float(value: float, src: int, group: dist.ProcessGroup | None, device: torch.device, distributed: bool) -> float:
    """``value`` of rank ``src`` on every rank of ``group`` (the evaluation result: all ranks stop together)."""
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=src, group=group)
    return float(t.item())


__all__ = [
    "sample_pairs", "recycling_count", "forward_seed", "to_device", "step_batch", "setup_precision",
    "float_outputs", "compile_blocks", "StopRequest", "allreduce_step_stats", "broadcast_float",
]  # fmt: skip
