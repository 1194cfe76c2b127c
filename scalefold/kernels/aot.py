"""Ahead-of-time compilation of every Triton kernel ScaleFold launches, for real GPUs, without one.

``python -m scalefold.kernels.aot [--arch sm_90 --arch sm_80] [--json]``
``python -m scalefold.kernels.aot --table [FILE] [--no-compile]`` (the launch-config table's entries)

The kernel tests run in Triton's CPU interpreter, which accepts programs a GPU compile rejects
(``tl.dot`` tiles under 16, shared memory over the limit, bf16 paths it never really executes).
Triton compiles to PTX and cubin with no driver -- ``triton.compile(ASTSource(fn, signature,
constexprs, attrs), target=GPUTarget("cuda", 90, 32))`` -- and its wheel ships ``ptxas`` and
``cuobjdump``, so this module proves on a CPU that every program compiles for H100 (sm_90) and
A100 (sm_80), and reports its registers, shared memory and spills.

How the launches are found (so that what is compiled is what training launches):

1. every attention call site of the MLPerf model (``mlperf`` preset: crop 256, 124 + 4 MSA rows,
   1,024 extra rows, 4 templates) is built from the real model modules on the ``meta`` device and
   run forward *and* backward with ``SCALEFOLD_KERNELS=triton``; LayerNorm runs at every (hidden
   size, rows) of the MLPerf model; Adam+SWA on flat buffers of its 93 M parameters;
2. the custom ops' entry points (``triton_ops.attention_fwd`` ...) are wrapped so that each call
   also runs the real launcher (``attention_triton.attention_forward`` ...) on the same meta
   tensors, with the ``@triton.jit`` kernels replaced by recorders and the autotuner replaced by
   a sweep that launches every candidate config (``--table``: the launch-config table's entry for
   each key) -- so strides, constexprs, ``num_warps`` and ``num_stages`` come from the launcher
   itself;
3. each distinct launch (kernel, argument types and 16-byte divisibility as Triton's own binder
   specialises them, constexprs, options) is compiled once per architecture; ``cuobjdump
   --dump-resource-usage`` on the cubin gives the registers, ptxas' own ``-v`` report the bytes
   of spill stores per thread (the stack frame when the kernel came from Triton's cache); shared
   memory is the dynamic amount Triton requests at launch (``metadata.shared``), checked
   against the architecture's opt-in limit (227 KiB H100, 163 KiB A100).

One record per compile: ``kernel`` (``attention_fwd``, ``attention_bwd:dkdv`` ...), ``dtype``
(``bf16``/``fp16``/``fp32``, and ``tf32``: fp32 tensors under ``allow_tf32``, attention only),
``arch``, ``config``, ``default`` (the config used without autotuning), ``ok`` (compiled and fits
shared memory), ``error``, ``registers``, ``shared_bytes``, ``spill_bytes``, plus ``sites`` (the
model call sites launching it), ``compile_s`` and ``keys`` (the ``(tuner, dtype label, shape
class)`` keys of :mod:`scalefold.kernels.launch_table` it serves). The exit status is 1 when any
record is not ``ok`` or a default config spills: the candidate lists in the kernel modules hold only
configs that compile and fit.

``--table`` checks the launch-config table (:mod:`scalefold.kernels.launch_table`; default the one
in use) instead: each entry is launched where the MLPerf sites look it up and compiled like a
default (no spills allowed), and the table must hold an entry for every key the sites launch and
none that no site launches. ``--arch``/``--dtype`` narrow it (default: the table's architectures
and dtype labels); ``--site`` narrows the compiles, not the completeness check; ``--no-compile``
runs the completeness check alone. CI compiles a sample (``tests/kernels/test_aot.py``); the
whole table is ``python -m scalefold.kernels.aot --table --jobs 2``.

The kernel modules must be imported with ``TRITON_INTERPRET`` off (``@triton.jit`` returns an
interpreter object otherwise); run this as its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

#: ``--arch`` -> (compute capability, opt-in dynamic shared memory per block in bytes)
ARCHS = {"sm_90": (90, 227 * 1024), "sm_80": (80, 163 * 1024)}
#: ``--dtype`` -> tensor dtype; ``tf32`` is fp32 storage with TF32 matmuls
#: (``torch.backends.cuda.matmul.allow_tf32``), which changes only the attention kernels' dots
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
KERNELS = ("attention_fwd", "attention_bwd", "layer_norm_fwd", "layer_norm_bwd", "adam_swa")

EXIT_BAD_INPUT = 3
#: the oldest Triton whose compiler internals this module drives (``create_function_from_signature(signature,
#: params, backend)`` returning bound args, specialisation and options; ``JITFunction._pack_args``): Triton 3.2
#: returns another tuple, 3.3 and 3.4 have no ``_pack_args``. The kernels themselves need only Triton 3.2.
AOT_MIN_TRITON = (3, 5)


# ----------------------------------------------------------------------------------------------
# Capturing launches
# ----------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One kernel launch as a launcher issued it (meta tensors, never run)."""

    kernel: str  # record name, e.g. "attention_bwd:dkdv"
    dtype: str  # the training dtype of the call site (bf16/fp16/fp32)
    fn: object  # the triton.runtime.JITFunction
    args: tuple
    kwargs: dict
    candidate: dict | None  # the autotune candidate being launched; None for a fixed launch
    default: bool
    site: str
    key: tuple | None = None  # (tuner, dtype label, shape class) of the config launched; None: fixed


