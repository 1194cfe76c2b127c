"""Shared primitives: ``Linear`` with AlphaFold2's initialisers, ``LayerNorm`` and gated ``Attention``.

Supplementary section 1.11.4 (parameter initialisation). These three classes are the single
dispatch points through which the fused kernels (``scalefold.kernels``) enter the model: every
module uses them, none calls ``F.layer_norm`` or a softmax-attention of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from scalefold import kernels

# std of a unit normal truncated to [-2, 2]; dividing by it makes the truncated init have the
# requested variance (as in AlphaFold2 / Haiku's VarianceScaling).
TRUNCATED_NORMAL_STDDEV_FACTOR = 0.87962566103423978

INITS = ("default", "relu", "glorot", "gating", "normal", "final")


def _trunc_normal_(weight: torch.Tensor, scale: float) -> None:
    fan_in = weight.shape[1]
    std = math.sqrt(scale / max(1, fan_in)) / TRUNCATED_NORMAL_STDDEV_FACTOR
    with torch.no_grad():
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


_REDUCED = (torch.bfloat16, torch.float16)


class _GroupCast(torch.autograd.Function):
    """Weights cast together: one concatenation and one cast forward, the same two kernels backward (the
    gradients, summed per weight by autograd as for a weight's own cast, concatenated and cast back). The
    values are each weight's own ``.to(dtype)`` and its gradient's ``.to(float32)``: elementwise casts of the
    same numbers. ``dtype`` the weights' own: no cast, the weights handed through (for the slot write alone).

    ``plan`` (:class:`scalefold.optim.grad_slots.SlotPlan`, or None): backward writes the gradients into the
    optimizer's flat buffer itself (the cast back fused into one ``add_`` per run of slots) and hands autograd
    none for the weights; where the plan declines, autograd accumulates them as before."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, plan: object, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.shapes = [p.shape for p in params]
        ctx.source_dtype = params[0].dtype
        ctx.plan = plan
        if dtype == params[0].dtype:
            return tuple(p.detach() for p in params)
        flat = torch.cat([p.reshape(-1) for p in params]).to(dtype)
        return tuple(v.view(shape) for v, shape in zip(flat.split([p.numel() for p in params]), ctx.shapes))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.plan is not None and ctx.plan.write(grads):
            return (None, None, *(None for _ in grads))
        if grads[0].dtype == ctx.source_dtype:
            return (None, None, *grads)
        flat = torch.cat([g.reshape(-1) for g in grads]).to(ctx.source_dtype)
        sizes = [math.prod(shape) for shape in ctx.shapes]
        return (None, None, *(v.view(shape) for v, shape in zip(flat.split(sizes), ctx.shapes)))


class WeightCasts:
    """The reduced-precision copies of the fp32 weights that one model forward makes under autocast, each
    made once and shared by every use: the no-grad recycling passes, the grad pass and activation
    checkpointing's recomputation in backward.

    Autocast caches its weight casts only within one autocast region, and the model clears that cache
    before the grad pass (no-grad casts carry no grad); so a step cast every weight once per no-grad pass,
    once in the grad pass and once more in each recomputation -- plus, for each of those made with grad,
    a cast of its gradient back in backward (about half of a step's ~16,000 dtype casts at MLPerf shapes).
    Here each weight is cast once per forward, with grad (its gradient is cast back once), and the copies
    are shared. The values are autocast's: the same cast of the same fp32 weight, and the grad pass's
    graph is the one autocast's cache builds (every use of a weight behind one cast node), so outputs and
    gradients are bit-identical (``tests/model/test_weight_casts.py``).

    Used only where autocast would cast and cache (autocast on for the device with a reduced dtype and its
    cache enabled, not while a CUDA graph is captured), while the owning model's forward runs
    (:meth:`begin` / :meth:`end`) or in backward (recomputation); a weight changed in place since its cast
    (its version counter) is cast again. A weight's copy is dropped once its gradient has been cast back,
    and all of them after a forward without grad.

    **Groups** (:meth:`group`: the model's blocks): the weights of a group are cast together the first time one
    of them is asked for (:class:`_GroupCast`: two kernels forward and two backward for the group, where each
    weight's own cast is one kernel each way), the same values; autograd then hands the group's gradients back
    when the whole block's backward is done (still block by block, for DDP's overlapping all-reduce).

    **Gradient slots** (:attr:`slots`, set by :func:`scalefold.optim.grad_slots.attach_grad_slots`): the group's
    node writes its gradients into the optimizer's flat buffer itself (no accumulation kernel per weight). Where
    no cast is made (fp32 / fp64 weights outside autocast, the fp32 regions) the group's weights are still taken
    through one node with grad, handed through as they are, for that write alone (:meth:`dtype_for`).
    """

    #: > 0 while a shared copy is being made (for the step's counter: a cast made once per step, wherever
    #: the first pass that needs it runs)
    casting = 0

    def __init__(self) -> None:
        self._casts: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._units: list[list[nn.Module]] = []
        self._groups: dict[int, tuple[torch.Tensor, ...]] = {}
        self.active = False
        self.slots = None  # a scalefold.optim.grad_slots.GradSlots: where the groups' gradients are written

    def group(self, modules: Iterable[nn.Module]) -> None:
        """Cast the float32 weights and biases of the ``Linear`` layers among ``modules`` together whenever one of
        them is asked for (a block's); the ``LayerNorm`` layers' (never cast) form a group of their own for the
        gradient slots. Found anew at each :meth:`begin`: the parameters may be replaced."""
        self._units.append([m for m in modules if isinstance(m, (Linear, LayerNorm))])

    def _regroup(self) -> None:
        self._groups = {}
        for unit in self._units:
            for kind in (Linear, LayerNorm):
                members = tuple(p for m in unit if isinstance(m, kind) for p in (m.weight, m.bias)
                                if p is not None and p.is_floating_point())  # fmt: skip
                for p in members:
                    self._groups[id(p)] = members

    def begin(self) -> None:
        """A new forward: forget the previous step's copies (the weights may have changed since)."""
        self._casts = {}
        self._regroup()
        self.active = True

    def end(self, backward_follows: bool = True) -> None:
        """The forward returned; without a backward to come (a forward without grad), the copies go."""
        self.active = False
        if not backward_follows:
            self._casts = {}

    def dtype(self, device_type: str) -> torch.dtype | None:
        """The dtype autocast would cast a weight to here, or None where the copies are not used."""
        if torch.compiler.is_compiling() or not (self.active or torch._C._current_autograd_node() is not None):
            return None  # a compiled region traces autocast's own casts
        if not torch.is_autocast_enabled(device_type) or not torch.is_autocast_cache_enabled():
            return None
        dtype = torch.get_autocast_dtype(device_type)
        if dtype not in _REDUCED or (device_type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        return dtype

    def grouped_parameters(self) -> list[torch.Tensor]:
        """The weights and biases of the grouped ``Linear`` layers (those :attr:`slots` can write)."""
        return [p for unit in self._units for m in unit for p in (m.weight, m.bias) if p is not None]

    def dtype_for(self, weight: torch.Tensor, device_type: str, cast: bool = True) -> torch.dtype | None:
        """The dtype :meth:`get` takes ``weight`` in here: autocast's reduced dtype (fp32 weights,
        :meth:`dtype`, where ``cast``), or the weight's own where its gradient has a slot (:attr:`slots`) and this
        forward or recomputation records a graph; None: the weight as it is."""
        if cast and weight.dtype == torch.float32:
            dtype = self.dtype(device_type)
            if dtype is not None:
                return dtype
        if self.slots is None or not weight.requires_grad or torch.compiler.is_compiling():
            return None
        if not ((self.active and torch.is_grad_enabled()) or torch._C._current_autograd_node() is not None):
            return None
        return weight.dtype if self.slots.holds(weight) else None

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` cast to ``dtype`` (or, its own dtype, handed through one node whose backward writes the
        gradients into their slots), made once (with grad where the weight requires it)."""
        key = id(weight)
        hit = self._casts.get(key)
        if hit is not None and hit[0] is weight and hit[1] == weight._version and hit[2].dtype == dtype:
            return hit[2]
        members = self._groups.get(key, (weight,))
        if not any(p is weight for p in members):  # a stale id (the tensor was replaced): cast it alone
            members = (weight,)
        members = tuple(p for p in members if p.dtype == weight.dtype)
        plan = self.slots.plan(members) if self.slots is not None else None
        if plan is None and dtype == weight.dtype:
            return weight
        WeightCasts.casting += 1
        try:
            with torch.enable_grad():
                grouped = len(members) > 1 or plan is not None
                casts = _GroupCast.apply(dtype, plan, *members) if grouped else (weight.to(dtype),)
        finally:
            WeightCasts.casting -= 1
        keys = [id(p) for p in members]
        for p, cast in zip(members, casts):
            self._casts[id(p)] = (p, p._version, cast)
        if casts[0].grad_fn is not None:
            table = self._casts

            def drop(*_: object) -> None:  # the gradients are cast back: no recomputation needs the copies now
                for k in keys:
                    table.pop(k, None)

            casts[0].grad_fn.register_hook(drop)
        return self._casts[key][2]


class Linear(nn.Linear):
    """``nn.Linear`` with AlphaFold2's initialisation schemes.

    ``init``:
      * ``default`` -- LeCun (fan-in) truncated normal;
      * ``relu``    -- He truncated normal;
      * ``glorot``  -- Glorot (fan-average) uniform;
      * ``gating``  -- weight 0, bias 1;
      * ``normal``  -- normal with std 1/sqrt(fan_in);
      * ``final``   -- weight 0, bias 0.
    Biases start at zero unless ``init == "gating"``.

    Under autocast, inside a model that shares its weight casts (``weight_casts``, a :class:`WeightCasts`
    the model sets), the weight and bias are taken from there instead of being cast per pass.
    """

    weight_casts: WeightCasts | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init: str = "default") -> None:
        super().__init__(in_features, out_features, bias=bias)
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; expected one of {INITS}")
        self.init = init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init = getattr(self, "init", None)
        if init is None:  # called from nn.Linear.__init__ before self.init exists
            return
        with torch.no_grad():
            if init == "default":
                _trunc_normal_(self.weight, 1.0)
            elif init == "relu":
                _trunc_normal_(self.weight, 2.0)
            elif init == "glorot":
                nn.init.xavier_uniform_(self.weight, gain=1.0)
            elif init == "normal":
                nn.init.kaiming_normal_(self.weight, nonlinearity="linear")
            else:  # gating / final
                self.weight.zero_()
            if self.bias is not None:
                self.bias.fill_(1.0 if init == "gating" else 0.0)

    def params(self, device_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` as this layer's forward on ``device_type`` uses them: the shared reduced-precision
        copies where the owning model shares its casts and autocast would cast, else the parameters (for a
        caller that applies the weights itself, e.g. the fused triangle multiplication's dispatch point)."""
        casts = self.weight_casts
        if device_type is not None and casts is not None:
            dtype = casts.dtype_for(self.weight, device_type)
            if dtype is not None:
                return casts.get(self.weight, dtype), None if self.bias is None else casts.get(self.bias, dtype)
        return self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, *self.params(x.device.type))


class LinearReLU(Linear):
    """``relu(Linear(x))`` through :func:`scalefold.kernels.linear_relu`: on the fast path one product with the ReLU
    applied by its epilogue, else the two eager kernels (the same parameters and names as a ``Linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear_relu(x, *self.params(x.device.type))


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension, dispatched through :func:`scalefold.kernels.layer_norm`."""

    def __init__(self, in_channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.normalized_shape = (in_channels,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(in_channels))
        self.bias = nn.Parameter(torch.zeros(in_channels))

    weight_casts: WeightCasts | None = None

    def params(self, device_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight, bias)`` as this layer's forward on ``device_type`` uses them: never cast, but taken through
        their group's node where the owning model writes the gradients into their slots
        (:attr:`WeightCasts.slots`), else the parameters."""
        casts = self.weight_casts
        if device_type is not None and casts is not None and casts.dtype_for(self.weight, device_type, cast=False):
            return casts.get(self.weight, self.weight.dtype), casts.get(self.bias, self.bias.dtype)
        return self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, *self.params(x.device.type), self.eps)


class Attention(nn.Module):
    """Multi-head attention with optional sigmoid gating (Supplementary Alg. 7, 8, 13, 14).

    Parameters ``linear_q/k/v`` (no bias, Glorot), ``linear_o`` (final init) and, when gated,
    ``linear_g`` (gating init) -- the reference model's names. The attention itself runs through
    :func:`scalefold.kernels.attention`.
    """

    def __init__(
        self,
        c_q: int,
        c_k: int,
        c_v: int,
        c_hidden: int,
        num_heads: int,
        gating: bool = True,
        inf: float = 1e9,
    ) -> None:
        super().__init__()
        self.c_hidden = c_hidden
        self.num_heads = num_heads
        self.gating = gating
        self.inf = inf
        self.linear_q = Linear(c_q, c_hidden * num_heads, bias=False, init="glorot")
        self.linear_k = Linear(c_k, c_hidden * num_heads, bias=False, init="glorot")
        self.linear_v = Linear(c_v, c_hidden * num_heads, bias=False, init="glorot")
        self.linear_o = Linear(c_hidden * num_heads, c_q, bias=True, init="final")
        self.linear_g = Linear(c_q, c_hidden * num_heads, bias=True, init="gating") if gating else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [*, N, H * C] -> [*, H, N, C]
        return x.view(x.shape[:-1] + (self.num_heads, self.c_hidden)).transpose(-2, -3)

    def forward(
        self,
        input_q: torch.Tensor,
        input_kv: torch.Tensor,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_q`` ``[*, Q, c_q]``, ``input_kv`` ``[*, K, c_k]``; ``mask`` broadcastable to
        ``[*, H, Q, K]`` (1 = attend); ``bias`` broadcastable to ``[*, H, Q, K]``.
        Returns ``[*, Q, c_q]``."""
        if input_q is input_kv:  # self-attention: the projections of one input (one product on the fast path)
            q, k, v, gate, _ = self.project(input_q)
        else:
            q = self._heads(self.linear_q(input_q))
            k = self._heads(self.linear_k(input_kv))
            v = self._heads(self.linear_v(input_kv))
            gate = self._heads(self.linear_g(input_q)) if self.linear_g is not None else None
        return self.attend(q, k, v, gate, mask, bias)

    def project(
        self, x: torch.Tensor, extra: Linear | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Self-attention's projections of ``x`` ``[*, N, c]``: ``(q, k, v, gate, extra(x))`` with the heads
        ``[*, H, N, C]`` (``gate`` None without gating; ``extra``: one more Linear of ``x``, e.g. the triangle
        attention's pair bias, else None), through :func:`scalefold.kernels.projections` (one product on the
        fast path, the layers one by one on the PyTorch path)."""
        # ``extra`` first: on the PyTorch path the layers run in the order the callers ran them before (the pair
        # bias first), so autograd sums the input's gradients in the same order (bit for bit the same gradients)
        lins = [lin for lin in (extra, self.linear_q, self.linear_k, self.linear_v, self.linear_g) if lin is not None]
        outs = kernels.projections(x, [lin.params(x.device.type) for lin in lins])
        first = outs.pop(0) if extra is not None else None
        q, k, v = (self._heads(t) for t in outs[:3])
        gate = self._heads(outs[3]) if self.linear_g is not None else None
        return q, k, v, gate, first

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gate: torch.Tensor | None,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention of projected heads (``[*, H, N, C]``) and the output projection: ``[*, Q, c_q]``."""
        o = kernels.attention(q, k, v, bias=bias, mask=mask, gate=gate, inf=self.inf)
        # o: [*, H, Q, C] -> [*, Q, H * C]
        o = o.transpose(-2, -3)
        o = o.reshape(o.shape[:-2] + (self.num_heads * self.c_hidden,))
        return self.linear_o(o)


__all__ = ["Linear", "LinearReLU", "LayerNorm", "Attention", "TRUNCATED_NORMAL_STDDEV_FACTOR", "WeightCasts"]
