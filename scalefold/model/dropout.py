"""Dropout whose mask is shared along one axis of the MSA / pair representation.

Supplementary section 1.11.6: in the Evoformer, dropout after a row-wise operation draws one mask
per *column* and shares it over all rows ("row-wise dropout"), and vice versa. For a tensor
``[*, N_rows, N_cols, C]``:

* :class:`DropoutRowwise`    shares the mask along dim ``-3`` (mask ``[*, 1, N_cols, C]``);
* :class:`DropoutColumnwise` shares the mask along dim ``-2`` (mask ``[*, N_rows, 1, C]``).

The mask is drawn by :func:`shared_dropout_mask` alone, so under DAP every rank of a group draws
the full-size mask identically and keeps its own part (``forward(x, plane, sharded)``). Dropout is the
identity in eval mode and when the rate is 0.

**Activation checkpointing** recomputes a block in backward, and its dropout must use the masks the
forward drew. ``torch.utils.checkpoint`` would save the generator's state and set it back for the
recomputation, which a CUDA-graph capture refuses (``torch.cuda.get_rng_state`` / ``set_rng_state`` under
capture). Instead a checkpointed block runs under a :class:`MaskTape`
(:func:`scalefold.model.memory.run_block`): its forward records every mask it draws, its recomputation
takes them back in order and draws nothing. The generator's stream is the same as with a preserved state
(the forward draws, the recomputation does not advance it), so the numbers are too, and the recomputation
is graph-safe: the masks are tensors the graph holds, not host state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from scalefold import kernels
from scalefold.kernels import device_path

ROW_SHARED_DIM = -3  # rows of [*, N_rows, N_cols, C]
COLUMN_SHARED_DIM = -2  # columns of [*, N_rows, N_cols, C]


def shared_dropout_mask(
    shape: Sequence[int],
    p: float,
    share_dim: Union[int, tuple[int, ...]],
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Draw an (inverted-)dropout mask for a tensor of ``shape``, of size 1 along ``share_dim``.

    Entries are 0 (probability ``p``) or ``1 / (1 - p)``. The random stream matches the MLPerf
    reference (``F.dropout`` applied to a tensor of ones of the mask's shape). On CUDA ``F.dropout`` is
    the one fused ``native_dropout`` kernel; it is called by name there (the same kernel, so the same
    numbers) so that the step counter's CPU stand-in for a GPU step counts that kernel
    (:mod:`scalefold.kernels.device_path`), not the CPU's fill, Bernoulli draw, division and product.
    """
    if isinstance(share_dim, int):
        share_dim = (share_dim,)
    mask_shape = list(shape)
    for d in share_dim:
        mask_shape[d] = 1
    if _GENERATORS:  # a branch's own generator (Parallel Evoformer): F.dropout's CPU draw, on that generator
        if p >= 1.0:
            return torch.zeros(mask_shape, device=device, dtype=dtype)
        return torch.empty(mask_shape, device=device, dtype=dtype).bernoulli_(1.0 - p, generator=_GENERATORS[-1]) \
            .div_(1.0 - p)  # fmt: skip
    ones = torch.ones(mask_shape, device=device, dtype=dtype)
    if 0.0 < p < 1.0 and ones.numel() and device_path.cuda_path(ones):
        return torch.native_dropout(ones, p, True)[0]
    return F.dropout(ones, p=p, training=True)


_GENERATORS: list[torch.Generator] = []  # the innermost drawing_from's generator last


@contextmanager
def drawing_from(generator: torch.Generator) -> Iterator[None]:
    """Dropout masks drawn inside come from ``generator`` (a Bernoulli draw and a scale: on the CPU exactly
    ``F.dropout``'s under that generator's state), not the global one; a graph holds the generator, as a
    CUDA graph registers it, so replays advance it."""
    _GENERATORS.append(generator)
    try:
        yield
    finally:
        _GENERATORS.pop()