@dataclass
class _Context:
    site: str = ""
    dtype: str = ""
    candidate: dict | None = None
    default: bool = True
    key: tuple | None = None
    launches: list[Launch] = field(default_factory=list)
    #: table mode: (tuner, dtype label, shape class) -> (config launched, whether a table entry)
    visited: dict[tuple, tuple[dict, bool]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def launching(self, candidate: dict | None, default: bool, key: tuple | None) -> Iterator[None]:
        self.candidate, self.default, self.key = candidate, default, key
        try:
            yield
        finally:
            self.candidate, self.default, self.key = None, True, None


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, fn, kernel: str, ctx: _Context) -> None:
        self.fn, self.kernel, self.ctx = fn, kernel, ctx

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            c = self.ctx
            c.launches.append(
                Launch(self.kernel, c.dtype, self.fn, args, kwargs, c.candidate, c.default, c.site, c.key)
            )

        return launch


class _SweepTuner:
    """Stands in for ``autotune.Tuner``: ``run`` launches every candidate of the architecture (the
    default first; through ``bench`` where the launcher gives one) and then the default, as the
    launcher would without autotuning and without a table entry."""

    def __init__(self, tuner, ctx: _Context, capability: int | None) -> None:
        self.tuner, self.ctx, self.capability = tuner, ctx, capability

    def run(self, key, launch: Callable[[dict], None], bench: Callable[[dict], None] | None = None) -> dict:
        default = self.tuner.default(self.capability)
        table_key = (self.tuner.name, key.dtype, key.shape)
        for cfg in self.tuner.candidates(self.capability):
            with self.ctx.launching(dict(cfg), cfg == default, table_key):
                (bench or launch)(cfg)
        with self.ctx.launching(None, True, table_key):
            launch(default)
        return default


class _TableTuner:
    """Stands in for ``autotune.Tuner`` in table mode: ``run`` launches the launch-config table's
    entry for the key on the architecture (the default config where it has none, or where the entry
    does not fit the kernel: a problem), and notes the key as visited."""

    def __init__(self, tuner, ctx: _Context, capability: int, table) -> None:
        self.tuner, self.ctx, self.capability, self.table = tuner, ctx, capability, table

    def run(self, key, launch: Callable[[dict], None], bench: Callable[[dict], None] | None = None) -> dict:
        from scalefold.kernels import launch_table

        arch = launch_table.arch_name(self.capability)
        table_key = (self.tuner.name, key.dtype, key.shape)
        default = self.tuner.default(self.capability)
        entry = self.table.entry(arch, *table_key)
        reason = None if entry is None else launch_table.misfit(entry, default)
        if reason is not None:
            self.ctx.problems.append(f"{arch} {' '.join(table_key)}: entry {entry} does not fit the kernel ({reason})")
            entry = None
        config = default if entry is None else entry
        self.ctx.visited[table_key] = (dict(config), entry is not None)
        with self.ctx.launching(dict(config), True, table_key):
            launch(config)
        return config


# (module attribute, record name) of every @triton.jit kernel the launchers call
_KERNEL_NAMES = {
    "attention_triton": {
        "_attn_fwd": "attention_fwd",
        "_attn_bwd_preprocess": "attention_bwd:preprocess",
        "_attn_bwd_dkdv": "attention_bwd:dkdv",
        "_attn_bwd_dq_dbias": "attention_bwd:dq_dbias",
    },
    "layer_norm_triton": {
        "_ln_fwd": "layer_norm_fwd",
        "_ln_bwd_dx": "layer_norm_bwd:dx",
        "_ln_bwd_dwdb": "layer_norm_bwd:dwdb",
    },  # fmt: skip
    "adam_swa_triton": {"_adam_swa": "adam_swa"},
}


