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
``chunk_numel`` elements, see below), whatever the number of tensors. The per-element math is one
function, :func:`adam_swa_update_`, the dispatch point the fused Triton kernel plugs into; the
PyTorch reference reproduces ``torch.optim.Adam`` (single-tensor path) operation by operation, so
fp64 results agree to rounding and, for the same gradients, fp32 results agree bit for bit on CPU
(the clip scale itself may differ in the last bits: one flat norm vs torch's norm of norms).

``lr`` and ``step`` live in device tensors and nothing in :meth:`FlatAdamSWA.step` reads a value back
to the host, so the step can be captured in a CUDA graph (the SWA "first update copies" branch is
decided from a host-side counter, as in ``torch.optim.swa_utils.AveragedModel``).

Checkpoints: :meth:`FlatAdamSWA.state_dict` has the per-parameter layout of
``torch.optim.Adam.state_dict()`` (so the MLPerf reference checkpoint's ``optimizer_state_dict`` loads
onto the flat buffers), and :meth:`FlatAdamSWA.swa_state_dict` the layout of the reference's
``AlphaFoldSWA`` module (``averaged_model.n_averaged``, ``averaged_model.module.<name>``).

Gradients must stay views of the flat buffer: use :meth:`FlatAdamSWA.zero_grad` (zeroes in place,
never sets ``None``) and, under DDP, ``gradient_as_bucket_view=False`` (DDP then copies the averaged
bucket into the existing ``.grad`` views). Build the optimizer before wrapping the model in DDP.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn

# Elements per chunk of the PyTorch reference update: small enough that the reference's
# temporaries stay in the CPU's caches (several times faster than whole-buffer passes on CPU), large
# enough that the launch count stays ~200 for the 93 M-parameter model. ``None``: one pass.
DEFAULT_CHUNK_NUMEL = 1 << 19
# Each parameter's offset in a flat buffer is a multiple of this many elements (128 bytes in fp32),
# so vectorised kernels can use aligned loads. Padding elements stay zero.
DEFAULT_ALIGN_NUMEL = 32

_UPDATE_BACKENDS = ("auto", "torch", "compile", "triton")
_compiled_update = None

ParamsArg = Union[Iterable[nn.Parameter], Iterable[tuple[str, nn.Parameter]]]


# ----------------------------------------------------------------------------------------------
# The per-element update (dispatch point)
# ----------------------------------------------------------------------------------------------


def _reference_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    swa: torch.Tensor,
    compute: torch.Tensor | None,
    clip_scale: torch.Tensor | None,
    neg_step_size: torch.Tensor | float,
    bias_correction2_sqrt: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    swa_decay: float,
    swa_copy: bool,
    scratch: Sequence[torch.Tensor] | None = None,
) -> None:
    """One chunk: clip-scale -> torch.optim.Adam math (single-tensor path) -> SWA -> compute copy.

    ``scratch``: three buffers of the chunk's length and master dtype for the temporaries (avoids
    re-allocating them for every chunk); ``None`` allocates.
    """
    s_grad, s_denom, s_update = scratch if scratch is not None else (None, None, None)
    if grad.dtype != param.dtype:  # low-precision compute grads: scale in the master dtype
        g = grad.to(param.dtype) if s_grad is None else s_grad.copy_(grad)
        if clip_scale is not None:
            g.mul_(clip_scale)
    elif clip_scale is not None:  # clip_grad_norm_ multiplies by the clamped coefficient
        g = torch.mul(grad, clip_scale, out=s_grad) if s_grad is not None else torch.mul(grad, clip_scale)
    else:
        g = grad
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = torch.sqrt(exp_avg_sq, out=s_denom) if s_denom is not None else exp_avg_sq.sqrt()
    denom.div_(bias_correction2_sqrt).add_(eps)
    if isinstance(neg_step_size, float):  # host scalar (CPU): torch.optim.Adam's own op, one pass
        param.addcdiv_(exp_avg, denom, value=neg_step_size)
    else:  # device scalar (no host sync): addcdiv_ evaluates p + (value * exp_avg) / denom
        update = torch.mul(exp_avg, neg_step_size, out=s_update) if s_update is not None else exp_avg * neg_step_size
        param.add_(update.div_(denom))
    if compute is not None:
        compute.copy_(param)
    if swa_copy:  # AveragedModel's first update copies the weights
        swa.copy_(param)
    else:  # swa + (param - swa) * (1 - decay) in one pass (lerp may fuse the multiply-add: within 2 ulp)
        swa.lerp_(param, 1.0 - swa_decay)


def _step_scalars(lr: torch.Tensor, step: torch.Tensor, beta1: float, beta2: float):
    """Adam's bias corrections as device scalars, in float64 like torch.optim.Adam's Python floats."""
    step = step.to(torch.float64)
    lr = lr.to(torch.float64)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    neg_step_size = -(lr / bias_correction1)
    return neg_step_size, bias_correction2.sqrt()