class MaskTape:
    """The dropout masks of one checkpointed block: its first pass (the forward) records each mask drawn,
    every later pass (the recomputation in backward) takes them back in order."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []
        self.recorded = False
        self._position = 0

    @contextmanager
    def run(self) -> Iterator[MaskTape]:
        """One pass of the block: the first records, later ones replay from the first mask."""
        self._position = 0
        _TAPES.append(self)
        try:
            yield self
        finally:
            _TAPES.pop()
            if self.recorded and self._position != len(self.masks):
                raise RuntimeError(f"activation checkpointing: the recomputation used {self._position} of the "
                                   f"{len(self.masks)} dropout masks its forward drew")  # fmt: skip
            self.recorded = True

    def take(self, draw, shape: Sequence[int]) -> torch.Tensor:  # noqa: ANN001 -- draw() -> the mask
        if not self.recorded:
            mask = draw()
            self.masks.append(mask)
            return mask
        if self._position >= len(self.masks):
            raise RuntimeError("activation checkpointing: the recomputation drew more dropout masks than its forward")
        mask = self.masks[self._position]
        self._position += 1
        return mask


_TAPES: list[MaskTape] = []  # the innermost active checkpointed block's tape last


class SharedDropout(nn.Module):
    """Dropout with the mask shared (broadcast) along ``share_dim``; identity in eval or at rate 0."""

    def __init__(self, p: float, share_dim: Union[int, tuple[int, ...]]) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout rate must be in [0, 1], got {p}")
        self.p = p
        self.share_dim = share_dim

    def forward(self, x: torch.Tensor, plane=None, sharded: int = ROW_SHARED_DIM) -> torch.Tensor:
        """Under DAP, ``plane`` (a :class:`scalefold.model.parallel.Plane`) draws the mask at
        the single-rank size and keeps the part of ``x``'s sharded axis (``sharded``) held here."""
        mask = self.mask(x, plane, sharded)
        return x if mask is None else x * mask

    def add(self, residual: torch.Tensor, x: torch.Tensor, plane=None, sharded: int = ROW_SHARED_DIM) -> torch.Tensor:
        """The residual update ``residual + dropout(x)``, as one elementwise chain
        (:func:`scalefold.kernels.dropout_add`: compiled with the others under ``--compile``)."""
        return kernels.dropout_add(residual, x, self.mask(x, plane, sharded))

    def mask(self, x: torch.Tensor, plane=None, sharded: int = ROW_SHARED_DIM) -> torch.Tensor | None:
        """The mask for ``x`` (None in eval mode or at rate 0); arguments as :meth:`forward`."""
        if not self.training or self.p == 0.0:
            return None
        if _TAPES:  # inside a checkpointed block: the forward's masks again in its recomputation
            return _TAPES[-1].take(lambda: self._draw(x, plane, sharded), x.shape)
        return self._draw(x, plane, sharded)

    def _draw(self, x: torch.Tensor, plane, sharded: int) -> torch.Tensor:  # noqa: ANN001
        if plane is None:
            return shared_dropout_mask(x.shape, self.p, self.share_dim, x.device, x.dtype)
        return plane.dropout_mask(
            lambda shape: shared_dropout_mask(shape, self.p, self.share_dim, x.device, x.dtype), x.shape, sharded
        )

    def extra_repr(self) -> str:
        return f"p={self.p}, share_dim={self.share_dim}"


class DropoutRowwise(SharedDropout):
    """One mask for all rows (shared along dim -3); used after row-wise updates."""

    def __init__(self, p: float) -> None:
        super().__init__(p, share_dim=ROW_SHARED_DIM)


class DropoutColumnwise(SharedDropout):
    """One mask for all columns (shared along dim -2); used after column-wise updates."""

    def __init__(self, p: float) -> None:
        super().__init__(p, share_dim=COLUMN_SHARED_DIM)


__all__ = ["MaskTape", "drawing_from", "shared_dropout_mask", "SharedDropout", "DropoutRowwise", "DropoutColumnwise"]
