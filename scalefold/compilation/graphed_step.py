"""CUDA graphs of the training step (``--cuda-graphs``): where each graph kind lives.

Two graph kinds, one file each, and the choice between them:

* :mod:`scalefold.compilation.graph_modes` -- which graphs a run gets (``off`` / ``auto`` / ``recycling`` /
  ``on`` / ``step``, per device and layout), where the CPU emulation runs, and what both warm-up checks share
  (the synthetic batch of the training shapes, the generators' states, the failing line of a capture);
* :mod:`scalefold.compilation.recycling_graphs` -- ``--cuda-graphs recycling``: the no-grad recycling passes of
  each recycling count as one graph, the differentiated pass and the update eager (``GraphedStep``);
* :mod:`scalefold.compilation.whole_step_graphs` -- ``--cuda-graphs step``: the whole training step of each
  recycling count as one graph (``WholeStepGraphs``); its capture procedure -- warm-up, capture, the check of
  two consecutive replays against eager, the group's agreement, the fallback -- is read in one place there,
  ``WholeStepGraphs.warm_up``.

This module re-exports their public names, so ``from scalefold.compilation.graphed_step import ...`` keeps
working for the trainer, the benchmarks and the tests.
"""

from __future__ import annotations

from scalefold.compilation.graph_modes import (
    MODES,
    STRICT_MODES,
    CudaGraphsUnavailable,
    emulated_capture,
    resolve_mode,
    synthetic_step_batch,
)
from scalefold.compilation.recycling_graphs import (
    PARALLEL_EVOFORMER_UNCAPTURABLE,
    VALIDATION_TOLERANCE,
    GraphedStep,
    GraphedStepStats,
    setup_graphed_step,
    uncapturable_reason,
)
from scalefold.compilation.whole_step_graphs import (
    WHOLE_STEP_CHECKED_STEPS,
    WHOLE_STEP_DDP,
    WHOLE_STEP_TOLERANCE,
    WholeStepGraphs,
    WholeStepStats,
    perturbed_batch,
    resolve_step_mode,
    setup_step_graphs,
    step_graph_backend,
)

__all__ = [
    "MODES",
    "PARALLEL_EVOFORMER_UNCAPTURABLE",
    "STRICT_MODES",
    "VALIDATION_TOLERANCE",
    "WHOLE_STEP_CHECKED_STEPS",
    "WHOLE_STEP_DDP",
    "WHOLE_STEP_TOLERANCE",
    "CudaGraphsUnavailable",
    "GraphedStep",
    "GraphedStepStats",
    "WholeStepGraphs",
    "WholeStepStats",
    "emulated_capture",
    "perturbed_batch",
    "resolve_mode",
    "resolve_step_mode",
    "setup_graphed_step",
    "setup_step_graphs",
    "step_graph_backend",
    "synthetic_step_batch",
    "uncapturable_reason",
]
