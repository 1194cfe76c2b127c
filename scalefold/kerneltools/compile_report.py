"""Ahead-of-time compilation of every Triton kernel ScaleFold launches, for real GPUs, without one,
and its report: ``scalefold aot-check`` (the command line: :mod:`scalefold.commands.kernels`).

The kernel tests run in Triton's CPU interpreter, which accepts programs a GPU compile rejects
(``tl.dot`` tiles under 16, shared memory over the limit, bf16 paths it never really executes).
Triton compiles to PTX and cubin with no driver -- ``triton.compile(ASTSource(fn, signature,
constexprs, attrs), target=GPUTarget("cuda", 90, 32))`` -- and its wheel ships ``ptxas`` and
``cuobjdump``, so this module proves on a CPU that every program compiles for H100 (sm_90) and
A100 (sm_80), and reports its registers, shared memory and spills.

The launches come from the MLPerf call sites (:mod:`scalefold.kerneltools.sites`); each distinct
launch (kernel, argument types and 16-byte divisibility as Triton's own binder specialises them,
constexprs, options) is compiled once per architecture; ``cuobjdump --dump-resource-usage`` on the
cubin gives the registers, ptxas' own ``-v`` report the bytes of spill stores per thread (the stack
frame when the kernel came from Triton's cache); shared memory is the dynamic amount Triton requests
at launch (``metadata.shared``), checked against the architecture's opt-in limit (227 KiB H100,
163 KiB A100).

One record per compile: ``kernel`` (``attention_fwd``, ``attention_bwd:dkdv``, ``trimul:in_fwd`` ...), ``dtype``
(``bf16``/``fp16``/``fp32``, and ``tf32``: fp32 tensors under ``allow_tf32``, attention and trimul only),
``arch``, ``config``, ``default`` (the config used without autotuning), ``ok`` (compiled and fits
shared memory), ``error``, ``registers``, ``shared_bytes``, ``spill_bytes``, plus ``sites`` (the
model call sites launching it), ``compile_s`` and ``keys`` (the ``(tuner, dtype label, shape
class)`` keys of :mod:`scalefold.kernels.launch_table` it serves). The command's exit status is 1
when any record is not ``ok`` or a default config spills: the candidate lists in the kernel modules
hold only configs that compile and fit.

:func:`check_table` checks a launch-config table (``scalefold aot-check --table``) instead: each entry
is launched where the MLPerf sites look it up and compiled like a default (no spills allowed), and
the table must hold an entry for every key the sites launch and none that no site launches. CI
compiles a sample (``tests/kernels/test_aot.py``); the whole table is ``scalefold aot-check --table
--jobs 2``.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scalefold.kerneltools.sites import ARCHS, DTYPES, KERNELS, CaptureContext, Launch, collect, patched

#: the oldest Triton whose compiler internals this module drives (``create_function_from_signature(signature,
#: params, backend)`` returning bound args, specialisation and options; ``JITFunction._pack_args``): Triton 3.2
#: returns another tuple, 3.3 and 3.4 have no ``_pack_args``. The kernels themselves need only Triton 3.2.
AOT_MIN_TRITON = (3, 5)



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


_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK", "ROWS", "BLOCK_P", "BLOCK_C")


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


def tool_path(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack frame bytes per thread)`` of the one kernel in ``cubin`` (``cuobjdump``).
    Spilled registers live in the stack frame."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool_path("cuobjdump"), "--dump-resource-usage", f.name],
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
        with patched(knobs.nvidia, "dump_ptxas_log", True), contextlib.redirect_stdout(log):
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
        ctx = CaptureContext()
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



def _config_text(config: dict) -> str:
    short = {"BLOCK_M": "M", "BLOCK_N": "N", "BLOCK_D": "D", "BLOCK": "B", "ROWS": "R", "BLOCK_P": "P",
             "BLOCK_C": "C", "num_warps": "w", "num_stages": "s"}  # fmt: skip
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



def triton_problem() -> str | None:
    """Why this module cannot compile with the installed Triton (absent, or older than ``AOT_MIN_TRITON``), or None."""
    from scalefold.kernels import triton_version

    version = triton_version()
    if version is None:
        return "Triton is not installed (or does not import): pip install 'triton>=3.5'"
    if version < AOT_MIN_TRITON:
        return (
            f"scalefold aot-check needs Triton >= 3.5 (found {version[0]}.{version[1]}): it drives "
            "Triton's compiler internals, which changed in 3.3 and 3.5 (the kernels themselves run with Triton >= 3.2)"
        )
    return None



def emit(records: Sequence[Record], as_json: bool = False, as_markdown: bool = False) -> None:
    """The records on stdout: JSON lines, the markdown summary, or the table."""
    if as_json:
        for r in records:
            print(json.dumps(asdict(r)))
    elif as_markdown:
        print(markdown(records))
    else:
        print(table(records))


def load_records(path: str) -> list[Record]:
    """Records of an earlier ``--json`` run."""
    return [Record(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