def _resolve_update_backend(backend: str, param: torch.Tensor) -> str:
    if backend not in _UPDATE_BACKENDS:
        raise ValueError(f"unknown update backend {backend!r}; expected one of {_UPDATE_BACKENDS}")
    if backend in ("torch", "compile"):
        return backend
    from scalefold import kernels

    return kernels.resolve_backend(backend, param)


def adam_swa_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    swa: torch.Tensor,
    compute: torch.Tensor | None = None,
    *,
    lr: torch.Tensor,
    step: torch.Tensor,
    clip_scale: torch.Tensor | None = None,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-6,
    swa_decay: float = 0.9,
    swa_n_averaged: int = 1,
    chunk_numel: int | None = DEFAULT_CHUNK_NUMEL,
    scratch: Sequence[torch.Tensor] | None = None,
    backend: str = "auto",
) -> None:
    """Fused per-element step over flat 1-D tensors, in place.

    For every element: ``g = grad * clip_scale`` (in the master dtype) -> Adam with bias correction
    exactly as ``torch.optim.Adam`` (``step`` is the already-incremented step count) -> SWA
    ``swa += (param - swa) * (1 - swa_decay)`` (or ``swa = param`` when ``swa_n_averaged == 0``)
    -> ``compute = param`` cast to the compute dtype.

    ``param``/``exp_avg``/``exp_avg_sq``/``swa`` share the master dtype; ``grad`` and ``compute``
    have the compute dtype. ``lr``, ``step`` and ``clip_scale`` are 0-dim tensors on the device.
    ``scratch``: optional three 1-D master-dtype buffers of at least one chunk for the reference's
    temporaries. ``backend``: ``"torch"`` (reference), ``"compile"`` (``torch.compile`` of the
    reference: one fused loop), ``"triton"`` (the fused kernel) or ``"auto"`` (Triton on CUDA when
    the kernel exists, else the reference).
    """
    numel = param.numel()
    for t in (grad, exp_avg, exp_avg_sq, swa) + ((compute,) if compute is not None else ()):
        if t.dim() != 1 or t.numel() != numel:
            raise ValueError("adam_swa_update_ expects flat 1-D tensors of equal length")
    resolved = _resolve_update_backend(backend, param)
    if resolved == "triton":  # the fused kernel, through the one kernel dispatch point
        from scalefold import kernels

        kernels.adam_swa_(
            param, grad, exp_avg, exp_avg_sq, swa, compute, lr=lr, step=step, clip_scale=clip_scale,
            beta1=beta1, beta2=beta2, eps=eps, swa_decay=swa_decay, swa_n_averaged=swa_n_averaged,
            backend="triton",
        )  # fmt: skip
        return
    neg_step_size, bias_correction2_sqrt = _step_scalars(lr, step, beta1, beta2)
    scalars = dict(
        clip_scale=clip_scale, neg_step_size=neg_step_size, bias_correction2_sqrt=bias_correction2_sqrt,
        beta1=beta1, beta2=beta2, eps=eps, swa_decay=swa_decay, swa_copy=swa_n_averaged == 0,
    )  # fmt: skip
    if resolved == "compile":
        global _compiled_update
        if _compiled_update is None:
            _compiled_update = torch.compile(_reference_update_, dynamic=False)
        _compiled_update(param, grad, exp_avg, exp_avg_sq, swa, compute, **scalars)
        return
    if param.device.type == "cpu":  # reading the scalar costs no device sync here; saves two passes
        scalars["neg_step_size"] = float(neg_step_size)
    chunk = numel if not chunk_numel else chunk_numel
    for start in range(0, numel, chunk):
        sl = slice(start, min(start + chunk, numel))
        n = sl.stop - sl.start
        _reference_update_(
            param[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], swa[sl],
            None if compute is None else compute[sl], **scalars,
            scratch=None if scratch is None else [t[:n] for t in scratch],
        )  # fmt: skip


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
        backend: see :func:`adam_swa_update_`.
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
        holders = self._grad_holders()
        for group in groups if groups is not None else self.groups:
            shapes = [self.shapes[i] for i in group.indices]
            for i, view in zip(group.indices, group.views(group.grad, shapes)):
                holders[i].grad = view

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
    def step(self, clip_scale: torch.Tensor | None = None) -> None:
        """One Adam + SWA step on every parameter; ``clip_scale`` (0-dim tensor) scales the grads."""
        if not self._grads_checked:
            self.check_grads_attached()
            self._grads_checked = True
        self.step_count.add_(1)
        for group in self.groups:
            adam_swa_update_(
                group.master, group.grad, group.exp_avg, group.exp_avg_sq, group.swa, group.compute,
                lr=self.lr, step=self.step_count, clip_scale=clip_scale, beta1=self.beta1, beta2=self.beta2,
                eps=self.eps, swa_decay=self.swa_decay, swa_n_averaged=self._n_averaged_host,
                chunk_numel=self.chunk_numel, scratch=self._scratch(group), backend=self.backend,
            )  # fmt: skip
        self.swa_n_averaged.add_(1)
        self._n_averaged_host += 1
        self._steps_host += 1

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