def _kernel_modules():
    """Import the kernel modules with the interpreter off (a compile needs real JITFunctions)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        if any(f"scalefold.kernels.{m}" in sys.modules for m in _KERNEL_NAMES):
            raise RuntimeError(
                "the Triton kernels were imported in interpreter mode; run the AOT check in its own process"
            )
        os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_INTERPRET", "0")  # triton_ops would switch the interpreter on
    from triton.runtime.jit import JITFunction

    from scalefold.kernels import adam_swa_triton, attention_triton, layer_norm_triton, triton_ops

    if not isinstance(attention_triton._attn_fwd, JITFunction):
        raise RuntimeError("the Triton kernels were imported in interpreter mode; run the AOT check in its own process")
    return {"attention_triton": attention_triton, "layer_norm_triton": layer_norm_triton,
            "adam_swa_triton": adam_swa_triton, "triton_ops": triton_ops}  # fmt: skip


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def capturing(ctx: _Context, arch: int | None = None, table=None) -> Iterator[dict]:
    """Kernels replaced by recorders, the autotuner by a sweep (or, given a launch-config ``table``,
    by its entries), the custom ops by wrappers that also run the launchers; ``SCALEFOLD_KERNELS=
    triton`` so the model dispatches to them."""
    mods = _kernel_modules()
    from scalefold.kernels import autotune

    real_get_tuner = autotune.get_tuner

    def sweep_tuner(name, configs, interpreter_config):
        tuner = real_get_tuner(name, configs, interpreter_config)
        return _SweepTuner(tuner, ctx, arch) if table is None else _TableTuner(tuner, ctx, arch, table)

    ops, at, ln = mods["triton_ops"], mods["attention_triton"], mods["layer_norm_triton"]
    real = {n: getattr(ops, n) for n in ("attention_fwd", "attention_bwd", "layer_norm_fwd", "layer_norm_bwd")}
    launchers = {
        "attention_fwd": at.attention_forward,
        "attention_bwd": at.attention_backward,
        "layer_norm_fwd": ln.layer_norm_forward,
        "layer_norm_bwd": lambda dy, *rest: ln.layer_norm_backward(dy.contiguous(), *rest),  # as the op does
    }

    def wrap(name):
        def op(*args):
            launchers[name](*args)
            return real[name](*args)  # meta tensors: the op's fake implementation, with autograd

        return op

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(autotune, "get_tuner", sweep_tuner))
        for module, names in _KERNEL_NAMES.items():
            for attr, kernel in names.items():
                fn = getattr(mods[module], attr)
                stack.enter_context(_patched(mods[module], attr, _Recorder(fn, kernel, ctx)))
        for name in real:
            stack.enter_context(_patched(ops, name, wrap(name)))
        old_env = os.environ.get("SCALEFOLD_KERNELS")
        os.environ["SCALEFOLD_KERNELS"] = "triton"
        try:
            yield mods
        finally:
            if old_env is None:
                os.environ.pop("SCALEFOLD_KERNELS", None)
            else:
                os.environ["SCALEFOLD_KERNELS"] = old_env


# ----------------------------------------------------------------------------------------------
# MLPerf call sites
# ----------------------------------------------------------------------------------------------


def _mlperf():
    from scalefold.model.config import AlphaFoldConfig

    return AlphaFoldConfig.from_preset("mlperf")


def _tensor(shape: tuple, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    """An input under the current default device: uninitialised on ``meta`` (nothing runs), random
    elsewhere (``scalefold tune-kernels`` times the kernels on them)."""
    if torch.empty(0).device.type == "meta":
        return torch.empty(shape, dtype=dtype, requires_grad=requires_grad)
    return torch.randn(shape, dtype=dtype).requires_grad_(requires_grad)


def attention_sites() -> dict[str, Callable[..., None]]:
    """Every attention call of the MLPerf model: name -> run(dtype, device="meta") (forward + backward)."""
    from scalefold.model.msa_attention import MSAColumnAttention, MSAColumnGlobalAttention, MSARowAttentionWithPairBias
    from scalefold.model.template import TemplatePointwiseAttention
    from scalefold.model.triangle import TriangleAttention

    cfg = _mlperf()
    n = cfg.train_sequence_crop_size
    n_seq = cfg.max_msa_clusters + cfg.max_templates  # template torsion angles become MSA rows
    n_extra, n_templ = cfg.max_extra_msa, cfg.max_templates
    evo, extra = cfg.evoformer_stack_config, cfg.extra_msa_stack_config
    tps, tpa = cfg.template_pair_stack_config, cfg.template_pointwise_attention_config

    def run(make_module, *shapes):
        def go(dtype: torch.dtype, device: str | torch.device = "meta") -> None:
            with torch.device(device):
                module = make_module().to(dtype)
                inputs = [_tensor(s, dtype, requires_grad=True) for s in shapes]
            out = module(*inputs)
            out.float().sum().backward()

        return go

    def template_pointwise(dtype, device="meta"):
        with torch.device(device):
            module = TemplatePointwiseAttention(tpa).to(dtype)
            t = _tensor((n_templ, n, n, tpa.c_t), dtype, requires_grad=True)
            z = _tensor((n, n, tpa.c_z), dtype, requires_grad=True)
            mask = torch.ones(n_templ, dtype=dtype)
        module(t, z, mask).float().sum().backward()

    return {
        "msa_row": run(lambda: MSARowAttentionWithPairBias(evo.c_m, evo.c_z, evo.c_hidden_msa_att, evo.num_heads_msa),
                       (n_seq, n, evo.c_m), (n, n, evo.c_z)),
        "msa_col": run(lambda: MSAColumnAttention(evo.c_m, evo.c_hidden_msa_att, evo.num_heads_msa), (n_seq, n, evo.c_m)),
        "tri_start": run(lambda: TriangleAttention(evo.c_z, evo.c_hidden_tri_att, evo.num_heads_tri, starting=True),
                         (n, n, evo.c_z)),
        "tri_end": run(lambda: TriangleAttention(evo.c_z, evo.c_hidden_tri_att, evo.num_heads_tri, starting=False),
                       (n, n, evo.c_z)),
        "extra_msa_row": run(
            lambda: MSARowAttentionWithPairBias(extra.c_e, extra.c_z, extra.c_hidden_msa_att, extra.num_heads_msa),
            (n_extra, n, extra.c_e), (n, n, extra.c_z)),
        "extra_msa_col_global": run(
            lambda: MSAColumnGlobalAttention(extra.c_e, extra.c_hidden_msa_att, extra.num_heads_msa),
            (n_extra, n, extra.c_e)),
        "template_tri_start": run(lambda: TriangleAttention(tps.c_t, tps.c_hidden_tri_att, tps.num_heads_tri),
                                  (n_templ, n, n, tps.c_t)),
        "template_tri_end": run(
            lambda: TriangleAttention(tps.c_t, tps.c_hidden_tri_att, tps.num_heads_tri, starting=False),
            (n_templ, n, n, tps.c_t)),
        "template_pointwise": template_pointwise,
    }  # fmt: skip


def layer_norm_sites() -> dict[str, Callable[..., None]]:
    """LayerNorm at every (hidden size, rows) of the MLPerf model (forward + backward): the MSA
    (c_m x N_seq N_res rows), the pair (c_z x N_res^2), the extra MSA and the template pair stack
    (64 x 1,024 N_res and 4 N_res^2 rows: one shape class), the single representation (c_s x N_res)
    and the recycled first MSA row (c_m x N_res). A census of the MLPerf model's forward on the meta
    device (every call of ``kernels.layer_norm``) found exactly these (C, rows) pairs."""
    from scalefold.model.primitives import LayerNorm

    cfg = _mlperf()
    n = cfg.train_sequence_crop_size
    n_seq = cfg.max_msa_clusters + cfg.max_templates
    evo, extra, tps = cfg.evoformer_stack_config, cfg.extra_msa_stack_config, cfg.template_pair_stack_config
    shapes = {
        "layer_norm_msa": (evo.c_m, n_seq * n),
        "layer_norm_pair": (evo.c_z, n * n),
        "layer_norm_extra_msa": (extra.c_e, cfg.max_extra_msa * n),
        "layer_norm_template_pair": (tps.c_t, cfg.max_templates * n * n),
        "layer_norm_single": (cfg.structure_module_config.c_s, n),
        "layer_norm_msa_first_row": (cfg.recycling_embedder_config.c_m, n),
    }

    def run(c, rows):
        def go(dtype, device="meta"):
            with torch.device(device):
                module = LayerNorm(c).to(dtype)
                x = _tensor((rows, c), dtype, requires_grad=True)
            module(x).float().sum().backward()

        return go

    return {name: run(c, rows) for name, (c, rows) in shapes.items()}


def adam_sites() -> dict[str, Callable[..., None]]:
    """Adam+SWA on the flat buffers of the MLPerf model's parameters: master fp32, gradients and
    compute copy in the training dtype; the first SWA update copies, later ones average."""
    from scalefold.kernels import adam_swa_triton
    from scalefold.kernels.reference import adam_step_scalars

    cfg = _mlperf()
    numel = 93_229_082

    def run(swa_copy):
        def go(dtype, device="meta"):
            with torch.device(device):
                master = [_tensor((numel,), torch.float32) for _ in range(4)]
                grad = _tensor((numel,), dtype)
                compute = None if dtype == torch.float32 else _tensor((numel,), dtype)
                lr, step, clip = torch.full((), 1e-3), torch.full((), 1.0), torch.full((), 1.0)
                neg_step_size, bc2_sqrt = adam_step_scalars(lr, step, 0.9, 0.999)
            param, exp_avg, exp_avg_sq, swa = master
            exp_avg_sq = exp_avg_sq.abs()
            adam_swa_triton.adam_swa_launch(
                param, grad, exp_avg, exp_avg_sq, swa, compute, clip if cfg.gradient_clipping else None,
                neg_step_size, bc2_sqrt, 0.9, 0.999, 1e-6, cfg.swa_decay_rate, swa_copy,
            )  # fmt: skip

        return go

    return {"adam_swa_average": run(False), "adam_swa_first": run(True)}


def all_sites(kernels: Sequence[str] = KERNELS) -> dict[str, Callable[[torch.dtype], None]]:
    """The call sites launching ``kernels``: name -> run(dtype)."""
    sites: dict[str, Callable] = {}
    if {"attention_fwd", "attention_bwd"} & set(kernels):
        sites.update(attention_sites())
    if {"layer_norm_fwd", "layer_norm_bwd"} & set(kernels):
        sites.update(layer_norm_sites())
    if "adam_swa" in kernels:
        sites.update(adam_sites())
    return sites


def collect(
    dtypes: Sequence[str],
    kernels: Sequence[str] = KERNELS,
    arch: int | None = None,
    only_sites: Sequence[str] | None = None,
    table=None,
    ctx: _Context | None = None,
) -> list[Launch]:
    """Every launch of the selected kernels at the MLPerf call sites (all, or ``only_sites``), in
    every dtype, with the candidate lists of compute capability ``arch`` -- or, given a launch-config
    ``table``, with its entries for ``arch`` (the keys met are left in ``ctx.visited``)."""
    ctx = _Context() if ctx is None else ctx
    with capturing(ctx, arch, table):
        sites = all_sites(kernels)
        unknown = sorted(set(only_sites or ()) - set(sites))
        if unknown:
            raise ValueError(f"unknown site(s) {', '.join(unknown)}; expected some of {', '.join(sites)}")
        if only_sites:
            sites = {name: go for name, go in sites.items() if name in only_sites}
        dot_sites = set(attention_sites())
        for dtype in dtypes:
            with _patched(torch.backends.cuda.matmul, "allow_tf32", dtype == "tf32"):
                for site, go in sites.items():
                    if dtype == "tf32" and site not in dot_sites:
                        continue  # no matmul: the fp32 kernel
                    ctx.site, ctx.dtype = site, dtype
                    go(DTYPES[dtype])
    # tf32 changes only the attention dots: the LayerNorms inside the attention modules are fp32's
    return [
        launch
        for launch in ctx.launches
        if launch.kernel.split(":")[0] in kernels and (launch.dtype != "tf32" or launch.kernel.startswith("attention"))
    ]


def table_keys(archs: Sequence[str] = tuple(ARCHS), dtypes: Sequence[str] = ("bf16", "tf32", "fp32"), table=None):
    """``{arch: {(tuner, dtype label, shape class): (config, from the table)}}``: every key the MLPerf
    call sites launch with (every site, every kernel), and the config each gets from ``table`` (an
    empty table: the default configs)."""
    from scalefold.kernels import launch_table

    table = launch_table.Table() if table is None else table
    out = {}
    for arch in archs:
        ctx = _Context()
        collect(dtypes, KERNELS, ARCHS[arch][0], table=table, ctx=ctx)
        labels = set(dtypes)
        out[arch] = {k: v for k, v in ctx.visited.items() if k[1] in labels}
    return out


# ----------------------------------------------------------------------------------------------
# Compiling
# ----------------------------------------------------------------------------------------------


@dataclass
class Task:
    """One distinct compile: a kernel specialisation for one architecture."""

    kernel: str
    fn_name: str
    module: str
    dtype: str
    arch: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    config: dict
    default: bool = False
    candidates: list = field(default_factory=list)
    sites: list = field(default_factory=list)
    keys: list = field(default_factory=list)  # the (tuner, dtype label, shape class) keys it serves


@dataclass
class Record:
    kernel: str
    dtype: str
    arch: str
    config: dict
    default: bool
    ok: bool
    error: str | None
    registers: int | None
    shared_bytes: int | None
    spill_bytes: int | None
    shared_limit: int
    candidates: list
    sites: list
    compile_s: float
    keys: list = field(default_factory=list)  # (tuner, dtype label, shape class) keys served


_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK", "ROWS", "BLOCK_P")


def tasks_for(launches: Sequence[Launch], arch: str) -> list[Task]:
    """Distinct compiles of ``launches`` for ``arch``, specialised as Triton's binder would."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    capability = ARCHS[arch][0]
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binders: dict[int, Callable] = {}
    tasks: dict[str, Task] = {}
    for launch in launches:
        fn = launch.fn
        if id(fn) not in binders:
            binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binders[id(fn)](*launch.args, **launch.kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, opts, bound, spec, opts)
        config = {k: v for k, v in launch.kwargs.items() if k in _CONFIG_KEYS}
        config["num_warps"] = options.num_warps
        config["num_stages"] = options.num_stages
        dtype = launch.dtype
        key = repr((launch.kernel, dtype, sorted(signature.items()), sorted(constexprs.items(), key=str),
                    sorted(attrs.items(), key=str), sorted(opts.items())))  # fmt: skip
        task = tasks.get(key)
        if task is None:
            task = tasks[key] = Task(
                launch.kernel, fn.__name__, fn.module, dtype, arch, signature, constexprs, attrs, dict(opts), config
            )
        task.default |= launch.default
        if launch.candidate is not None and launch.candidate not in task.candidates:
            task.candidates.append(launch.candidate)
        if launch.site not in task.sites:
            task.sites.append(launch.site)
        if launch.key is not None and list(launch.key) not in task.keys:
            task.keys.append(list(launch.key))
    return list(tasks.values())


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack frame bytes per thread)`` of the one kernel in ``cubin`` (``cuobjdump``).
    Spilled registers live in the stack frame."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    if not match:
        raise RuntimeError(f"no resource usage in cuobjdump output: {out.strip()[:200]}")
    return int(match.group(1)), int(match.group(2))


