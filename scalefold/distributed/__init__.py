"""Model parallelism for AlphaFold training: Dynamic Axial Parallelism (DAP), Duality Async
Operations, Parallel Evoformer + Branch Parallelism (BP), gradient sync and the rank layout.

* ``primitives``      -- differentiable scatter / gather (sum or split backward) / all_to_all;
* ``axial``           -- the named layout-switch calls the model makes (identity when DAP is off);
* ``async_ops``       -- Duality Async Operations: launch/wait pair overlapping a collective with
  independent compute in forward and its reverse in backward;
* ``volume``          -- the analytic bytes of one DAP Evoformer block (checked against the counter);
* ``branch_parallel`` -- BP exchanges and per-branch dropout streams;
* ``grad_sync``       -- which gradients are summed over DAP / BP, then the DP mean;
* ``parallelize``     -- :func:`parallelize`: DAP / BP applied to the model's listed stacks;
* ``layout``          -- world = DP x BP x DAP + eval ranks, validation;
* ``data``            -- batch broadcast inside a model group;
* ``context``         -- :func:`setup_model_parallel` -> :class:`ParallelContext` (what the loop uses).
"""

from scalefold.distributed.context import ParallelContext, setup_model_parallel
from scalefold.distributed.group import CommStats, DAPGroup
from scalefold.distributed.layout import LayoutError, ParallelLayout
from scalefold.distributed.parallelize import parallelize

__all__ = [
    "CommStats",
    "DAPGroup",
    "LayoutError",
    "ParallelContext",
    "ParallelLayout",
    "parallelize",
    "setup_model_parallel",
]
