"""The MLPerf call sites of the Triton kernels, and the capture of every launch the kernels' launchers
issue there -- on the ``meta`` device, nothing run. Shared by the ahead-of-time check
(:mod:`scalefold.kerneltools.compile_report`, ``scalefold aot-check``) and ``scalefold tune-kernels``
(:mod:`scalefold.kerneltools.tune`).

How the launches are found (so that what is compiled or timed is what training launches):

1. every attention call site of the MLPerf model (``mlperf`` preset: crop 256, 124 + 4 MSA rows,
   1,024 extra rows, 4 templates) is built from the real model modules on the ``meta`` device and
   run forward *and* backward with ``SCALEFOLD_KERNELS=triton``; LayerNorm runs at every (hidden
   size, rows) of the MLPerf model; Adam+SWA on flat buffers of its 93 M parameters; the fused
   triangle multiplication's launchers run directly at its two pair shapes
   (``trimul_triton.run_site``);
2. the custom ops' entry points (``triton_ops.attention_fwd`` ...) are wrapped so that each call
   also runs the real launcher (``attention_triton.attention_forward`` ...) on the same meta
   tensors, with the ``@triton.jit`` kernels replaced by recorders and the autotuner replaced by
   a sweep that launches every candidate config (or, given a launch-config table, the table's entry
   for each key) -- so strides, constexprs, ``num_warps`` and ``num_stages`` come from the launcher
   itself.

The kernel modules must be imported with ``TRITON_INTERPRET`` off (``@triton.jit`` returns an
interpreter object otherwise): :func:`kernel_modules` imports them so, and refuses in a process that
already defined them interpreted.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from scalefold.kerneltools.targets import ARCHS, DTYPE_NAMES, KERNELS

#: ``--dtype`` -> tensor dtype (:data:`~scalefold.kerneltools.targets.DTYPE_NAMES`; ``tf32``: fp32 storage)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
assert tuple(DTYPES) == DTYPE_NAMES



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
class CaptureContext:
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

    def __init__(self, fn, kernel: str, ctx: CaptureContext) -> None:
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

    def __init__(self, tuner, ctx: CaptureContext, capability: int | None) -> None:
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

    def __init__(self, tuner, ctx: CaptureContext, capability: int, table) -> None:
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
KERNEL_NAMES = {
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
    "trimul_triton": {
        "_in_fwd": "trimul:in_fwd",
        "_out_fwd": "trimul:out_fwd",
        "_out_bwd": "trimul:out_bwd",
        "_gates_bwd": "trimul:gates_bwd",
    },
    "opm_triton": {"_opm_fwd": "opm:fwd", "_opm_dw": "opm:dw", "_opm_dx": "opm:dx"},
}


def compile_mode() -> None:
    """Switch Triton's interpreter off for this process, if Triton is not imported yet: Triton reads
    ``TRITON_INTERPRET`` when it is first imported, and :mod:`scalefold.kernels` switches the
    interpreter on (without CUDA) unless the environment says otherwise. A command that compiles the
    kernels for real GPUs calls this first, before anything imports the kernels."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "0"


def kernel_modules():
    """Import the kernel modules with the interpreter off (a compile needs real JITFunctions)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        if any(f"scalefold.kernels.{m}" in sys.modules for m in KERNEL_NAMES):
            raise RuntimeError(
                "the Triton kernels were imported in interpreter mode; run the AOT check in its own process"
            )
        os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_INTERPRET", "0")  # triton_ops would switch the interpreter on
    from triton.runtime.jit import JITFunction

    from scalefold.kernels import adam_swa_triton, attention_triton, layer_norm_triton, opm_triton, trimul_triton, triton_ops

    if not isinstance(attention_triton._attn_fwd, JITFunction):
        raise RuntimeError("the Triton kernels were imported in interpreter mode; run the AOT check in its own process")
    return {"attention_triton": attention_triton, "layer_norm_triton": layer_norm_triton,
            "adam_swa_triton": adam_swa_triton, "trimul_triton": trimul_triton, "opm_triton": opm_triton,
            "triton_ops": triton_ops}  # fmt: skip


@contextlib.contextmanager
def patched(obj, name: str, value) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def capturing(ctx: CaptureContext, arch: int | None = None, table=None) -> Iterator[dict]:
    """Kernels replaced by recorders, the autotuner by a sweep (or, given a launch-config ``table``,
    by its entries), the custom ops by wrappers that also run the launchers; ``SCALEFOLD_KERNELS=
    triton`` so the model dispatches to them."""
    mods = kernel_modules()
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
        stack.enter_context(patched(autotune, "get_tuner", sweep_tuner))
        for module, names in KERNEL_NAMES.items():
            for attr, kernel in names.items():
                fn = getattr(mods[module], attr)
                stack.enter_context(patched(mods[module], attr, _Recorder(fn, kernel, ctx)))
        for name in real:
            stack.enter_context(patched(ops, name, wrap(name)))
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


def trimul_sites() -> dict[str, Callable[..., None]]:
    """The fused triangle multiplication at the MLPerf model's pair shapes
    (:data:`scalefold.kernels.trimul_triton.MLPERF_SITES`: the Evoformer / extra-MSA pair, batch 1,
    N 256, c_z 128, C 128; the template pair stack, 4 templates, c_t 64, C 64): its four kernels
    launched once each, as one call's forward and backward do (``trimul_triton.run_site``; the
    outgoing and incoming updates launch the same kernels)."""
    from scalefold.kernels import trimul_triton

    def run(batch, n, cz, c):
        def go(dtype, device="meta"):
            with torch.device(device):
                trimul_triton.run_site(batch, n, cz, c, dtype)

        return go

    return {f"trimul_{name}": run(batch, n, cz, c) for name, batch, n, cz, c in trimul_triton.MLPERF_SITES}


def opm_sites() -> dict[str, Callable[..., None]]:
    """The fused outer product mean at the MLPerf model's MSA shapes
    (:data:`scalefold.kernels.opm_triton.MLPERF_SITES`: the Evoformer's 128 MSA rows and the extra-MSA stack's
    1,024 sequences, N 256, C 32, c_z 128): its kernels launched as one call's forward and backward do."""
    from scalefold.kernels import opm_triton

    def run(s, n, c, cz):
        def go(dtype, device="meta"):
            with torch.device(device):
                opm_triton.run_site(s, n, c, cz, dtype)

        return go

    return {f"opm_{name}": run(s, n, c, cz) for name, s, n, c, cz in opm_triton.MLPERF_SITES}