def spill_stores(ptxas_log: str) -> int | None:
    """Bytes of spill stores ptxas reported (``ptxas -v``); None when it reported nothing (a cache hit)."""
    match = re.search(r"(\d+) bytes spill stores", ptxas_log)
    return int(match.group(1)) if match else None


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Triton's CompilationError puts the source excerpt first and the reason last
    pick = next((line for line in reversed(lines) if not line.startswith("^")), "") if lines else ""
    for line in lines:
        if "error" in line.lower() and "ptxas" in line.lower():
            pick = line
            break
    return f"{type(exc).__name__}: {pick}"[:300] if pick else type(exc).__name__


def compile_task(task: Task) -> Record:
    """Compile one task (PTX -> cubin through the wheel's ptxas) and measure it."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    capability, limit = ARCHS[task.arch]
    fn = getattr(importlib.import_module(task.module), task.fn_name)
    start = time.perf_counter()
    registers = shared = spills = None
    error = None
    log = io.StringIO()
    try:
        # Triton prints ptxas' -v report (registers, stack frame, spill stores) when asked to;
        # on a failed ptxas it prints the whole PTX: both stay out of the table
        with _patched(knobs.nvidia, "dump_ptxas_log", True), contextlib.redirect_stdout(log):
            kernel = triton.compile(
                ASTSource(fn, task.signature, task.constexprs, task.attrs),
                target=GPUTarget("cuda", capability, 32),
                options=task.options,
            )
        shared = int(kernel.metadata.shared)
        registers, stack = resource_usage(kernel.asm["cubin"])
        spills = spill_stores(log.getvalue())
        if spills is None:  # compiled earlier (cache hit): the stack frame bounds the spills
            spills = stack
        if shared > limit:
            error = f"shared memory {shared} B > {limit} B ({task.arch})"
    except Exception as exc:  # noqa: BLE001 - a failed compile is a result, reported per record
        error = _short_error(exc)
    return Record(
        task.kernel, task.dtype, task.arch, task.config, task.default, error is None, error,
        registers, shared, spills, limit, task.candidates, task.sites, round(time.perf_counter() - start, 2),
        task.keys,
    )  # fmt: skip


_POOL_TASKS: list[Task] = []


def _compile_index(i: int) -> Record:
    return compile_task(_POOL_TASKS[i])


def compile_all(tasks: Sequence[Task], jobs: int = 1, progress: bool = True) -> list[Record]:
    """Compile every task (``jobs`` worker processes), with a progress bar on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=len(tasks), desc="aot compile", unit="kernel", file=sys.stderr, disable=not progress)
    records: list[Record | None] = [None] * len(tasks)
    if jobs <= 1:
        for i, task in enumerate(tasks):
            records[i] = compile_task(task)
            bar.update()
    else:
        import concurrent.futures as cf
        import multiprocessing

        _POOL_TASKS[:] = tasks
        with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(_compile_index, i): i for i in range(len(tasks))}
            for future in cf.as_completed(futures):
                records[futures[future]] = future.result()
                bar.update()
    bar.close()
    return records  # type: ignore[return-value]


