"""Compilations inside a capture: a ``torch.compile`` region meeting inputs it was not compiled for, or a
Triton kernel compiled (JIT or autotuning) for the first time, while a graph is being captured.

Nothing may compile inside a capture (``../shared/docs/kernels.md``): inductor's compile and Triton's JIT
allocate, synchronise and load modules, which a stream capture refuses -- and the capture fails with an
error that names neither the region nor the shape. The whole step's capture procedure therefore runs the
step eagerly first (the backend's warm-up iterations, per recycling count: every compiled region and Triton
kernel meets there every shape the capture will see), and :func:`watching` notes any compilation that still
happens while capturing, with the region and the shapes that caused it:

* ``torch._dynamo``: its frame callback runs for a region's code with compiled versions only when none of
  them fits the inputs (a recompile) -- under the emulated capture's dispatch mode Dynamo then runs the
  region eagerly instead, so the miss is all that shows (a region never compiled before is met by the
  warm-up iterations, which run every region the capture will);
* Triton: ``triton.knobs.runtime.jit_cache_hook``, called before each kernel compilation.

The emulated capture (:mod:`scalefold.compilation.emulated_capture`) refuses a recording that compiled
(``CaptureRefused``, rule ``recompile``); the real one (:class:`~scalefold.compilation.cuda_graphs.CudaGraphBackend`)
raises :class:`CompiledInCapture` with the same line. Either way the whole step's warm-up turns graphs off
in one line and the run goes on eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class CompiledInCapture(RuntimeError):
    """A compilation happened while a CUDA graph was captured (the region and shapes in the message)."""


@dataclass(frozen=True)
class Compilation:
    what: str  # "torch.compile region <name> (<file>:<line>)" or "Triton kernel <repr>"
    inputs: str  # the shapes that were not compiled for
    where: str = ""  # the line that called the region (the caller's own code)

    def describe(self) -> str:
        return (f"a compilation ({self.what} meets inputs it was not compiled for: {self.inputs}; warm every shape "
                "the capture sees before capturing)")  # fmt: skip


def _shown(path: str) -> str:
    p = Path(path).resolve()
    return p.relative_to(_PACKAGE_ROOT).as_posix() if p.is_relative_to(_PACKAGE_ROOT) else p.name


def _inputs(frame: Any) -> str:
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    shown = []
    for name in names:
        value = frame.f_locals.get(name)
        if isinstance(value, torch.Tensor):
            shown.append(f"{name} {str(value.dtype).removeprefix('torch.')}{list(value.shape)}")
    return ", ".join(shown) or "(no tensor arguments)"


def _fits_outside_the_emulation(frame: Any) -> bool:
    """Whether a compiled version of ``frame``'s code fits it once the emulated capture's modes are off (Dynamo
    guards on the mode stacks and the tensors' dispatch keys, which a real capture leaves as they were): a hit
    on a GPU, not a recompile."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.overrides import _pop_mode_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with ExitStack() as stack:
        stack.enter_context(_disable_current_modes())  # the recorder's dispatch mode
        for _ in range(torch._C._len_torch_function_stack()):
            stack.enter_context(_pop_mode_temporarily())
        return any(entry.guard_manager.check(frame.f_locals) for entry in _debug_get_cache_entry_list(frame.f_code))


@contextmanager
def _dynamo_misses(found: list[Compilation], site: Callable[[], str], emulated: bool) -> Iterator[None]:
    try:
        from torch._dynamo.convert_frame import CatchErrorsWrapper
        from torch._dynamo.types import ConvertFrameReturn
    except ImportError:  # a torch without Dynamo: nothing compiles
        yield
        return
    original = CatchErrorsWrapper.__call__

    def call(self: Any, frame: Any, cache_entry: Any, frame_state: Any) -> Any:
        # a region compiled before, none of whose versions fits: a recompile (under the emulation: unless only
        # the emulation's own mode stack is what does not fit)
        if cache_entry is not None and not (emulated and _fits_outside_the_emulation(frame)):
            code = frame.f_code
            what = f"torch.compile region {code.co_name} ({_shown(code.co_filename)}:{code.co_firstlineno})"
            found.append(Compilation(what, _inputs(frame), site()))
        if emulated:  # run eagerly under the recording, this time only (Dynamo's own skip would be for good)
            return ConvertFrameReturn(apply_to_code=False, skip_reason="the emulated capture records eager operators")
        return original(self, frame, cache_entry, frame_state)

    CatchErrorsWrapper.__call__ = call
    try:
        yield
    finally:
        CatchErrorsWrapper.__call__ = original


@contextmanager
def _triton_compiles(found: list[Compilation], site: Callable[[], str]) -> Iterator[None]:
    try:
        from triton import knobs
    except ImportError:  # no Triton (or an old one without knobs): nothing to watch
        yield
        return
    previous = knobs.runtime.jit_cache_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        found.append(Compilation(f"Triton kernel {str(kwargs.get('repr', '?'))[:160]}", "a new specialisation", site()))
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous


@contextmanager
def watching(found: list[Compilation], site: Callable[[], str] = lambda: "",
             emulated: bool = False) -> Iterator[list[Compilation]]:  # fmt: skip
    """Within the block, every compilation (Dynamo cache miss of a region, Triton kernel compile) is appended
    to ``found`` (``site()``: the line to name with it); ``emulated``: inside the emulated capture's recording
    (regions run eagerly there, without marking their code skipped for the rest of the process)."""
    with ExitStack() as stack:
        stack.enter_context(_dynamo_misses(found, site, emulated))
        stack.enter_context(_triton_compiles(found, site))
        yield found


__all__ = ["Compilation", "CompiledInCapture", "watching"]