def dot_sites() -> set[str]:
    """The sites whose kernels use ``tl.dot`` (attention, triangle multiplication, outer product mean): the
    only ones ``tf32`` (fp32 under ``allow_tf32``) changes."""
    return set(attention_sites()) | set(trimul_sites()) | set(opm_sites())


#: the kernels (record-name prefixes) whose dots ``tf32`` changes; their tf32 launches are kept
DOT_KERNELS = ("attention", "trimul", "opm")


def all_sites(kernels: Sequence[str] = KERNELS) -> dict[str, Callable[[torch.dtype], None]]:
    """The call sites launching ``kernels``: name -> run(dtype)."""
    sites: dict[str, Callable] = {}
    if {"attention_fwd", "attention_bwd"} & set(kernels):
        sites.update(attention_sites())
    if {"layer_norm_fwd", "layer_norm_bwd"} & set(kernels):
        sites.update(layer_norm_sites())
    if "adam_swa" in kernels:
        sites.update(adam_sites())
    if "trimul" in kernels:
        sites.update(trimul_sites())
    if "opm" in kernels:
        sites.update(opm_sites())
    return sites


def collect(
    dtypes: Sequence[str],
    kernels: Sequence[str] = KERNELS,
    arch: int | None = None,
    only_sites: Sequence[str] | None = None,
    table=None,
    ctx: CaptureContext | None = None,
) -> list[Launch]:
    """Every launch of the selected kernels at the MLPerf call sites (all, or ``only_sites``), in
    every dtype, with the candidate lists of compute capability ``arch`` -- or, given a launch-config
    ``table``, with its entries for ``arch`` (the keys met are left in ``ctx.visited``)."""
    ctx = CaptureContext() if ctx is None else ctx
    with capturing(ctx, arch, table):
        sites = all_sites(kernels)
        unknown = sorted(set(only_sites or ()) - set(sites))
        if unknown:
            raise ValueError(f"unknown site(s) {', '.join(unknown)}; expected some of {', '.join(sites)}")
        if only_sites:
            sites = {name: go for name, go in sites.items() if name in only_sites}
        with_dots = dot_sites()
        for dtype in dtypes:
            with patched(torch.backends.cuda.matmul, "allow_tf32", dtype == "tf32"):
                for site, go in sites.items():
                    if dtype == "tf32" and site not in with_dots:
                        continue  # no matmul: the fp32 kernel
                    ctx.site, ctx.dtype = site, dtype
                    go(DTYPES[dtype])
    # tf32 changes only the dots (attention, trimul): the LayerNorms inside the attention modules are fp32's
    return [
        launch
        for launch in ctx.launches
        if launch.kernel.split(":")[0] in kernels and (launch.dtype != "tf32" or launch.kernel.startswith(DOT_KERNELS))
    ]


def table_keys(archs: Sequence[str] = tuple(ARCHS), dtypes: Sequence[str] = ("bf16", "tf32", "fp32"), table=None):
    """``{arch: {(tuner, dtype label, shape class): (config, from the table)}}``: every key the MLPerf
    call sites launch with (every site, every kernel), and the config each gets from ``table`` (an
    empty table: the default configs)."""
    from scalefold.kernels import launch_table

    table = launch_table.Table() if table is None else table
    out = {}
    for arch in archs:
        ctx = CaptureContext()
        collect(dtypes, KERNELS, ARCHS[arch][0], table=table, ctx=ctx)
        labels = set(dtypes)
        out[arch] = {k: v for k, v in ctx.visited.items() if k[1] in labels}
    return out

