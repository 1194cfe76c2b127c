"""Model parallelism applied to a plain model from outside: :func:`parallelize`.

The model knows nothing of process groups. It lists its stacks of blocks that Dynamic Axial
Parallelism shards (``model.parallel_stacks()``, see :class:`ParallelModel`), and each stack takes
its DAP group and BP pair through one typed call (:class:`ParallelStack`, implemented by
:class:`scalefold.model.parallel.ParallelStack`). This module sets them and installs the gradient
factors of :mod:`scalefold.distributed.grad_sync`. No attribute scanning: a model that does not
offer the interface is refused when it would need it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch.nn as nn

from scalefold.distributed import grad_sync
from scalefold.distributed.branch_parallel import Branches
from scalefold.distributed.group import DAPGroup


@runtime_checkable
class ParallelStack(Protocol):
    """A stack of blocks that can run sharded over a DAP group (and, for a stack of Parallel
    Evoformer blocks -- ``branch_parallel`` -- split over a BP pair)."""

    branch_parallel: bool

    def set_parallelism(self, dap_group: DAPGroup | None, branch: Branches | None = None) -> None: ...

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradient is partial over the DAP group (summed over it)."""
        ...

    def branch_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradient only one rank of the BP pair computes (summed over it)."""
        ...


@runtime_checkable
class ParallelModel(Protocol):
    """A model (or a bare stack) that lists its parallel stacks."""

    def parallel_stacks(self) -> list[ParallelStack]: ...


def parallel_stacks(model: nn.Module) -> list[ParallelStack]:
    """The stacks ``model`` lists; ``[]`` for a model without the interface."""
    return list(model.parallel_stacks()) if isinstance(model, ParallelModel) else []


def parallelize(
    model: nn.Module,
    *,
    dap_group: DAPGroup | None,
    branch: Branches | None,
    dap: int,
    bp: int,
    grad_hooks: bool = True,
) -> list:
    """Shard ``model``'s stacks over ``dap_group`` (size ``dap``; ``None`` when ``dap == 1``) and
    split its Parallel Evoformer over the BP pair ``branch`` (``None`` when ``bp == 1``).

    With ``grad_hooks`` every partial gradient is scaled by its DAP/BP factor as it is produced
    (see :mod:`scalefold.distributed.grad_sync`); returns those hook handles (``[]`` without).
    Raises ``ValueError`` for ``bp > 1`` without a Parallel Evoformer, ``TypeError`` for ``dap > 1``
    on a model that lists no parallel stacks.
    """
    stacks = parallel_stacks(model)
    if bp > 1 and not any(stack.branch_parallel for stack in stacks):
        raise ValueError("--bp 2 needs --parallel-evoformer (the model has no parallel Evoformer block)")
    if dap > 1 and not stacks:
        raise TypeError(f"{type(model).__name__} lists no parallel stacks (parallel_stacks()): DAP cannot shard it")
    for stack in stacks:
        stack.set_parallelism(dap_group, branch if stack.branch_parallel else None)
    return grad_sync.install_grad_scale_hooks(stacks, dap, bp) if grad_hooks else []


__all__ = ["ParallelModel", "ParallelStack", "parallel_stacks", "parallelize"]
