"""Dropout whose mask is shared along one axis of the MSA / pair representation.

Supplementary section 1.11.6: in the Evoformer, dropout after a row-wise operation draws one mask
per *column* and shares it over all rows ("row-wise dropout"), and vice versa. For a tensor
``[*, N_rows, N_cols, C]``:

* :class:`DropoutRowwise`    shares the mask along dim ``-3`` (mask ``[*, 1, N_cols, C]``);
* :class:`DropoutColumnwise` shares the mask along dim ``-2`` (mask ``[*, N_rows, 1, C]``).

The mask is drawn by :func:`shared_dropout_mask` alone, so under DAP every rank of a group draws
the full-size mask identically and keeps its own part (``forward(x, plane, sharded)``). Dropout is the
identity in eval mode and when the rate is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    ones = torch.ones(mask_shape, device=device, dtype=dtype)
    if 0.0 < p < 1.0 and ones.numel() and device_path.cuda_path(ones):
        return torch.native_dropout(ones, p, True)[0]
    return F.dropout(ones, p=p, training=True)


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


__all__ = ["shared_dropout_mask", "SharedDropout", "DropoutRowwise", "DropoutColumnwise"]