def run(
    archs: Sequence[str] = tuple(ARCHS),
    dtypes: Sequence[str] = tuple(DTYPES),
    kernels: Sequence[str] = KERNELS,
    default_only: bool = False,
    sites: Sequence[str] | None = None,
    jobs: int = 1,
    progress: bool = True,
) -> list[Record]:
    """Collect, specialise and compile; one record per compile."""
    tasks: list[Task] = []
    for arch in archs:
        launches = collect(dtypes, kernels, ARCHS[arch][0], sites)
        arch_tasks = tasks_for(launches, arch)
        tasks.extend(t for t in arch_tasks if t.default or not default_only)
    return compile_all(tasks, jobs, progress)


def check_table(
    table,
    archs: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    sites: Sequence[str] | None = None,
    jobs: int = 1,
    progress: bool = True,
    compile_: bool = True,
) -> tuple[list[Record], list[str]]:
    """Compile every entry of a launch-config ``table`` (of ``archs``, default all of the table's, in
    ``dtypes``, default the labels it holds) where the MLPerf call sites launch it (every launch
    counts as a default: no spills allowed); ``sites`` limits the compiles, not the completeness
    check. Returns the records and the problems: an entry no site launches (stale), a key the sites
    launch without an entry, an entry that does not fit its kernel, a failed or spilling compile.
    ``compile_=False``: the completeness check alone (seconds)."""
    found: list[str] = []
    tasks: list[Task] = []
    for arch in archs or sorted(table.archs):
        if arch not in ARCHS:
            found.append(f"{arch}: no ahead-of-time target for this architecture (known: {', '.join(ARCHS)})")
            continue
        labels = list(dtypes or sorted({e[2] for e in table.entries(arch)}))
        found += [f"{arch} {d}: entries of a dtype the check does not know ({', '.join(DTYPES)})"
                  for d in labels if d not in DTYPES]  # fmt: skip
        labels = [d for d in labels if d in DTYPES]
        ctx = _Context()
        launches = collect(labels, KERNELS, ARCHS[arch][0], table=table, ctx=ctx)
        found += ctx.problems
        visited = {k: entry for k, (_, entry) in ctx.visited.items() if k[1] in labels}
        found += [f"{arch} {' '.join(k)}: no entry (the kernel's default config is launched)"
                  for k, entry in sorted(visited.items()) if not entry]  # fmt: skip
        found += [f"{arch} {kernel} {dtype} {shape}: stale entry, no MLPerf call site launches it"
                  for _, kernel, dtype, shape, _ in table.entries(arch)
                  if dtype in labels and (kernel, dtype, shape) not in visited]  # fmt: skip
        if compile_:
            tasks += tasks_for([x for x in launches if not sites or x.site in sites], arch)
    records = compile_all(tasks, jobs, progress) if tasks else []
    return records, found + problems(records)


