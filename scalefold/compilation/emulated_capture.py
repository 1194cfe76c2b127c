"""A CUDA graph's semantics on the CPU: record a step once, replay the recording without its Python.

A real capture (:class:`~scalefold.compilation.cuda_graphs.CudaGraphBackend`) records kernels; a replay
launches them again and runs **no Python**: counters, flags and host mirrors change only while capturing,
Python values are the capture's at every replay, tensors are read and written at the addresses they had.
A CPU "graph" that calls the step's Python again keeps none of these rules, so it cannot fail where a
GPU fails. :class:`EmulatedGraphBackend` keeps them:

* **Capture** runs the function once eagerly (as the real backend's side-stream warm-up: lazy caches,
  constant tables, the optimizer's staging buffers are filled there), then once under a
  ``TorchDispatchMode`` that records every ATen operator the dispatcher runs -- forward, the autograd
  engine's backward (on the CPU it runs on the calling thread), activation checkpointing's
  recomputation, the optimizer -- with its arguments: a tensor made by an earlier recorded operator
  becomes a reference to that operator's output (matched by storage, offset, shape, stride and dtype,
  so autograd's saved-tensor copies resolve too), any other tensor is a constant held **by reference**
  (parameters, the optimizer's flat buffers, the learning-rate tensor, the static batch buffers: their
  addresses, as a CUDA graph holds them), any other value is baked in.
* **Replay** runs the recorded operators in order (``torch.no_grad``; each intermediate freed after its
  last use) and copies the outputs into the capture's output tensors, which it returns: the static
  outputs, overwritten by the next replay (clone what must outlive it). Dropout's draws are operators on
  the default generator, so a replay draws new masks from the generator's state at replay time, as a
  CUDA graph's philox offset advances.
* **Collectives** as a GPU runs them (:mod:`scalefold.compilation.emulated_collectives`): a collective's
  ``wait()`` is recorded where the step waits; a replay poisons the collective's outputs at issue and
  writes its results at that wait, so a consumer reading before the wait reads the poison. A collective
  never waited inside the region is refused (its stream would never join the capture).
* **Refused** while recording, raising :class:`CaptureRefused` with the file and line of the caller's own
  code that made the call and the rule's name: every rule of
  :data:`scalefold.compilation.capture_rules.RULES` -- device-to-host reads (``.item()``, ``float()``,
  ``bool()``, ``.tolist()``, ``.numpy()``, ``.cpu()`` / ``.to("cpu")`` (the CPU stands for the device),
  ``nonzero``, ``masked_select``, ``unique``, ``torch.equal``, boolean-mask indexing and assignment,
  ``repeat_interleave`` without ``output_size``, ``bincount``, ``histc`` over the data's range, ``F.one_hot``
  without ``num_classes``, ``torch.normal`` with a tensor std, ``torch.linalg``'s error checks and
  decompositions), host-to-device copies of host data (``torch.tensor`` / ``new_tensor`` / ``as_tensor`` /
  ``from_numpy``), a random-number-generator state read or set (as ``torch.utils.checkpoint`` makes them
  when it preserves the RNG state), host synchronisations (``torch.cuda`` / ``torch.cpu`` /
  ``torch.accelerator.synchronize``, ``torch.distributed.barrier``) -- and a compilation (a ``torch.compile``
  region meeting inputs it was not compiled for: :mod:`scalefold.compilation.capture_compiles`). Reads that
  only a CPU makes (``F.one_hot``'s range check with ``num_classes`` given) are let through: the GPU does
  not make them.

What it does not emulate: the memory pool (a replay allocates its intermediates from the CPU allocator),
kernels the CPU never runs (Triton under capture, NCCL), stream and event synchronisation (no CUDA streams
on the CPU), and a CPU tensor's work inside a GPU step (here the emulated device *is* the CPU).
``tests/compilation/test_capture_rules.py`` plants each rule's operation in a captured function and sees it
reported at its line, and let through once the rule is removed.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from scalefold.compilation import capture_compiles
from scalefold.compilation import capture_rules as rules
from scalefold.compilation import emulated_collectives as collectives
from scalefold.kernels import elementwise

_HERE = frozenset({Path(__file__).resolve()})
_MACHINERY = _HERE | {Path(rules.__file__).resolve()} | {
    Path(__file__).resolve().with_name(name)
    for name in ("graphed_step.py", "graph_modes.py", "recycling_graphs.py", "whole_step_graphs.py", "cuda_graphs.py",
                 "capture_compiles.py", "emulated_collectives.py", "replay_watch.py")
}
_LIBRARIES = (Path(os.__file__).resolve().parent, Path(torch.__file__).resolve().parent)


def _site() -> str:
    """``path:line (function)`` of the innermost frame of the caller's own code (ScaleFold, a test, a
    script: not torch, not the standard library, not this capture machinery) -- the line to change."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path in _MACHINERY or "site-packages" in path.parts or any(path.is_relative_to(d) for d in _LIBRARIES):
            continue
        package = Path(__file__).resolve().parents[2]
        shown = path.relative_to(package) if path.is_relative_to(package) else path
        return f"{shown.as_posix()}:{frame.lineno} ({frame.name})"
    return ""


