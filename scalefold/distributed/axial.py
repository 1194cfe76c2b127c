"""The named layout-switch calls the model makes under Dynamic Axial Parallelism.

A representation ``x`` ``[*, A, B, C]`` (MSA ``[*, N_seq, N_res, c_m]``, pair
``[*, N_res, N_res, c_z]``, templates ``[*, N_templ, N_res, N_res, c_t]``) is either
*row-sharded* (each rank holds ``A_pad / d`` rows and all ``B`` columns) or *column-sharded*
(all ``A`` rows, ``B_pad / d`` columns). A :class:`Plane` knows the real sizes ``rows = A`` and
``cols = B`` and the DAP group. Only the sharded axis is padded (to a multiple of ``d``); the whole
axis is always at its real size, so every reduction (attention over keys, triangle sums, the outer
product mean) sees exactly the single-rank entries and padded rows never reach real ones; the
stack's exit gather strips the padding.

Every call here takes ``plane=None`` to mean "DAP off" and then returns its input unchanged (no
communication, no copy), so the model code reads the same with and without DAP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from scalefold.distributed import async_ops as A
from scalefold.distributed import primitives as P
from scalefold.distributed.group import DAPGroup

ROWS = -3  # the row axis of [*, A, B, C]
COLS = -2  # the column axis of [*, A, B, C]


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    if extra < 0:
        raise ValueError(f"cannot pad dimension {dim} of shape {tuple(x.shape)} down to {size}")
    trailing = x.dim() - 1 - dim % x.dim()
    return F.pad(x, [0, 0] * trailing + [0, extra])


def _ceil_to(n: int, d: int) -> int:
    return -(-n // d) * d


@dataclass(frozen=True, eq=False)
class Plane:
    """A two-axis representation sharded over a DAP group: real ``rows`` and ``cols``."""

    group: DAPGroup
    rows: int
    cols: int

    @property
    def size(self) -> int:
        return self.group.size

    def padded(self, n: int) -> int:
        return _ceil_to(n, self.group.size)

    # -- entry / exit --------------------------------------------------------------------------

    def scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated ``[*, A, B, C]`` -> row-sharded ``[*, A_pad/d, B, C]``."""
        return P.scatter(_pad_to(x, ROWS, self.padded(self.rows)), ROWS, self.group)

    def gather_rows(self, x: torch.Tensor, grad: str = "sum") -> torch.Tensor:
        """Row-sharded -> whole rows at their real size (padding stripped)."""
        return P.gather(x, ROWS, self.group, grad=grad).narrow(ROWS, 0, self.rows)

    def gather_cols(self, x: torch.Tensor, grad: str = "sum") -> torch.Tensor:
        """Column-sharded -> whole columns at their real size (padding stripped)."""
        return P.gather(x, COLS, self.group, grad=grad).narrow(COLS, 0, self.cols)

    # -- layout switches -----------------------------------------------------------------------

    def row_to_col(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_to(x, COLS, self.padded(self.cols))
        return P.all_to_all(x, COLS, ROWS, self.group).narrow(ROWS, 0, self.rows)

    def col_to_row(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_to(x, ROWS, self.padded(self.rows))
        return P.all_to_all(x, ROWS, COLS, self.group).narrow(COLS, 0, self.cols)

    # -- overlapped versions (Duality Async Operations): launch now, ``.wait()`` for the result --

    def col_to_row_async(self, x: torch.Tensor) -> Later:
        x = _pad_to(x, ROWS, self.padded(self.rows))
        return Later(A.all_to_all_async(x, ROWS, COLS, self.group), lambda y: y.narrow(COLS, 0, self.cols))

    def gather_rows_async(self, x: torch.Tensor, grad: str = "sum") -> Later:
        return Later(A.gather_async(x, ROWS, self.group, grad=grad), lambda y: y.narrow(ROWS, 0, self.rows))

    def gather_cols_async(self, x: torch.Tensor, grad: str = "sum") -> Later:
        return Later(A.gather_async(x, COLS, self.group, grad=grad), lambda y: y.narrow(COLS, 0, self.cols))

    # -- masks and dropout (no gradient, no communication) -----------------------------------

    def local(self, t: torch.Tensor, dim: int, real: int) -> torch.Tensor:
        """This rank's chunk of a replicated tensor along ``dim`` (real size ``real``, padded)."""
        return P.split_local(_pad_to(t, dim, self.padded(real)), dim, self.group)

    def dropout_mask(
        self, draw: Callable[[Sequence[int]], torch.Tensor], local_shape: Sequence[int], sharded: int
    ) -> torch.Tensor:
        """Draw the single-rank (real-size) mask with ``draw(full_shape)`` and keep the local part
        of ``sharded`` (``ROWS``/``COLS``) unless the mask is shared (size 1) along it."""
        full = list(local_shape)
        full[ROWS], full[COLS] = self.rows, self.cols
        mask = draw(full)
        if mask.shape[sharded] == 1:
            return mask
        return self.local(mask, sharded, full[sharded])


class Later:
    """A result to :meth:`wait` for: an overlapped collective (then ``post``), or a ready tensor."""

    def __init__(self, pending: A.Overlapped | torch.Tensor, post: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self._pending, self._post = pending, post

    def wait(self) -> torch.Tensor:
        if isinstance(self._pending, torch.Tensor):
            return self._pending
        y = self._pending.wait()
        return y if self._post is None else self._post(y)


class Axial(NamedTuple):
    """The planes one stack's blocks work on: the MSA (``rows = N_seq``) and the pair."""

    msa: Plane | None
    pair: Plane


def planes(group: DAPGroup, n_seq: int | None, n_res: int) -> Axial:
    """The :class:`Axial` of one stack call (``n_seq=None`` for the template pair stack)."""
    msa = None if n_seq is None else Plane(group, n_seq, n_res)
    return Axial(msa, Plane(group, n_res, n_res))


# ---- the named calls used in model code (identity when the plane is None) --------------------


def scatter_rows(x: torch.Tensor, plane: Plane | None) -> torch.Tensor:
    return x if plane is None else plane.scatter_rows(x)


def gather_rows(x: torch.Tensor, plane: Plane | None, grad: str = "sum") -> torch.Tensor:
    return x if plane is None else plane.gather_rows(x, grad=grad)


def gather_cols(x: torch.Tensor, plane: Plane | None, grad: str = "sum") -> torch.Tensor:
    return x if plane is None else plane.gather_cols(x, grad=grad)


def row_to_col(x: torch.Tensor, plane: Plane | None) -> torch.Tensor:
    return x if plane is None else plane.row_to_col(x)


def col_to_row(x: torch.Tensor, plane: Plane | None) -> torch.Tensor:
    return x if plane is None else plane.col_to_row(x)


def col_to_row_async(x: torch.Tensor, plane: Plane | None) -> Later:
    """Launch :func:`col_to_row` (overlapped with the compute before ``.wait()``)."""
    return Later(x) if plane is None else plane.col_to_row_async(x)


def gather_rows_async(x: torch.Tensor, plane: Plane | None, grad: str = "sum") -> Later:
    """Launch :func:`gather_rows` (overlapped with the compute before ``.wait()``)."""
    return Later(x) if plane is None else plane.gather_rows_async(x, grad=grad)


def gather_cols_async(x: torch.Tensor, plane: Plane | None, grad: str = "sum") -> Later:
    """Launch :func:`gather_cols` (overlapped with the compute before ``.wait()``)."""
    return Later(x) if plane is None else plane.gather_cols_async(x, grad=grad)


def mask_rows(mask: torch.Tensor, plane: Plane | None) -> torch.Tensor:
    """A replicated mask ``[*, A, B]`` -> the rows of the row-sharded layout."""
    return mask if plane is None else plane.local(mask, -2, plane.rows)


def mask_cols(mask: torch.Tensor, plane: Plane | None) -> torch.Tensor:
    """A replicated mask ``[*, A, B]`` -> the columns of the column-sharded layout."""
    return mask if plane is None else plane.local(mask, -1, plane.cols)


__all__ = [
    "ROWS",
    "COLS",
    "Plane",
    "Axial",
    "planes",
    "scatter_rows",
    "gather_rows",
    "gather_cols",
    "row_to_col",
    "col_to_row",
    "Later",
    "col_to_row_async",
    "gather_rows_async",
    "gather_cols_async",
    "mask_rows",
    "mask_cols",
]
