"""Which CUDA graphs a run gets (``--cuda-graphs``), and what both graph kinds share.

Two kinds of graph, each in a file of its own: the recycling passes' graphs
(:mod:`scalefold.compilation.recycling_graphs`, ``--cuda-graphs recycling`` / ``on``) and the whole step's
(:mod:`scalefold.compilation.whole_step_graphs`, ``--cuda-graphs step``: its capture procedure -- warm-up,
capture, the check against eager, the fallback -- is read there, in ``WholeStepGraphs.warm_up``). This module
resolves a mode for a device and layout (:func:`resolve_mode`; the whole step's
``scalefold.compilation.whole_step_graphs.resolve_step_mode`` builds on it), says where the CPU emulation runs
(:func:`emulated_capture`), and holds the pieces both warm-up checks use: the synthetic batch of the training
shapes, the random number generators' states, the failing line of a capture. ``scalefold.compilation.graphed_step``
re-exports the public names of all three modules.
"""

from __future__ import annotations

import random
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scalefold.config.training import CUDA_GRAPHS_MODES, ConfigError

MODES = CUDA_GRAPHS_MODES  # one list: the config validates it too

VALIDATION_SEED = 20240613  # the seed of both warm-up checks' steps



STRICT_MODES = ("on", "recycling", "step")  # refused where graphs cannot be used


class CudaGraphsUnavailable(ConfigError):
    """``--cuda-graphs on|recycling|step`` where graphs cannot be used (not CUDA, DAP/BP > 1): refused before
    training."""


def resolve_mode(mode: str, device_type: str, model_parallel: int = 1, backend_available: bool = True,
                 graph_device_type: str = "cuda", unsupported: str | None = None) -> tuple[bool, str]:  # fmt: skip
    """``(graphs on, why)`` for ``--cuda-graphs mode`` on ``device_type`` with DAP x BP = ``model_parallel``;
    ``unsupported``: why the model's recycling passes cannot be captured (:func:`scalefold.compilation.recycling_graphs.uncapturable_reason`).

    ``on`` raises :class:`CudaGraphsUnavailable` where graphs cannot be used; ``auto`` quietly resolves to off there.
    """
    if mode not in MODES:
        raise ValueError(f"--cuda-graphs must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return False, "--cuda-graphs off"
    if emulated_capture(mode, device_type):  # the whole step's capture, emulated (its graphs are the CPU's)
        graph_device_type, backend_available = "cpu", True
    if mode in STRICT_MODES and mode != "on":  # recycling / step: refused where graphs cannot be used, as on
        try:
            enabled, why = resolve_mode("on", device_type, model_parallel, backend_available, graph_device_type,
                                        unsupported)  # fmt: skip
        except CudaGraphsUnavailable as exc:
            raise CudaGraphsUnavailable(str(exc).replace("--cuda-graphs on", f"--cuda-graphs {mode}")) from None
        return enabled, why.replace("--cuda-graphs on", f"--cuda-graphs {mode}")
    if device_type != graph_device_type or not backend_available:
        if mode == "on":
            raise CudaGraphsUnavailable(f"--cuda-graphs on needs a CUDA device (this run computes on {device_type}); "
                             "use --cuda-graphs auto or off")  # fmt: skip
        return False, f"the device is {device_type}, not CUDA"
    if model_parallel > 1:
        why = "DAP/BP collectives run inside the recycling passes and are not captured"
        if mode == "on":
            raise CudaGraphsUnavailable(
                f"--cuda-graphs on is not supported with --dap/--bp > 1 ({why}); use auto or off"
            )
        return False, why
    if unsupported:
        if mode == "on":
            raise CudaGraphsUnavailable(f"--cuda-graphs on is not supported here: {unsupported}; use auto or off")
        return False, unsupported
    return True, f"--cuda-graphs {mode}: CUDA device, no DAP/BP"


def emulated_capture(mode: str, device_type: str) -> bool:
    """Whether ``--cuda-graphs mode`` on ``device_type`` runs the CPU emulation of a capture: ``step`` on a
    CPU (:mod:`scalefold.compilation.emulated_capture`; ``auto`` keeps eager there)."""
    return mode == "step" and device_type == "cpu"



def rng_states(device: torch.device) -> list[tuple[str, Any]]:
    """The generators a captured region must leave as eager code would: torch's CPU and (CUDA) device
    generators, Python's ``random`` and NumPy's global state."""
    states: list[tuple[str, Any]] = [("torch CPU", torch.get_rng_state())]
    if device.type == "cuda":
        states.append(("CUDA", torch.cuda.get_rng_state(device)))
    states += [("Python", random.getstate()), ("NumPy", np.random.get_state())]
    return states


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def failure_site(exc: BaseException) -> str:
    """`` at path:line (function)`` of the innermost frame of the ``scalefold`` package, outside this
    machinery, that raised ``exc`` (e.g. the model line doing a host sync), or ``""``."""
    package = Path(__file__).resolve().parents[1]  # .../scalefold
    ours = {package / "compilation" / name for name in _MACHINERY}
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(package) and path not in ours:
            return f" at {path.relative_to(package.parent)}:{frame.lineno} ({frame.name})"
    return ""


def synthetic_step_batch(features: Any, model: torch.nn.Module, device: torch.device,
                         dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """A random batch with the training shapes (crop, MSA clusters, extra MSA, templates, all ``R``
    recycling slices) -- what the pipeline pads every training sample to -- on ``device`` (``seed``: its
    own generator's)."""
    from scalefold.data.batch import move_batch
    from scalefold.model.features import make_synthetic_batch

    embedder = model.config.input_embedder_config
    batch = make_synthetic_batch(
        features.train_sequence_crop_size, features.max_msa_clusters, features.max_extra_msa,
        features.max_templates, num_recycling_iters=features.num_ensembles - 1, tf_dim=embedder.tf_dim,
        msa_dim=embedder.msa_dim, seed=seed,
    )  # fmt: skip
    return move_batch(batch, device, dtype)



#: the capture machinery's own files: a failure's line is the first frame outside them
_MACHINERY = ("graph_modes.py", "recycling_graphs.py", "whole_step_graphs.py", "graphed_step.py", "cuda_graphs.py",
              "emulated_capture.py", "capture_rules.py")  # fmt: skip

__all__ = ["MODES", "STRICT_MODES", "VALIDATION_SEED", "CudaGraphsUnavailable", "emulated_capture", "failure_site",
           "resolve_mode", "rng_states", "same_state", "synthetic_step_batch"]  # fmt: skip