class CaptureRefused(RuntimeError):
    """An operation a CUDA-graph capture refuses, made inside the captured region (``what``, at ``where``;
    ``rule``: the name of its :class:`~scalefold.compilation.capture_rules.Rule`)."""

    def __init__(self, what: str, where: str, rule: str = "") -> None:
        self.what, self.where, self.rule = what, where, rule
        super().__init__(f"{what} inside the captured region" + (f" at {where}" if where else ""))


_survey: list[list[tuple[str, str]]] = []  # record(..., survey=...): refusals listed, not raised


def _refuse(rule: rules.Rule, detail: str = "") -> None:
    what, where = rule.what + (f" ({detail})" if detail else ""), _site()
    if _survey:
        if (what, where) not in _survey[-1]:
            _survey[-1].append((what, where))
        return
    raise CaptureRefused(what, where, rule.name)


def _signature(t: torch.Tensor) -> tuple:
    """What makes two tensor objects the same memory to a graph: address, dtype, shape, stride."""
    return (t.data_ptr(), t.dtype, t.shape, t.stride())


class _Recorder(TorchDispatchMode):
    """Records every operator run inside it; refuses what a capture refuses (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[tuple[Any, tuple[list, dict], list[tuple], Any]] = []  # op, arguments, fills, outputs
        self.slots: dict[tuple, int] = {}
        self.values: list[torch.Tensor] = []  # every recorded output, alive until the capture ends
        self.cpu_only_depth = 0
        self.in_wait = 0  # inside a collective's ``Work.wait()``: not recorded
        self.scalar_setitem = 0  # inside ``t[index] = number``: its 0-dim scalar is a fill on a device, not a copy
        self.issued: dict[int, tuple[int, Any, str]] = {}  # a collective's Work -> (its node, the Work, its line)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.in_wait:
            # a collective's own completion (gloo's reduce-scatter copies this rank's chunk out of an internal
            # buffer inside ``Work.wait()``): part of the collective, which a replay runs again whole and waits
            # on -- recorded, it would copy the capture's stale buffer over every replay's result
            return func(*args, **kwargs)
        rule = rules.op_rule(func, args, kwargs)
        if rule is not None and rule.name == "host_to_device" and self.scalar_setitem and args[0].dim() == 0:
            rule = None
        if rule is not None and not (self.cpu_only_depth and func in rules.SYNC_OPS and rules.on_cpu(args)):
            _refuse(rule)
        out = func(*args, **kwargs)
        if rule is not None:  # a CPU-only read: its value decides nothing a replay computes
            return out
        template, subs = self._template(args, kwargs)
        out_slots: list[int | None] | int | None = [self._new_slot(y) for y in out] if isinstance(out, (tuple, list)) \
            else self._new_slot(out)  # fmt: skip
        self.nodes.append((func, template, subs, out_slots))
        if func.namespace == "c10d":  # its wait() becomes a node where the step waits (emulated_collectives)
            work = collectives.work_of(out)
            if work is not None:
                self.issued[id(work)] = (len(self.nodes) - 1, work, _site())
        return out

    def waited(self, work: Any) -> None:
        """The step waits for ``work`` here: the replay completes its collective at this node."""
        entry = self.issued.pop(id(work), None)
        if entry is not None and not self.in_wait:
            self.nodes.append((collectives.WaitFor(entry[0]), ([], {}), [], None))

    def unwaited(self) -> None:
        """Refuse a collective issued in the region and not waited there (its stream never joins the capture)."""
        for _, _, where in self.issued.values():
            if _survey:
                _survey[-1].append((collectives.NEVER_WAITED, where))
            else:
                raise CaptureRefused(collectives.NEVER_WAITED, where, "never_waited")

    def _new_slot(self, y: Any) -> int | None:
        if not isinstance(y, torch.Tensor):
            return None
        self.slots[_signature(y)] = len(self.values)
        self.values.append(y)
        return len(self.values) - 1

    def _ref(self, x: Any) -> int | None:
        return self.slots.get(_signature(x)) if isinstance(x, torch.Tensor) else None

    def _template(self, args: tuple, kwargs: dict) -> tuple[tuple[list, dict], list[tuple]]:
        """The call's arguments with each recorded tensor's place noted: ``(args, kwargs)`` holding the
        constants and literals, and ``(container, key, slot)`` -- or ``(container, key, slot, index, ...)``
        inside (nested) tensor lists, as collectives take them -- for the places a replay fills."""
        template = (list(args), dict(kwargs))
        subs: list[tuple] = []

        def walk(x: Any, where: tuple) -> None:
            slot = self._ref(x)
            if slot is not None:
                subs.append(where[:2] + (slot,) + where[2:])
            elif isinstance(x, (list, tuple)):
                for i, y in enumerate(x):
                    walk(y, where + (i,))

        for container, keys in ((0, range(len(args))), (1, list(kwargs))):
            for key in keys:
                walk(template[container][key], (container, key))
        return template, subs


class _HostCalls(TorchFunctionMode):
    """``Tensor.tolist`` / ``numpy`` / ``__array__`` read the storage without dispatching: refused here;
    ``F.one_hot``'s CPU-only range check let through, and ``t[index] = number``'s scalar (a fill kernel on a
    device, a 0-dim ``lift_fresh`` on the CPU)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        rule = rules.function_rule(name, args, kwargs or {})
        if rule is not None:
            _refuse(rule, f"Tensor.{name}" if rule.name != "one_hot_unsized" else "")
        depth = None
        if name in rules.CPU_ONLY_FUNCTIONS and rules.on_cpu(args[:1]):
            depth = "cpu_only_depth"
        elif name == "__setitem__" and len(args) == 3 and isinstance(args[2], (bool, int, float)):
            depth = "scalar_setitem"  # on CUDA the number is written by a fill kernel (capturable)
        if depth is None:
            return func(*args, **(kwargs or {}))
        setattr(self.recorder, depth, getattr(self.recorder, depth) + 1)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            setattr(self.recorder, depth, getattr(self.recorder, depth) - 1)