def problems(records: Sequence[Record]) -> list[str]:
    """What must not be: a failed or oversized compile, or a default config that spills."""
    out = []
    for r in records:
        where = f"{r.kernel} {r.dtype} {r.arch} {r.config}"
        if not r.ok:
            out.append(f"{where}: {r.error}")
        elif r.default and r.spill_bytes:
            out.append(f"{where}: default config spills {r.spill_bytes} B per thread")
    return out


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _config_text(config: dict) -> str:
    short = {"BLOCK_M": "M", "BLOCK_N": "N", "BLOCK_D": "D", "BLOCK": "B", "ROWS": "R", "BLOCK_P": "P",
             "num_warps": "w", "num_stages": "s"}  # fmt: skip
    return " ".join(f"{short.get(k, k)}{v}" for k, v in config.items())


def table(records: Sequence[Record]) -> str:
    """Human-readable table, one line per compile."""
    head = ("kernel", "dtype", "arch", "config", "def", "ok", "regs", "smem KiB", "spill", "sites / error")
    rows = [head]
    for r in sorted(records, key=lambda r: (r.kernel, r.dtype, r.arch, not r.default, str(r.config))):
        smem = "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}"
        rows.append((
            r.kernel, r.dtype, r.arch, _config_text(r.config), "*" if r.default else "", "yes" if r.ok else "NO",
            "-" if r.registers is None else str(r.registers), smem,
            "-" if r.spill_bytes is None else str(r.spill_bytes),
            r.error if r.error else ",".join(r.sites),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    return "\n".join(lines)


def markdown(records: Sequence[Record]) -> str:
    """One row per (program, dtype, arch): its compiles, the default config's worst case over the
    MLPerf sites, the largest figures over every candidate, and which candidates spill."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault((r.kernel, r.dtype, r.arch), []).append(r)
    lines = [
        "| kernel | dtype | arch | compiles (ok) | default config | default regs / smem KiB / spill B "
        "| all candidates: max regs / max smem KiB | candidates spilling (max B) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def worst(rs: list[Record]) -> tuple[int, float, int]:
        return (max(r.registers or 0 for r in rs), max(r.shared_bytes or 0 for r in rs) / 1024,
                max(r.spill_bytes or 0 for r in rs))  # fmt: skip

    for (kernel, dtype, arch), rs in sorted(groups.items()):
        defaults = [r for r in rs if r.default]
        configs = sorted({_config_text(r.config) for r in defaults})
        d_regs, d_smem, d_spill = worst(defaults) if defaults else (0, 0.0, 0)
        a_regs, a_smem, _ = worst(rs)
        spilling = {_config_text(r.config) for r in rs if r.spill_bytes}
        max_spill = max((r.spill_bytes or 0 for r in rs), default=0)
        lines.append(
            f"| {kernel} | {dtype} | {arch} | {len(rs)} ({sum(r.ok for r in rs)}) | {'; '.join(configs)} "
            f"| {d_regs} / {d_smem:.1f} / {d_spill} | {a_regs} / {a_smem:.1f} "
            f"| {len(spilling)}{f' ({max_spill})' if spilling else ''} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scalefold.kernels.aot",
        description="Compile every ScaleFold Triton kernel (every autotune candidate, MLPerf shapes) for real "
        "GPUs without one, and report registers, shared memory and spills per compile.",
    )
    p.add_argument("--arch", action="append", choices=sorted(ARCHS), help="target (repeatable; default both)")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="data type (repeatable; default all)")
    p.add_argument("--kernel", action="append", choices=KERNELS, help="kernel (repeatable; default all)")
    p.add_argument("--site", action="append", help="only this MLPerf call site, e.g. msa_row (repeatable; default all)")
    p.add_argument("--default-only", action="store_true", help="only the configs used without autotuning")
    p.add_argument("--json", action="store_true", help="JSON lines, one record per compile, instead of the table")
    p.add_argument("--markdown", action="store_true", help="a summary per kernel x dtype x arch (bench/RESULTS.md)")
    p.add_argument(
        "--from-json", metavar="FILE", help="summarise the records of an earlier --json run; compile nothing"
    )
    p.add_argument(
        "--table", nargs="?", const="", metavar="FILE",
        help="compile the entries of a launch-config table instead of the candidates, and check it holds an entry "
        "for every key the MLPerf sites launch and no other (default FILE: the table in use, "
        "scalefold/kernels/launch_configs.json or $SCALEFOLD_LAUNCH_CONFIGS); --arch/--dtype/--site narrow it",
    )  # fmt: skip
    p.add_argument("--no-compile", action="store_true",
                   help="with --table: only check that it holds the keys the MLPerf sites launch (seconds)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="parallel compile processes (default 1)")
    p.add_argument("--cache-dir", help="Triton cache directory (default: a fresh temporary one, so all compiles run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def triton_problem() -> str | None:
    """Why this module cannot compile with the installed Triton (absent, or older than ``AOT_MIN_TRITON``), or None."""
    from scalefold.kernels import triton_version

    version = triton_version()
    if version is None:
        return "Triton is not installed (or does not import): pip install 'triton>=3.5'"
    if version < AOT_MIN_TRITON:
        return (
            f"python -m scalefold.kernels.aot needs Triton >= 3.5 (found {version[0]}.{version[1]}): it drives "
            "Triton's compiler internals, which changed in 3.3 and 3.5 (the kernels themselves run with Triton >= 3.2)"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Triton 3.9 warns once that fp fusion defaults to on; the compile keeps the runtime's default
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    if args.jobs < 1:
        print(f"--jobs {args.jobs}: expected a positive number", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.from_json:
        return _summarise_json(args)
    problem = triton_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.no_compile and args.table is None:
        print("--no-compile applies to --table", file=sys.stderr)
        return EXIT_BAD_INPUT
    table = _read_table(args) if args.table is not None else None
    if table is EXIT_BAD_INPUT:
        return EXIT_BAD_INPUT
    _kernel_modules()  # before the model (and through it the kernels) is imported
    known = all_sites(args.kernel or KERNELS)
    unknown = sorted(set(args.site or ()) - set(known))
    if unknown:
        print(
            f"--site {', '.join(unknown)}: unknown; the sites of these kernels are {', '.join(known)}", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    missing = [tool for tool in ("ptxas", "cuobjdump") if not Path(_tool(tool)).exists()]
    if missing:
        print(f"Triton's CUDA tools not found ({', '.join(missing)}): cannot compile for GPUs", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.cache_dir:
            os.environ["TRITON_CACHE_DIR"] = args.cache_dir
        else:
            os.environ["TRITON_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="scalefold-aot-"))
        start = time.perf_counter()
        if table is not None:
            records, bad = check_table(table, args.arch, args.dtype, args.site, args.jobs, not args.no_progress,
                                       compile_=not args.no_compile)  # fmt: skip
        else:
            records = run(
                archs=args.arch or tuple(ARCHS),
                dtypes=args.dtype or tuple(DTYPES),
                kernels=args.kernel or KERNELS,
                default_only=args.default_only,
                sites=args.site,
                jobs=args.jobs,
                progress=not args.no_progress,
            )
            bad = problems(records)
        elapsed = time.perf_counter() - start
    emit(records, args)
    summary = f"{len(records)} compiles in {elapsed:.0f} s, {len(bad)} problem(s)"
    print(summary + "".join(f"\n  {b}" for b in bad), file=sys.stderr)
    return 1 if bad else 0


def _summarise_json(args: argparse.Namespace) -> int:
    """``--from-json``: the records of an earlier run, summarised; nothing compiled."""
    try:
        records = load_records(args.from_json)
    except (OSError, ValueError, TypeError) as exc:
        print(f"--from-json {args.from_json}: not a file of --json records ({exc})", file=sys.stderr)
        return EXIT_BAD_INPUT
    emit(records, args)
    bad = problems(records)
    print(f"{len(records)} records, {len(bad)} problem(s)" + "".join(f"\n  {b}" for b in bad), file=sys.stderr)
    return 1 if bad else 0


def _read_table(args: argparse.Namespace):
    """``--table``'s launch-config table, or :data:`EXIT_BAD_INPUT` after a one-line message."""
    from scalefold.kernels import launch_table

    path = args.table or launch_table.table_path()
    if args.kernel or args.default_only:
        print("--table checks every kernel's entries: --kernel and --default-only do not apply", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return launch_table.read(path)
    except (OSError, launch_table.TableError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"--table {path}: not a readable launch-config table ({reason})", file=sys.stderr)
        return EXIT_BAD_INPUT


def emit(records: Sequence[Record], args: argparse.Namespace) -> None:
    if args.json:
        for r in records:
            print(json.dumps(asdict(r)))
    elif args.markdown:
        print(markdown(records))
    else:
        print(table(records))


def load_records(path: str) -> list[Record]:
    """Records of an earlier ``--json`` run."""
    return [Record(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
