"""Adam + SWA over flat parameter, gradient and state buffers (tensor fusion).

AlphaFold2 trains with Adam (supplement section 1.11.3: beta1 0.9, beta2 0.999, eps 1e-6) and
evaluates an exponential moving average of the weights (section 1.11.7; called SWA in OpenFold /
MLPerf: ``avg <- avg + (p - avg) * (1 - decay)``, decay 0.9 in the benchmark).

The model has 5,044 parameter tensors; updating them one by one costs thousands of small kernel
launches (GPU) or Python iterations (CPU) per step. Here every parameter is a *view* into a few
contiguous buffers, one group per (master dtype, compute dtype, device):

* ``master``      -- the parameters (fp32, or fp64 in tests); ``param.data`` is a view into it;
* ``grad``        -- the gradients; ``param.grad`` (or ``compute_param.grad``) is a view into it;
* ``exp_avg``, ``exp_avg_sq`` -- Adam's moments;
* ``swa``         -- the averaged weights used for evaluation;
* ``compute``     -- optional low-precision copy the model computes with (bf16, ScaleFold).

One optimizer step is then a constant number of vectorised operations per group (per chunk of
``chunk_numel`` elements, see below), whatever the number of tensors. The per-element math is
:func:`scalefold.kernels.adam_swa_`, the one dispatch point for the fused Triton kernel, its
``torch.compile`` variant and the PyTorch reference (:mod:`scalefold.kernels.reference`); the
reference reproduces ``torch.optim.Adam`` (single-tensor path) operation by operation, so fp64
results agree to rounding and, for the same gradients, fp32 results agree bit for bit on CPU (the
clip scale itself may differ in the last bits: one flat norm vs torch's norm of norms).

``lr`` and ``step`` live in device tensors and nothing in :meth:`FlatAdamSWA.step` reads a value back
to the host, so the step can be captured in a CUDA graph (the SWA "first update copies" branch is
decided from a host-side counter, as in ``torch.optim.swa_utils.AveragedModel``).

**The skip on the device.** ``step(clip_scale, apply=flag)`` takes the step's verdict as a 0-dim bool
device tensor (the training step's non-finite skip, agreed between ranks) instead of a host ``if``: each
chunk of the master weights, moments, SWA and compute copy is staged, updated there by the same kernel,
and written back with ``torch.where(apply, updated, old)``; the step count and ``n_averaged`` advance by
``apply``. An applied step is bit-identical to ``step(clip_scale)`` (the same elementwise kernel over the
same chunks); a skipped one leaves every buffer as it was. The host mirrors of the counters (the SWA
branch above, :attr:`num_steps`) are updated by :meth:`settle` once the caller has read the verdict
after the step; the next ``step`` refuses to run before that.

Checkpoints: :meth:`FlatAdamSWA.state_dict` has the per-parameter layout of
``torch.optim.Adam.state_dict()`` (so the MLPerf reference checkpoint's ``optimizer_state_dict`` loads
onto the flat buffers), and :meth:`FlatAdamSWA.swa_state_dict` the layout of the reference's
``AlphaFoldSWA`` module (``averaged_model.n_averaged``, ``averaged_model.module.<name>``).

Gradients must stay in the flat buffer (each ``.grad`` its slot: a storage alias, not an autograd view, see
:meth:`FlatAdamSWA._attach_grads`): use :meth:`FlatAdamSWA.zero_grad` (zeroes in place, never sets ``None``) and,
under DDP, ``gradient_as_bucket_view=False`` (DDP then copies the averaged bucket into the existing ``.grad``).
Build the optimizer before wrapping the model in DDP.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn

from scalefold import kernels
from scalefold.kernels import device_path

# Elements per chunk of the PyTorch reference update: small enough that the reference's
# temporaries stay in the CPU's caches (several times faster than whole-buffer passes on CPU), large
# enough that the launch count stays ~200 for the 93 M-parameter model. ``None``: one pass.
DEFAULT_CHUNK_NUMEL = 1 << 19
# Each parameter's offset in a flat buffer is a multiple of this many elements (128 bytes in fp32),
# so vectorised kernels can use aligned loads. Padding elements stay zero.
DEFAULT_ALIGN_NUMEL = 32
# Elements per staged chunk of a masked step (``step(apply=...)``) on a device, or on the CPU when the
# reference runs unchunked (``chunk_numel=None``): bounds the staging memory to 5 such buffers per group
# (320 MiB in fp32) while keeping the launches few (~6 chunks x 11 for the 93 M-parameter model).
STAGE_NUMEL = 1 << 24

ParamsArg = Union[Iterable[nn.Parameter], Iterable[tuple[str, nn.Parameter]]]


# ----------------------------------------------------------------------------------------------
# Flat buffers
# ----------------------------------------------------------------------------------------------


@dataclass
class FlatGroup:
    """Parameters of one (master dtype, compute dtype, device) and their flat buffers."""

    indices: list[int]  # positions in the optimizer's parameter order
    offsets: list[int]  # start of each parameter in the flat buffers
    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    swa: torch.Tensor
    compute: torch.Tensor | None

    def views(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        return [flat[o : o + math.prod(s)].view(s) for o, s in zip(self.offsets, shapes)]

    def aliases(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """:meth:`views`' memory as tensors that are not autograd views of ``flat`` (``.grad``: see
        :meth:`FlatAdamSWA._attach_grads`)."""
        return [storage_alias(v) for v in self.views(flat, shapes)]


def storage_alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on ``view``'s storage, offset, sizes and strides that is not an autograd view (no ``_base``):
    writes through either are seen by the other."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _align(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class FlatAdamSWA:
    """Adam (torch.optim.Adam semantics, no weight decay) + SWA over flat buffers.

    Args:
        params: parameters, or ``(name, parameter)`` pairs (names key the SWA state dict).
        compute_params: optional compute copy (same order and shapes; e.g. the bf16 model's
            parameters). Gradients are then read from the compute copy, which is rewritten from the
            master weights after every step.
        lr, betas, eps: Adam hyper-parameters (lr lives in the device tensor ``self.lr``).
        swa_decay: SWA/EMA decay (0.9 in the benchmark).
        chunk_numel: elements per chunk of the reference update (``None`` = one pass).
        align_numel: alignment of each parameter inside the flat buffers.
        backend: ``"auto"``, ``"torch"`` (the reference), ``"compile"`` or ``"triton"``: see
            :func:`scalefold.kernels.adam_swa_`.
    """

    def __init__(
        self,
        params: ParamsArg,
        compute_params: Iterable[torch.Tensor] | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        swa_decay: float = 0.9,
        chunk_numel: int | None = DEFAULT_CHUNK_NUMEL,
        align_numel: int = DEFAULT_ALIGN_NUMEL,
        backend: str = "auto",
    ) -> None:
        named = list(params)
        if not named:
            raise ValueError("FlatAdamSWA got an empty parameter list")
        if isinstance(named[0], tuple):
            self.names = [n for n, _ in named]
            self.params = [p for _, p in named]
        else:
            self.names = [str(i) for i in range(len(named))]
            self.params = list(named)
        self.compute_params = list(compute_params) if compute_params is not None else None
        if self.compute_params is not None:
            if len(self.compute_params) != len(self.params):
                raise ValueError("compute_params must match params one to one")
            for p, c in zip(self.params, self.compute_params):
                if p.shape != c.shape:
                    raise ValueError(f"compute param shape {tuple(c.shape)} != param shape {tuple(p.shape)}")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("FlatAdamSWA got the same parameter twice")
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.swa_decay = swa_decay
        self.chunk_numel = chunk_numel
        self.backend = backend
        self.shapes = [p.shape for p in self.params]
        device = self.params[0].device
        self.lr = torch.tensor(lr, dtype=torch.float64, device=device)
        self.step_count = torch.zeros((), dtype=torch.float64, device=device)
        self.swa_n_averaged = torch.zeros((), dtype=torch.long, device=device)
        self._n_averaged_host = 0  # mirrors swa_n_averaged without a device sync
        self._steps_host = 0
        self.groups = self._build_groups(align_numel)
        self._grads_checked = False
        self._scratch_buffers: dict[int, list[torch.Tensor]] = {}
        self._stage_buffers: dict[int, list[torch.Tensor | None]] = {}
        self._pending = False  # a step(apply=...) whose verdict the host has not settled yet

    # -- construction -------------------------------------------------------------------------

    def _grad_holders(self) -> list[torch.Tensor]:
        return self.compute_params if self.compute_params is not None else self.params

    def _build_groups(self, align: int) -> list[FlatGroup]:
        holders = self._grad_holders()
        keyed: dict[tuple, list[int]] = {}
        for i, (p, h) in enumerate(zip(self.params, holders)):
            keyed.setdefault((p.dtype, h.dtype, p.device), []).append(i)
        groups = []
        for (dtype, compute_dtype, device), indices in keyed.items():
            offsets, total = [], 0
            for i in indices:
                offsets.append(total)
                total += _align(self.params[i].numel(), align)

            def buf(dt: torch.dtype, n: int = total, dev: torch.device = device) -> torch.Tensor:
                return torch.zeros(n, dtype=dt, device=dev)

            group = FlatGroup(
                indices=indices, offsets=offsets, master=buf(dtype), grad=buf(compute_dtype),
                exp_avg=buf(dtype), exp_avg_sq=buf(dtype), swa=buf(dtype),
                compute=buf(compute_dtype) if self.compute_params is not None else None,
            )  # fmt: skip
            shapes = [self.shapes[i] for i in indices]
            with torch.no_grad():
                for i, view in zip(indices, group.views(group.master, shapes)):
                    view.copy_(self.params[i].detach())
                    self.params[i].data = view
                group.swa.copy_(group.master)  # SWA starts as a copy of the weights
                if group.compute is not None:
                    group.compute.copy_(group.master)
                    for i, view in zip(indices, group.views(group.compute, shapes)):
                        self.compute_params[i].data = view
            groups.append(group)
        self._attach_grads(groups)
        return groups

    def _attach_grads(self, groups: list[FlatGroup] | None = None) -> None:
        """Each ``.grad`` its slot of the flat gradient buffer: a storage alias (:func:`storage_alias`), not an
        autograd view. The memory and every write are the same; but ``torch.compile`` turns each input parameter's
        ``.grad`` into a fake tensor, and a view's base gets a symbolic size per dimension with its guards: with
        views the tiny model's compiled forward took 41 s to compile on the CPU, with aliases 11 s (bench/RESULTS.md,
        "Issue 45, fourth session")."""
        holders = self._grad_holders()
        for group in groups if groups is not None else self.groups:
            shapes = [self.shapes[i] for i in group.indices]
            for i, alias in zip(group.indices, group.aliases(group.grad, shapes)):
                holders[i].grad = alias

    # -- training-step API ----------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zero the flat gradient buffers in place (``.grad`` stays a view of them)."""
        for group in self.groups:
            group.grad.zero_()

    def check_grads_attached(self) -> None:
        """Raise if some ``.grad`` is no longer a view of the flat buffer (e.g. set to ``None``)."""
        holders = self._grad_holders()
        for group in self.groups:
            shapes = [self.shapes[i] for i in group.indices]
            for i, view in zip(group.indices, group.views(group.grad, shapes)):
                g = holders[i].grad
                if g is None or g.data_ptr() != view.data_ptr():
                    raise RuntimeError(
                        f"gradient of parameter {self.names[i]!r} is not a view of the flat buffer; "
                        "use FlatAdamSWA.zero_grad() (not set_to_none) and DDP(gradient_as_bucket_view=False)"
                    )

    def _scratch(self, group: FlatGroup) -> list[torch.Tensor] | None:
        """Chunk-sized temporaries of the reference update, allocated once per group."""
        if self.chunk_numel is None or self.backend == "compile":
            return None
        key = id(group)
        if key not in self._scratch_buffers:
            n = min(self.chunk_numel, group.master.numel())
            self._scratch_buffers[key] = [torch.empty(n, dtype=group.master.dtype, device=group.master.device) for _ in range(3)]
        return self._scratch_buffers[key]

    def set_lr(self, lr: Union[float, torch.Tensor]) -> None:
        self.lr.fill_(lr)

    @torch.no_grad()
    def step(self, clip_scale: torch.Tensor | None = None, apply: torch.Tensor | None = None) -> None:
        """One Adam + SWA step on every parameter; ``clip_scale`` (0-dim tensor) scales the grads.

        ``apply``: a 0-dim bool device tensor -- the update happens only where it is true, decided on
        the device (no host read); call :meth:`settle` with its value before the next step."""
        if not self._grads_checked:
            self.check_grads_attached()
            self._grads_checked = True
        if self._pending:
            raise RuntimeError("FlatAdamSWA.step: the previous step(apply=...) was not settled (call settle())")
        if apply is not None:
            self._masked_step(clip_scale, apply)
            return
        self.step_count.add_(1)
        for group in self.groups:
            kernels.adam_swa_(
                group.master, group.grad, group.exp_avg, group.exp_avg_sq, group.swa, group.compute,
                lr=self.lr, step=self.step_count, clip_scale=clip_scale, beta1=self.beta1, beta2=self.beta2,
                eps=self.eps, swa_decay=self.swa_decay, swa_n_averaged=self._n_averaged_host,
                chunk_numel=self.chunk_numel, scratch=self._scratch(group), backend=self.backend,
            )  # fmt: skip
        self.swa_n_averaged.add_(1)
        self._n_averaged_host += 1
        self._steps_host += 1

    def _masked_step(self, clip_scale: torch.Tensor | None, apply: torch.Tensor) -> None:
        if apply.dim() != 0 or apply.dtype != torch.bool:
            raise ValueError("apply must be a 0-dim bool tensor")
        apply = apply.to(self.step_count.device)
        self.step_count.add_(apply.to(self.step_count.dtype))
        for group in self.groups:
            self._masked_group_update(group, clip_scale, apply)
        self.swa_n_averaged.add_(apply.to(self.swa_n_averaged.dtype))
        self._pending = True

    def _masked_group_update(self, group: FlatGroup, clip_scale: torch.Tensor | None, apply: torch.Tensor) -> None:
        """The group's update chunk by chunk on staged copies, kept where ``apply`` (the reference's own
        chunks: the same elementwise work as the unmasked step)."""
        numel = group.master.numel()
        # the CPU reference's own chunks (bit-identity of its vectorised loops); on a device larger ones (launches)
        on_cpu = device_path.cpu_path(group.master)
        chunk = min(self.chunk_numel if on_cpu and self.chunk_numel else max(self.chunk_numel or 0, STAGE_NUMEL), numel)
        names = ("master", "exp_avg", "exp_avg_sq", "swa", "compute")
        stage = self._stage(group, chunk)
        for start in range(0, numel, chunk):
            sl = slice(start, min(start + chunk, numel))
            n = sl.stop - sl.start
            live = [None if getattr(group, k) is None else getattr(group, k)[sl] for k in names]
            staged = [None if b is None else b[:n] for b in stage]
            for dst, src in zip(staged, live):
                if dst is not None:
                    dst.copy_(src)
            kernels.adam_swa_(
                staged[0], group.grad[sl], staged[1], staged[2], staged[3], staged[4],
                lr=self.lr, step=self.step_count, clip_scale=clip_scale, beta1=self.beta1, beta2=self.beta2,
                eps=self.eps, swa_decay=self.swa_decay, swa_n_averaged=self._n_averaged_host,
                chunk_numel=self.chunk_numel, scratch=self._scratch(group), backend=self.backend,
            )  # fmt: skip
            for new, old in zip(staged, live):
                if new is not None:
                    torch.where(apply, new, old, out=old)

    def _stage(self, group: FlatGroup, chunk: int) -> list[torch.Tensor | None]:
        key = id(group)
        if key not in self._stage_buffers or self._stage_buffers[key][0].numel() < chunk:
            def buf(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else torch.empty(chunk, dtype=t.dtype, device=t.device)

            self._stage_buffers[key] = [buf(group.master), buf(group.exp_avg), buf(group.exp_avg_sq), buf(group.swa),
                                        buf(group.compute)]  # fmt: skip
        return self._stage_buffers[key]

    def settle(self, applied: bool) -> None:
        """The host's side of a ``step(apply=...)``, once the verdict was read after the step: the host
        mirrors of the step count and of SWA's ``n_averaged`` advance where the update was applied."""
        if not self._pending:
            raise RuntimeError("FlatAdamSWA.settle: no step(apply=...) to settle")
        self._pending = False
        if applied:
            self._n_averaged_host += 1
            self._steps_host += 1

    @property
    def capturable(self) -> bool:
        """Whether :meth:`step` is the same work every step from now on (a CUDA graph may capture it):
        not the first SWA update (a copy, decided on the host) and no verdict pending."""
        return self._n_averaged_host > 0 and not self._pending

    def mark_replayed(self) -> None:
        """The host's side of a **replayed** ``step(apply=...)``: a CUDA graph's replay runs no Python, so the
        verdict it left on the device is marked pending here (the caller's :meth:`settle` then follows the
        read verdict, as after an eager step)."""
        if self._pending:
            raise RuntimeError("FlatAdamSWA: a replayed step while the previous step(apply=...) was not settled")
        self._pending = True

    def forget_pending(self) -> None:
        """Drop an unsettled verdict without touching the host mirrors: for steps whose effect is undone
        (a CUDA graph's warm-up and capture, restored from :meth:`snapshot` afterwards)."""
        self._pending = False

    @torch.no_grad()
    def snapshot(self) -> dict:
        """A copy of everything a step changes (weights, moments, SWA, compute copy, counters, lr, host
        mirrors), for :meth:`restore`: warm-up steps that must leave no trace."""
        buffers = [[None if t is None else t.clone() for t in (g.master, g.exp_avg, g.exp_avg_sq, g.swa, g.compute)]
                   for g in self.groups]  # fmt: skip
        scalars = [t.clone() for t in (self.step_count, self.swa_n_averaged, self.lr)]
        return {"buffers": buffers, "scalars": scalars, "host": (self._n_averaged_host, self._steps_host)}

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        """Back to a :meth:`snapshot` (in place: every buffer keeps its address)."""
        for g, saved in zip(self.groups, snap["buffers"]):
            for live, old in zip((g.master, g.exp_avg, g.exp_avg_sq, g.swa, g.compute), saved):
                if live is not None:
                    live.copy_(old)
        for live, old in zip((self.step_count, self.swa_n_averaged, self.lr), snap["scalars"]):
            live.copy_(old)
        self._n_averaged_host, self._steps_host = snap["host"]
        self._pending = False

    # -- buffers and views ----------------------------------------------------------------------

    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat gradient buffers (for the single-process gradient-norm path)."""
        return [g.grad for g in self.groups]

    def _per_param(self, attr: str) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for group in self.groups:
            shapes = [self.shapes[i] for i in group.indices]
            for i, view in zip(group.indices, group.views(getattr(group, attr), shapes)):
                out[i] = view
        return out  # type: ignore[return-value]

    def swa_views(self) -> list[torch.Tensor]:
        """The SWA weights, one view per parameter, in parameter order."""
        return self._per_param("swa")

    def bind_module_to_swa(self, module: nn.Module) -> None:
        """Make ``module``'s parameters (same names) views of the SWA buffer: a zero-copy eval model."""
        by_name = dict(zip(self.names, self.swa_views()))
        for name, p in module.named_parameters():
            if name not in by_name:
                raise KeyError(f"parameter {name!r} of the eval module is not optimised here")
            p.data = by_name[name]

    @torch.no_grad()
    def sync_compute_from_master(self) -> None:
        """Rewrite the compute copy from the master weights (after loading weights)."""
        for group in self.groups:
            if group.compute is not None:
                group.compute.copy_(group.master)

    @torch.no_grad()
    def reset_swa(self) -> None:
        """Restart SWA from the current weights (``AveragedModel(model)`` semantics: n_averaged 0)."""
        for group in self.groups:
            group.swa.copy_(group.master)
        self.swa_n_averaged.zero_()
        self._n_averaged_host = 0

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``torch.optim.Adam.state_dict()`` layout: per-parameter step/exp_avg/exp_avg_sq."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        if self._steps_host > 0:
            step = float(self.step_count.item())
            for i, (m, v) in enumerate(zip(self._per_param("exp_avg"), self._per_param("exp_avg_sq"))):
                state[i] = {"step": torch.tensor(step, dtype=torch.float32), "exp_avg": m, "exp_avg_sq": v}
        group = {
            "lr": float(self.lr.item()), "betas": (self.beta1, self.beta2), "eps": self.eps,
            "weight_decay": 0, "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": False,
            "params": list(range(len(self.params))),
        }  # fmt: skip
        return {"state": state, "param_groups": [group]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim.Adam`` state dict (e.g. the reference checkpoint's) onto the buffers."""
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"expected 1 param group, got {len(groups)}")
        ids = groups[0]["params"]
        if len(ids) != len(self.params):
            raise ValueError(f"optimizer state has {len(ids)} parameters, model has {len(self.params)}")
        exp_avgs, exp_avg_sqs = self._per_param("exp_avg"), self._per_param("exp_avg_sq")
        steps, mismatches = set(), []
        for i, pid in enumerate(ids):
            st = state_dict["state"].get(pid, {})
            if not st:
                exp_avgs[i].zero_()
                exp_avg_sqs[i].zero_()
                steps.add(0.0)
                continue
            for key, dst in (("exp_avg", exp_avgs[i]), ("exp_avg_sq", exp_avg_sqs[i])):
                src = st[key]
                if src.shape != dst.shape:
                    mismatches.append(f"{self.names[i]}.{key}: {tuple(src.shape)} != {tuple(dst.shape)}")
                else:
                    dst.copy_(src)
            steps.add(float(st["step"]))
        if mismatches:
            raise ValueError("optimizer state does not match the parameters:\n  " + "\n  ".join(mismatches))
        if len(steps) != 1:
            raise ValueError(f"flat Adam needs one shared step count, got {sorted(steps)}")
        step = steps.pop()
        self.step_count.fill_(step)
        self._steps_host = int(step)
        self.lr.fill_(float(groups[0]["lr"]))

    def swa_state_dict(self, prefix: str = "averaged_model.") -> dict[str, torch.Tensor]:
        """The reference ``AlphaFoldSWA.state_dict()`` layout."""
        out = {f"{prefix}n_averaged": self.swa_n_averaged.detach().clone()}
        for name, view in zip(self.names, self.swa_views()):
            out[f"{prefix}module.{name}"] = view
        return out

    @torch.no_grad()
    def load_swa_state_dict(self, state_dict: dict[str, torch.Tensor], prefix: str = "averaged_model.") -> None:
        expected = {f"{prefix}module.{n}" for n in self.names} | {f"{prefix}n_averaged"}
        missing, unexpected = expected - state_dict.keys(), state_dict.keys() - expected
        if missing or unexpected:
            raise ValueError(f"SWA state mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        for name, view in zip(self.names, self.swa_views()):
            src = state_dict[f"{prefix}module.{name}"]
            if src.shape != view.shape:
                raise ValueError(f"SWA weight {name}: {tuple(src.shape)} != {tuple(view.shape)}")
            view.copy_(src)
        n = int(state_dict[f"{prefix}n_averaged"])
        self.swa_n_averaged.fill_(n)
        self._n_averaged_host = n

    @property
    def num_steps(self) -> int:
        return self._steps_host

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)
