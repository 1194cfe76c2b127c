"""Dispatch point for ScaleFold's fused kernels.

Every fast path has a plain PyTorch reference beside it (``scalefold.kernels.reference``);
``backend`` picks one:

* ``"auto"``   -- the Triton kernel on CUDA tensors when Triton is available, else the reference;
* ``"triton"`` -- force the kernel (on CPU it needs ``TRITON_INTERPRET=1``);
* ``"torch"``  -- force the PyTorch reference;
* ``"compile"`` -- :func:`adam_swa_` only: ``torch.compile`` of the reference.

The model's memory-bound elementwise chains pass here too (:func:`sigmoid_gate`, :func:`gated_projection`,
:func:`dropout_add`, and the glue of the PyTorch attention): plain PyTorch, or each chain
compiled alone after :func:`scalefold.kernels.elementwise.enable` (``--compile``'s default region).

The environment variable ``SCALEFOLD_KERNELS`` (``auto``/``triton``/``torch``) overrides
``"auto"`` globally, so a whole run can be pinned to either path.

Kernels (``scalefold.kernels.triton_ops`` registers them as ``torch.ops.scalefold.*`` custom ops):
:func:`attention` (``attention_triton``), :func:`layer_norm` (``layer_norm_triton``),
:func:`adam_swa_` (``adam_swa_triton``), :func:`triangle_multiplication` (``trimul_triton``) and
:func:`outer_product_mean` (``opm_triton``). Their
launch configs come from the table shipped in the package (``launch_table``: per GPU architecture,
kernel, dtype and shape class; no autotuning at start-up), timed only with ``SCALEFOLD_AUTOTUNE=1``
(``autotune``); ``scalefold tune-kernels`` times the candidates on a GPU and writes the table. The flat
optimizer (``scalefold.optim.adam_swa``) steps through :func:`adam_swa_`: training and the
kernel tests share one Adam+SWA reference.
``scalefold aot-check`` compiles every one of them, for every candidate config (or, with
``--table``, every table entry), for H100 (sm_90) and A100 (sm_80) without a GPU, and reports
registers, shared memory and spills. Those tools live above the model (``scalefold.kerneltools``):
nothing here knows them.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Without CUDA the Triton kernels run in Triton's interpreter. Triton reads TRITON_INTERPRET when it is
# first imported (its standard library's @jit functions are made then), and torch.compile's inductor may
# import it before the kernels do: so the switch is set here, when the kernels' package is imported (the
# model imports it), unless the environment already says otherwise. (A tool that compiles the kernels for
# real GPUs switches it off itself before it imports the kernel modules.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scalefold.kernels import elementwise, fused_linear, reference  # noqa: E402

_BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, *tensors: torch.Tensor | None) -> str:
    """Return ``"triton"`` or ``"torch"`` for a requested backend and the tensors involved."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {_BACKENDS}")
    if backend == "auto":
        backend = os.environ.get("SCALEFOLD_KERNELS", "auto")
        if backend not in _BACKENDS:
            raise ValueError(f"SCALEFOLD_KERNELS={backend!r}; expected one of {_BACKENDS}")
    if backend == "auto":
        on_cuda = all(t is None or t.is_cuda for t in tensors)
        return "triton" if on_cuda and _triton_available() else "torch"
    return backend


def _cuda_present() -> bool:
    return torch.cuda.is_available()


def constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` at import time: under
    torch.compile ``fn`` runs once, eagerly, and its result is a constant of the graph. Dynamo reads the
    mark it sets (``_dynamo_marked_constant``, all that torch 2.6-2.13's decorator does); once Dynamo is
    loaded the official decorator is used. Importing Dynamo costs a process that never compiles (every
    ``scalefold`` command, the demo) about a third of its start."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


#: ``(usable, why not)`` of the Triton kernels in this process, found once (see :func:`_triton_available`)
_triton_status: tuple[bool, str] | None = None


@constant_result  # under torch.compile: run once, eagerly, and used as a constant
def _triton_available() -> bool:
    """Whether ``"auto"`` may pick the Triton kernels: CUDA present and ``triton_ops`` importable.

    A Triton that is installed but unusable (a version whose ``torch.library.custom_op`` or
    compiler rejects the kernels, a broken install: any exception, not only ``ImportError``)
    never stops a run: the PyTorch reference is used, and one line on stderr says why. Found
    once per process.
    """
    global _triton_status
    if _triton_status is None:
        if not _cuda_present():
            _triton_status = (False, "no CUDA device")
        else:
            try:
                from scalefold.kernels import triton_ops  # noqa: F401
            except Exception as exc:  # noqa: BLE001 - any failure means: use the reference
                lines = str(exc).strip().splitlines()
                _triton_status = (False, (f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)[:300])
                print(f"scalefold.kernels: Triton kernels unavailable ({_triton_status[1]}); "
                      "using the PyTorch reference kernels", file=sys.stderr, flush=True)  # fmt: skip
            else:
                _triton_status = (True, "")
    return _triton_status[0]


def _triton_module():
    try:
        from scalefold.kernels import triton_ops  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - reported with its cause: the backend was asked for by name
        raise RuntimeError(
            f"backend='triton' requested but the Triton kernels are unavailable: {type(exc).__name__}: {exc}"
        ) from exc
    return triton_ops


def installed_triton() -> str | None:
    """The installed Triton's version string, read from its metadata: not imported (an import fixes
    Triton's interpreter mode for the process)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return None


def triton_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed Triton (local/pre-release suffixes ignored), None without one."""
    text = installed_triton()
    if text is None:
        return None
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


#: ``tl.dot`` on fp64 operands (the fp64 attention kernels) needs Triton 3.5; older ones reject it
FP64_DOT_TRITON = (3, 5)


@constant_result
def _triton_lacks_fp64_dot() -> bool:
    version = triton_version()
    return version is not None and version < FP64_DOT_TRITON


def _fp64_attention_falls_back(backend: str, dtype: torch.dtype) -> bool:
    """fp64 attention uses the reference when Triton has no fp64 ``tl.dot``, unless ``backend="triton"``
    asks for the kernel by name (which then fails in Triton's compiler)."""
    return backend != "triton" and dtype == torch.float64 and _triton_lacks_fp64_dot()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    inf: float = 1e9,
    backend: str = "auto",
) -> torch.Tensor:
    """Gated multi-head attention with an additive pair bias.

    ``o = sigmoid(gate) * softmax(q k^T * scale + bias + (mask - 1) * inf) v``

    Shapes: ``q`` ``[*, H, Nq, D]``; ``k``/``v`` ``[*, H, Nk, D]``; ``bias`` broadcastable to
    ``[*, H, Nq, Nk]``; ``mask`` (bool or 0/1 float, True/1 = attend) broadcastable to
    ``[*, 1, 1, Nk]``; ``gate`` ``[*, H, Nq, D]`` (pre-sigmoid). ``scale`` defaults to
    ``1/sqrt(D)``. Masked logits get the finite ``-inf`` offset of the reference model.
    """
    if resolve_backend(backend, q, k, v, bias, gate) == "triton" and not _fp64_attention_falls_back(backend, q.dtype):
        return _triton_module().attention(q, k, v, bias=bias, mask=mask, gate=gate, scale=scale, inf=inf)
    if not elementwise.enabled():
        return reference.attention(q, k, v, bias=bias, mask=mask, gate=gate, scale=scale, inf=inf)
    # the reference's steps, its glue (logits -> probabilities, output gate) compiled
    q = q / math.sqrt(q.shape[-1]) if scale is None else q * scale
    o = torch.matmul(elementwise.chain("masked_softmax")(torch.matmul(q, k.transpose(-1, -2)), mask, bias, inf), v)
    return o if gate is None else _chain("sigmoid_gate", o, gate)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    backend: str = "auto",
) -> torch.Tensor:
    """LayerNorm over the last dimension."""
    if resolve_backend(backend, x, weight, bias) == "triton":
        return _triton_module().layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def _chain(name: str, *tensors: torch.Tensor) -> torch.Tensor:
    """Elementwise chain ``name`` on ``tensors``; compiled, operands whose dims before the last three agree
    are merged there into one (a view, as the model's operands are laid out), so the Evoformer's, the
    extra-MSA's and the template stack's calls share one graph whatever their rank."""
    fn = elementwise.chain(name)
    lead = tensors[0].shape[:-3]
    if not elementwise.enabled() or len(lead) == 1 or any(t.dim() < 3 or t.shape[:-3] != lead for t in tensors):
        return fn(*tensors)
    out = fn(*(t.reshape((-1,) + t.shape[-3:]) for t in tensors))
    return out.reshape(lead + out.shape[1:])


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` (compiled with the other elementwise chains: :mod:`scalefold.kernels.elementwise`)."""
    return _chain("sigmoid_gate", x, gate)


def gated_projection(gate: torch.Tensor, mask: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """``sigmoid(gate) * mask * proj`` (a triangle multiplication's masked, gated projection)."""
    return _chain("gated_projection", gate, mask, proj)


def triangle_multiplication(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    weights: reference.TrimulWeights,
    outgoing: bool,
    eps_in: float = 1e-5,
    eps_out: float = 1e-5,
    backend: str = "auto",
) -> torch.Tensor:
    """The triangle multiplication (Supplementary Alg. 11 ``outgoing``, Alg. 12 incoming) of ``z``
    ``[*, N, N, c_z]`` with a 0/1 ``mask`` broadcasting to ``[*, N, N]`` (None: all ones):

    ``z = LN(z)``; ``a = sigmoid(z W_ag) * mask * (z W_ap)``, ``b`` likewise; ``x_ij = sum_k a_ik b_jk``
    (outgoing) or ``sum_k a_ki b_kj`` (incoming); ``sigmoid(z W_g) * (LN(x) W_z)``.

    ``"triton"``: the fused kernels (``trimul_triton``: LN + projections + gates + mask in one kernel writing
    ``a``, ``b`` channel-major, the product as one batched matmul, LN + output projection + gate in one
    kernel; backward recomputes the gates); the mask gets no gradient there; fp64 under ``"auto"`` uses the
    PyTorch path where Triton has no fp64 ``tl.dot`` (as :func:`attention` does). ``"torch"``: the model's
    operators one by one (its gates through the elementwise chains, compiled when those are enabled).
    ``weights``: :class:`scalefold.kernels.reference.TrimulWeights`.
    """
    if resolve_backend(backend, z, mask) == "triton" and not _fp64_attention_falls_back(backend, z.dtype):
        return _triton_module().triangle_multiplication(z, mask, weights, outgoing, eps_in, eps_out)
    w = weights
    m = z.new_ones(z.shape[:-1]) if mask is None else mask.to(z.dtype)
    m = m.unsqueeze(-1)
    z = layer_norm(z, w.ln_in_w, w.ln_in_b, eps_in)
    if outgoing:  # the module's order (its DAP path overlaps the gathered projection with the other one)
        b = gated_projection(F.linear(z, w.b_g_w, w.b_g_b), m, F.linear(z, w.b_p_w, w.b_p_b))
        a = gated_projection(F.linear(z, w.a_g_w, w.a_g_b), m, F.linear(z, w.a_p_w, w.a_p_b))
    else:
        a = gated_projection(F.linear(z, w.a_g_w, w.a_g_b), m, F.linear(z, w.a_p_w, w.a_p_b))
        b = gated_projection(F.linear(z, w.b_g_w, w.b_g_b), m, F.linear(z, w.b_p_w, w.b_p_b))
    x = reference.triangle_product(a, b, outgoing)
    x = F.linear(layer_norm(x, w.ln_out_w, w.ln_out_b, eps_out), w.z_w, w.z_b)
    return sigmoid_gate(x, F.linear(z, w.g_w, w.g_b))


def outer_product_mean(
    a: torch.Tensor,
    b: torch.Tensor,
    mask_a: torch.Tensor,
    mask_b: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The outer product mean after its projections (Supplementary Alg. 10 lines 3-4): ``a`` ``[*, S, N1, C]``,
    ``b`` ``[*, S, N2, C]`` (the masked projections), ``mask_a`` ``[*, S, N1, 1]``, ``mask_b`` ``[*, S, N2, 1]``
    (0/1), ``weight`` ``[c_z, C * C]``, ``bias`` ``[c_z]`` ->
    ``out_ij = (weight flatten(sum_s a_si (x) b_sj) + bias) / (sum_s mask_a_si mask_b_sj + eps)``.

    ``"triton"``: the fused kernels (``opm_triton``: the outer product and its projection in one kernel, no
    ``[N1, N2, C, C]`` tensor and no transposed copy, forward and backward; the masks get no gradient). Operands
    they do not take (``opm_triton.unsupported``: a dtype, ``C`` above 64, ``c_z`` above 256) take the PyTorch
    path, with one line on stderr naming the limit (once per reason); fp64 under ``"auto"`` too where Triton has
    no fp64 ``tl.dot``. ``"torch"``: the reference's operators (``chunk_size`` slices the first residue axis).
    """
    if resolve_backend(backend, a, b, weight) == "triton" and not _fp64_attention_falls_back(backend, a.dtype):
        ops = _triton_module()
        why = ops.outer_product_unsupported(a, b, weight)
        if why is None:
            return ops.outer_product_mean(a, b, mask_a, mask_b, weight, bias, eps)
        _refuse_once("outer product mean", why)
    return reference.outer_product_mean(a, b, mask_a, mask_b, weight, bias, eps, chunk_size)


_refused: set[str] = set()


def _refuse_once(kernel: str, why: str) -> None:
    """One line on stderr (once per kernel and reason): a fused kernel refused its operands."""
    line = f"scalefold.kernels: fused {kernel}: {why}; using the PyTorch reference"
    if line not in _refused:
        _refused.add(line)
        print(line, file=sys.stderr, flush=True)


def dropout_add(x: torch.Tensor, update: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The residual update ``x + update * mask`` (``mask``: a drawn dropout mask, scaled; None: ``x + update``)."""
    if mask is None:  # one op: nothing to fuse
        return x + update
    return _chain("dropout_add", x, update, mask)


_ADAM_BACKENDS = _BACKENDS + ("compile",)
_compiled_adam_swa_chunk = None


def adam_swa_(
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
    chunk_numel: int | None = None,
    scratch: Sequence[torch.Tensor] | None = None,
    backend: str = "auto",
) -> None:
    """Fused Adam + SWA step over flat 1-D buffers, in place.

    Per element: ``g = grad * clip_scale`` (master dtype) -> ``torch.optim.Adam``'s update with
    bias correction (``step`` is the already-incremented step count) -> ``compute = param`` (the
    optional low-precision copy) -> SWA: ``swa = param`` when ``swa_n_averaged == 0``, else
    ``swa += (param - swa) * (1 - swa_decay)``. ``param``, ``exp_avg``, ``exp_avg_sq``, ``swa``
    share the master dtype; ``grad``/``compute`` may be low precision. ``lr``, ``step`` and
    ``clip_scale`` are 0-dim device tensors (nothing is read back to the host on CUDA).

    Besides the common backends, ``"compile"`` runs ``torch.compile`` of the reference (one fused
    loop over the whole buffers). ``chunk_numel`` / ``scratch`` tune the eager reference only (see
    :func:`scalefold.kernels.reference.adam_swa_`).
    """
    numel = param.numel()
    for t in (grad, exp_avg, exp_avg_sq, swa) + ((compute,) if compute is not None else ()):
        if t.dim() != 1 or t.numel() != numel:
            raise ValueError("adam_swa_ expects flat 1-D tensors of equal length")
    kwargs = dict(lr=lr, step=step, clip_scale=clip_scale, beta1=beta1, beta2=beta2, eps=eps,
                  swa_decay=swa_decay, swa_n_averaged=swa_n_averaged)  # fmt: skip
    if backend == "compile":
        _adam_swa_compiled(param, grad, exp_avg, exp_avg_sq, swa, compute, **kwargs)
        return
    if backend not in _ADAM_BACKENDS:
        raise ValueError(f"unknown Adam+SWA backend {backend!r}; expected one of {_ADAM_BACKENDS}")
    if resolve_backend(backend, param, grad, exp_avg, exp_avg_sq, swa, compute) == "triton":
        _triton_module().adam_swa_update_(param, grad, exp_avg, exp_avg_sq, swa, compute, **kwargs)
        return
    reference.adam_swa_(param, grad, exp_avg, exp_avg_sq, swa, compute, **kwargs, chunk_numel=chunk_numel,
                        scratch=scratch)  # fmt: skip


def _adam_swa_compiled(param, grad, exp_avg, exp_avg_sq, swa, compute, *, lr, step, swa_n_averaged, **hyper) -> None:
    """The reference's per-element math under ``torch.compile``, over the whole buffers at once
    (device-scalar step size, so the compiled graph does not depend on the learning rate)."""
    global _compiled_adam_swa_chunk
    if _compiled_adam_swa_chunk is None:
        _compiled_adam_swa_chunk = torch.compile(reference.adam_swa_chunk_, dynamic=False)
    neg_step_size, bias_correction2_sqrt = reference.adam_step_scalars(lr, step, hyper["beta1"], hyper["beta2"])
    _compiled_adam_swa_chunk(
        param, grad, exp_avg, exp_avg_sq, swa, compute, neg_step_size=neg_step_size,
        bias_correction2_sqrt=bias_correction2_sqrt, swa_copy=swa_n_averaged == 0, **hyper,
    )  # fmt: skip


def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``relu(F.linear(x, weight, bias))``: on the fast path one product with cuBLASLt's ReLU epilogue
    (:mod:`scalefold.kernels.fused_linear`), else the two eager kernels."""
    if resolve_backend(backend, x, weight, bias) == "triton":
        return fused_linear.linear_relu(x, weight, bias)
    return fused_linear.linear_relu_reference(x, weight, bias)


def projections(
    x: torch.Tensor, layers: Sequence[tuple[torch.Tensor, torch.Tensor | None]], backend: str = "auto"
) -> list[torch.Tensor]:
    """``[F.linear(x, weight, bias) for weight, bias in layers]``: on the fast path one product with the weights
    concatenated (:func:`scalefold.kernels.fused_linear.projections`: the input read, and under autocast cast, once
    instead of once per layer; its gradient one product instead of a product, a cast and a sum per layer),
    else the layers one by one (the reference's operators)."""
    if len(layers) > 1 and resolve_backend(backend, x) == "triton":
        return fused_linear.projections(x, list(layers))
    return [F.linear(x, weight, bias) for weight, bias in layers]


__all__ = [
    "adam_swa_", "attention", "dropout_add", "elementwise", "gated_projection", "layer_norm", "linear_relu",
    "outer_product_mean", "projections", "reference", "resolve_backend", "sigmoid_gate", "triangle_multiplication",
]  # fmt: skip
