"""Which device's code path a tensor's work takes: its own, or CUDA's while a CPU step stands in for a GPU's.

A few places pick their code by the device they run on, because the GPU does the same work in fewer
kernels: dropout (one fused ``native_dropout`` kernel on CUDA; a fill, a Bernoulli draw, a division and a
product on the CPU), the optimizer's staged chunks (16 M elements on a device, the CPU reference's own
512 K chunks on the CPU) and the gradient norm (one tree reduction on a device, chunked dot products on the
CPU). The step counter (``scalefold estimate-step``, :mod:`scalefold.perf.flops`) runs its fake step on
CPU tensors with CUDA's rules; inside :func:`as_cuda` these places take the CUDA path, so the counted
launches and bytes are the GPU's. Outside it nothing changes: a real CPU run keeps its own path (and
its bit-identical numbers), a real GPU run its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_state = {"as_cuda": 0}


@contextlib.contextmanager
def as_cuda() -> Iterator[None]:
    """Within the block, CPU tensors take the CUDA code path of the places that choose by device."""
    _state["as_cuda"] += 1
    try:
        yield
    finally:
        _state["as_cuda"] -= 1


def cpu_path(t: torch.Tensor) -> bool:
    """Whether work on ``t`` takes the CPU code path: ``t`` is on the CPU and no :func:`as_cuda` is active."""
    return t.device.type == "cpu" and not _state["as_cuda"]


def cuda_path(t: torch.Tensor) -> bool:
    """Whether work on ``t`` takes the CUDA code path: ``t`` is on CUDA, or :func:`as_cuda` is active."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and bool(_state["as_cuda"]))


__all__ = ["as_cuda", "cpu_path", "cuda_path"]