@contextmanager
def _unrecorded_waits(recorder: _Recorder) -> Iterator[None]:
    """``Work.wait()`` runs unrecorded: what a backend does there finishes the collective (see
    :meth:`_Recorder.__torch_dispatch__`); the place of the wait is recorded (:meth:`_Recorder.waited`), where
    a replay completes the collective (:mod:`scalefold.compilation.emulated_collectives`)."""
    import torch.distributed as dist

    work = getattr(dist, "Work", None) if dist.is_available() else None
    if work is None:
        yield
        return
    original = work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.waited(self)
        recorder.in_wait += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.in_wait -= 1

    work.wait = wait
    try:
        yield
    finally:
        work.wait = original


@contextmanager
def _refused_calls() -> Iterator[None]:
    """The module functions of the ``calls`` rules (generator state, synchronisations, a barrier) raise inside."""
    saved: list[tuple[Any, str, Any]] = []

    def refusing(rule: rules.Rule, qualname: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            _refuse(rule, qualname)
            return original(*args, **kwargs)  # surveying: go on

        return call

    try:
        for rule, module_name, attr in rules.call_rules():
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # e.g. torch.distributed on a build without it
                continue
            if hasattr(module, attr):
                original = getattr(module, attr)
                saved.append((module, attr, original))
                setattr(module, attr, refusing(rule, f"{module_name}.{attr}", original))
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


# -- outputs: tensors in nested dicts / lists / tuples / dataclasses ----------------------------------


def _flatten(obj: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Callable[[Iterator[torch.Tensor]], Any]:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return lambda it: next(it)
        if isinstance(x, dict):
            parts = {k: walk(v) for k, v in x.items()}
            return lambda it: {k: build(it) for k, build in parts.items()}
        if isinstance(x, (list, tuple)):
            items = [walk(v) for v in x]
            kind = type(x)
            return lambda it: kind(build(it) for build in items)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = {f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
            return lambda it: dataclasses.replace(x, **{k: build(it) for k, build in fields.items()})
        return lambda it: x

    builder = walk(obj)
    return tensors, lambda values: builder(iter(values))


class EmulatedGraph:
    """A recorded function: :meth:`replay` runs its operators again, no Python of the function."""

    def __init__(self, recorder: _Recorder, output: Any) -> None:
        self.nodes = recorder.nodes
        out_tensors, self._rebuild = _flatten(output)
        self._out_slots = [recorder.slots.get(_signature(t)) for t in out_tensors]
        self.static_outputs = [t.detach() for t in out_tensors]  # overwritten by each replay
        self.output = self._rebuild(self.static_outputs)
        self.num_slots = len(recorder.values)
        self._free_after = self._last_uses()

    def __len__(self) -> int:
        return len(self.nodes)

    def _last_uses(self) -> list[list[int]]:
        """Per node, the slots whose last reader it is (freed after it runs); the outputs are kept."""
        last: dict[int, int] = {}
        for i, (_, _, subs, outs) in enumerate(self.nodes):
            for sub in subs:
                last[sub[2]] = i
            for s in outs if isinstance(outs, list) else (outs,):
                if s is not None:
                    last.setdefault(s, i)
        keep = {s for s in self._out_slots if s is not None}
        free: list[list[int]] = [[] for _ in self.nodes]
        for slot, i in last.items():
            if slot not in keep:
                free[i].append(slot)
        return free

    def replay(self) -> Any:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._replay()
        finally:
            if collecting:
                gc.enable()

    @torch.no_grad()
    def _replay(self) -> Any:
        env: list[Any] = [None] * self.num_slots
        pending: dict[int, collectives.Pending] = {}  # collectives issued, not yet waited: outputs poisoned
        for index, ((func, (args, kwargs), subs, outs), free) in enumerate(zip(self.nodes, self._free_after)):
            if func.__class__ is collectives.WaitFor:
                func.complete(pending)
                continue
            if subs:
                call = (list(args), dict(kwargs))
                for sub in subs:
                    if len(sub) == 3:
                        call[sub[0]][sub[1]] = env[sub[2]]
                    else:
                        _fill(call[sub[0]], sub[1], sub[3:], env[sub[2]])
                args, kwargs = call
            if func.namespace == "c10d":  # a collective: its outputs valid only at its wait
                out, pending[index] = collectives.issue(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if outs.__class__ is int:
                env[outs] = out
            elif outs is not None:
                for slot, y in zip(outs, out):
                    if slot is not None:
                        env[slot] = y
            for slot in free:
                env[slot] = None
        for left in pending.values():  # a collective without a Work to wait on (none in c10d today)
            left.complete()
        for static, slot in zip(self.static_outputs, self._out_slots):
            if slot is not None and env[slot] is not None and env[slot] is not static:
                static.copy_(env[slot])
        return self.output


def _fill(container: Any, key: Any, path: tuple, value: torch.Tensor) -> None:
    """``container[key][path...] = value``, copying the (nested) lists on the way (the template is shared)."""
    if not path:
        container[key] = value
        return
    inner = list(container[key])
    container[key] = inner
    _fill(inner, path[0], path[1:], value)


def record(fn: Callable[..., Any], *args: Any, survey: list[tuple[str, str]] | None = None) -> EmulatedGraph:
    """Run ``fn(*args)`` once, recording it (refusing what a capture refuses): the :class:`EmulatedGraph`.
    ``survey``: list every refused operation there as ``(what, where)`` and go on instead of raising (a
    tool's view of all that a step would have to change; the graph is then not a faithful one)."""
    recorder = _Recorder()
    if survey is not None:
        _survey.append(survey)
    collecting = gc.isenabled()
    gc.disable()  # tens of thousands of recorded operators: the cyclic collector would rescan them all, often
    try:
        compiled: list[capture_compiles.Compilation] = []
        # --compile's elementwise chains as their references: Dynamo runs no compiled region under a dispatch mode
        # (and a fullgraph one would raise), so the recording holds the eager operators either way
        with _refused_calls(), _unrecorded_waits(recorder), capture_compiles.watching(compiled, _site, emulated=True), \
                elementwise.mode(None), _HostCalls(recorder), recorder:  # fmt: skip
            output = fn(*args)
        recorder.unwaited()
        for compilation in compiled:  # a region Dynamo would have compiled here (it ran eagerly under the mode)
            if _survey:
                _survey[-1].append((compilation.describe(), compilation.where))
            else:
                raise CaptureRefused(compilation.describe(), compilation.where, "recompile")
        return EmulatedGraph(recorder, output)
    finally:
        if collecting:
            gc.enable()
        if survey is not None:
            _survey.pop()


class EmulatedGraphBackend:
    """The :class:`~scalefold.compilation.cuda_graphs.GraphBackend` of ``--cuda-graphs step`` on a CPU: the
    capture bookkeeping (static buffers, warm-up, undo, per-count graphs, fallback) runs unchanged on top
    of it. ``warmup_iters`` eager calls before the recording (as the real backend's side stream)."""

    device_type = "cpu"
    emulated = True

    def __init__(self, warmup_iters: int = 1) -> None:
        self.warmup_iters = warmup_iters
        self.graphs: list[EmulatedGraph] = []

    def is_available(self) -> bool:
        return True

    def capture(self, fn: Callable[..., Any], static_args: tuple) -> Callable[[], Any]:
        for _ in range(self.warmup_iters):
            fn(*static_args)
        graph = record(fn, *static_args)
        self.graphs.append(graph)
        return graph.replay

    def capture_with_grad(self, module: torch.nn.Module, example_args: tuple) -> Callable[..., Any]:
        raise NotImplementedError("the emulated capture records no-grad regions and whole steps, not "
                                  "make_graphed_callables' forward/backward pairs")  # fmt: skip


__all__ = ["CaptureRefused", "EmulatedGraph", "EmulatedGraphBackend", "record"]
