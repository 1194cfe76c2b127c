"""The processes of a run and model parallelism for AlphaFold training: rank discovery, the rank
layout and its process groups, Dynamic Axial Parallelism (DAP), Duality Async Operations, Parallel
Evoformer + Branch Parallelism (BP) and gradient sync.

* ``runtime``         -- rank discovery (torchrun / Slurm / MPI), device, :func:`init_distributed`;
* ``primitives``      -- differentiable scatter / gather (sum or split backward) / all_to_all;
* ``axial``           -- the named layout-switch calls the model makes (identity when DAP is off);
* ``async_ops``       -- Duality Async Operations: launch/wait pair overlapping a collective with
  independent compute in forward and its reverse in backward;
* ``volume``          -- the analytic bytes of one DAP Evoformer block (checked against the counter);
* ``branch_parallel`` -- BP exchanges and per-branch dropout streams;
* ``grad_sync``       -- which gradients are summed over DAP / BP, then the DP mean;
* ``parallelize``     -- :func:`parallelize`: DAP / BP applied to the model's listed stacks;
* ``layout``          -- world = DP x BP x DAP + eval ranks, validated once, every derived size;
* ``data``            -- batch broadcast inside a model group;
* ``context``         -- :class:`ParallelContext`, the one owner of every process group (training,
  evaluation, bridge, DAP, BP, model groups), built by :func:`build_parallel_context`;
* ``launch``          -- local gloo processes for tests and CPU experiments;
* ``heartbeat``       -- liveness of the ranks over the rendezvous store: the one line naming a dead or
  stalled rank (``--stall-timeout``, ``--dead-peer-timeout``; docs/faults.md).
"""

from scalefold.distributed.context import ParallelContext, build_parallel_context, setup_model_parallel
from scalefold.distributed.group import CommStats, DAPGroup
from scalefold.distributed.layout import LayoutError, ParallelLayout
from scalefold.distributed.parallelize import parallelize

__all__ = [
    "CommStats", "DAPGroup", "LayoutError", "ParallelContext", "ParallelLayout", "build_parallel_context",
    "parallelize", "setup_model_parallel",
]  # fmt: skip
