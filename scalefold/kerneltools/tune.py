"""``scalefold tune-kernels``: time the Triton kernels' launch configs once and write the table
that every later run uses without timing anything (:mod:`scalefold.kernels.launch_table`).

    scalefold tune-kernels --out TABLE [--max-seconds 300] [--dtype bf16] [--site msa_row ...]
    scalefold tune-kernels --untimed-defaults --out TABLE [--arch sm_90 --arch sm_80] [--jobs 2]

**On a GPU** every MLPerf call site (:func:`scalefold.kerneltools.sites.all_sites`: the attention calls
of the MLPerf model, its LayerNorm shapes, Adam+SWA over its 93 M parameters, the fused triangle
multiplication at its two pair shapes) runs forward and
backward on random tensors with ``SCALEFOLD_KERNELS=triton``. Each tuned launch times every
candidate config of the GPU's architecture (``triton.testing.do_bench``, 10 ms warm-up and 40 ms
measured per candidate, after its compile), drops the candidates that fail to launch or spill
registers (the compiled kernel's ``n_spills``: the table holds no spilling config) and keeps the
fastest; a key met again is not timed twice. One progress line per key. The key list comes first,
from the same call sites captured on the ``meta`` device, so the progress counts against it.

``--max-seconds`` bounds the whole command: past it no further candidate is timed (a key cut short
keeps the fastest of those timed -- the default config, timed first, among them) and no further
site runs; keys not reached keep their earlier entry, or get the default config. The GPU window
of this project is one command of at most ~9 minutes: the bf16 keys (the MLPerf precision) first.

The output merges: ``TABLE`` (or, when it does not exist yet, the table in use) keeps its other
architectures; this architecture's entries are replaced for the keys timed, its ``source`` becomes
``"tuned on <GPU>, <date>"`` and its ``timings`` hold, per key, the fastest and the default
config's milliseconds. Check the result (``scalefold aot-check --table TABLE``) and
copy it over ``scalefold/kernels/launch_configs.json`` to ship it.

**Without a GPU** ``--untimed-defaults`` writes each kernel's default config for the architectures
named (default: those of the table without tuned entries) at every MLPerf key in bf16, tf32 and
fp32, and compiles them ahead of time (:mod:`scalefold.kerneltools.compile_report`): a default that fails to
compile, does not fit the architecture's shared memory or spills is replaced by the next candidate
that passes. That is how the shipped table was made. Without CUDA and without ``--untimed-defaults``
the command ends with a one-line message (exit 3).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scalefold.config.environment import scoped_env

DEFAULT_MAX_SECONDS = 300.0
TUNE_DTYPES = ("bf16", "tf32", "fp32")
UNTIMED_DTYPES = ("bf16", "tf32", "fp32")
#: rounds of "replace a failing default by the next candidate" for --untimed-defaults
MAX_DEFAULT_ROUNDS = 6


def _say(message: str) -> None:
    print(f"tune-kernels: {message}", file=sys.stderr, flush=True)


def require_gpu() -> None:
    """A one-line error unless a CUDA GPU and Triton's compiler can run here."""
    import torch

    from scalefold.errors import UserError

    if not torch.cuda.is_available():
        raise UserError(
            "no CUDA GPU here: the command times the kernels on the GPU it runs on "
            "(--untimed-defaults writes the default configs without one)"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("Triton is not installed: the kernels to tune are Triton's (pip install triton)") from None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise UserError("TRITON_INTERPRET is set: unset it so that the kernels run compiled on the GPU")


def base_table(out: Path):
    """What the output merges into: ``out`` when it exists (it must be a table), else the table in use."""
    from scalefold.errors import UserError
    from scalefold.kernels import launch_table

    if out.exists():
        try:
            return launch_table.read(out)
        except launch_table.TableError as exc:
            raise UserError(f"--out {out}: exists and is not a launch-config table ({exc}); move it away") from None
    try:
        return launch_table.read(launch_table.table_path())
    except FileNotFoundError:
        return launch_table.Table()
    except (OSError, launch_table.TableError) as exc:
        _say(f"the table in use ({launch_table.table_path()}) is unreadable ({exc}); starting an empty one")
        return launch_table.Table()


def _today() -> str:
    return datetime.date.today().isoformat()


# ----------------------------------------------------------------------------------------------
# Timing on the GPU
# ----------------------------------------------------------------------------------------------


@dataclass
class TuneState:
    """Progress of a tuning run: the deadline, the keys planned and the results per key."""

    deadline: float
    capability: int
    planned: dict  # (tuner, dtype label, shape class) -> default config
    results: dict = field(default_factory=dict)  # key -> {"config", "ms", "default_ms", "timed", ...}
    spills: int = 0  # the largest n_spills of the launches since the last reset
    started: float = field(default_factory=time.perf_counter)

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline


class _SpillWatch:
    """Stands in for a ``@triton.jit`` kernel: launches it and notes the compiled kernel's spills."""

    def __init__(self, fn, state: TuneState) -> None:
        self.fn, self.state = fn, state

    def __getitem__(self, grid):
        launcher = self.fn[grid]

        def launch(*args, **kwargs):
            kernel = launcher(*args, **kwargs)
            self.state.spills = max(self.state.spills, int(getattr(kernel, "n_spills", 0) or 0))
            return kernel

        return launch


class TimingTuner:
    """Stands in for ``autotune.Tuner`` while tuning: times the candidates of each new key (within
    the deadline), keeps the fastest that neither fails nor spills, launches it."""

    def __init__(self, tuner, state: TuneState, bench_fn=None) -> None:
        self.tuner, self.state = tuner, state
        self.bench_fn = bench_fn

    def _time(self, run, cfg) -> float:
        if self.bench_fn is not None:
            return self.bench_fn(functools.partial(run, cfg))
        import triton.testing

        from scalefold.kernels import autotune

        return triton.testing.do_bench(functools.partial(run, cfg), warmup=autotune.BENCH_WARMUP_MS,
                                       rep=autotune.BENCH_REP_MS)  # fmt: skip

    def run(self, key, launch, bench=None) -> dict:
        from scalefold.errors import exception_summary

        table_key = (self.tuner.name, key.dtype, key.shape)
        done = self.state.results.get(table_key)
        # keys of other dtypes (the fp32 LayerNorms inside the attention modules in a tf32 pass) are
        # not tuned unless asked for
        if done is not None or table_key not in self.state.planned or self.state.out_of_time():
            config = done["config"] if done else self.tuner.default(self.state.capability)
            launch(config)
            return config
        t0 = time.perf_counter()
        candidates = self.tuner.candidates(self.state.capability)
        timings, rejected = [], []
        for cfg in candidates:
            if timings and self.state.out_of_time():
                break
            self.state.spills = 0
            try:
                ms = self._time(bench or launch, cfg)
            except Exception as exc:  # out of shared memory, registers ...: not a candidate here
                rejected.append(f"{cfg}: {exception_summary(exc)}")
                continue
            if self.state.spills:
                rejected.append(f"{cfg}: spills {self.state.spills} B")
                continue
            timings.append((ms, cfg))
        default = candidates[0]
        best_ms, best = min(timings, key=lambda t: t[0]) if timings else (math.nan, default)
        default_ms = next((ms for ms, cfg in timings if cfg == default), math.nan)
        self.state.results[table_key] = dict(
            config=dict(best), ms=round(best_ms, 4), default_ms=round(default_ms, 4), timed=len(timings),
            candidates=len(candidates), rejected=rejected, seconds=round(time.perf_counter() - t0, 1),
        )  # fmt: skip
        _report_key(self.state, table_key)
        launch(best)
        return best


def _report_key(state: TuneState, key: tuple) -> None:
    r = state.results[key]
    gain = r["default_ms"] / r["ms"] if r["ms"] and not math.isnan(r["default_ms"]) else math.nan
    cut = (
        f" (cut short: {r['timed']} of {r['candidates']} timed)"
        if r["timed"] + len(r["rejected"]) < r["candidates"]
        else ""
    )
    rejected = f", {len(r['rejected'])} rejected" if r["rejected"] else ""
    _say(
        f"[{len(state.results)}/{len(state.planned)}] {' '.join(key)}: {r['config']} {r['ms']:.3f} ms, default "
        f"{r['default_ms']:.3f} ms ({gain:.2f}x); {r['timed']} configs timed in {r['seconds']:.1f} s{rejected}{cut} "
        f"[{time.perf_counter() - state.started:.0f} s]"
    )


@contextlib.contextmanager
def timing(state: TuneState, bench_fn=None, get_tuner=None) -> Iterator[None]:
    """The kernels' tuners replaced by :class:`TimingTuner` (wrapping ``get_tuner``'s, default
    :func:`scalefold.kernels.autotune.get_tuner`), their ``@triton.jit`` kernels watched for spills,
    ``SCALEFOLD_KERNELS=triton``. ``bench_fn(fn) -> ms`` replaces ``do_bench`` (tests)."""
    from scalefold.kernels import autotune
    from scalefold.kerneltools import sites as call_sites

    call_sites.kernel_modules() if get_tuner is None else None  # compiled kernels (tests: recorders stand in)
    mods = {name: importlib.import_module(f"scalefold.kernels.{name}") for name in call_sites.KERNEL_NAMES}
    real_get_tuner = get_tuner or autotune.get_tuner

    def timing_tuner(name, configs, interpreter_config):
        return TimingTuner(real_get_tuner(name, configs, interpreter_config), state, bench_fn)

    with contextlib.ExitStack() as stack:
        stack.enter_context(call_sites.patched(autotune, "get_tuner", timing_tuner))
        for module, names in call_sites.KERNEL_NAMES.items():
            for attr in names:
                fn = getattr(mods[module], attr)
                stack.enter_context(call_sites.patched(mods[module], attr, _SpillWatch(fn, state)))
        stack.enter_context(scoped_env("SCALEFOLD_KERNELS", "triton"))
        yield


def plan(capability: int, dtypes: Sequence[str], sites: Sequence[str] | None = None) -> dict:
    """``{(tuner, dtype label, shape class): default config}``: the keys the MLPerf call sites (all,
    or ``sites``) launch in ``dtypes`` on a GPU of ``capability``, captured on the meta device."""
    from scalefold.kernels import launch_table
    from scalefold.kerneltools import sites as call_sites

    ctx = call_sites.CaptureContext()
    call_sites.collect(dtypes, call_sites.KERNELS, capability, sites, table=launch_table.Table(), ctx=ctx)
    return {k: config for k, (config, _) in ctx.visited.items() if k[1] in dtypes}


def run_sites(state: TuneState, dtypes: Sequence[str], sites: Sequence[str] | None, device: str = "cuda") -> int:
    """Run the MLPerf call sites (forward + backward) under :func:`timing`; returns how many were
    skipped for want of time."""
    import torch

    from scalefold.kerneltools import sites as call_sites

    all_sites = call_sites.all_sites()
    chosen = {name: go for name, go in all_sites.items() if not sites or name in sites}
    with_dots = call_sites.dot_sites()
    skipped = 0
    for dtype in dtypes:
        for name, go in chosen.items():
            if dtype == "tf32" and name not in with_dots:
                continue  # no matmul: the fp32 kernels
            if state.out_of_time():
                skipped += 1
                continue
            with call_sites.patched(torch.backends.cuda.matmul, "allow_tf32", dtype == "tf32"):
                go(call_sites.DTYPES[dtype], device=device)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    return skipped


def tune(base, dtypes: Sequence[str], sites: Sequence[str] | None, max_seconds: float):
    """Time the candidates on this GPU; ``base`` merged with the results (see the module doc)."""
    import torch

    from scalefold.kernels import autotune, launch_table

    started = time.perf_counter()
    major, minor = torch.cuda.get_device_capability()
    capability = major * 10 + minor
    arch, device = launch_table.arch_name(capability), torch.cuda.get_device_name()
    planned = plan(capability, dtypes, sites)
    state = TuneState(started + max_seconds, capability, planned, started=started)
    configs = sum(len(autotune._tuners[name].candidates(capability)) for name, _, _ in planned)
    _say(f"{device} ({arch}): {len(planned)} keys ({', '.join(dtypes)}) at the MLPerf call sites, {configs} configs "
         f"to compile and time, budget {max_seconds:.0f} s; one line per key")  # fmt: skip
    with timing(state):
        skipped = run_sites(state, dtypes, sites)
    if skipped:
        _say(f"--max-seconds {max_seconds:.0f} reached: {skipped} site runs skipped")
    return merge_results(base, arch, device, state, dtypes)


def merge_results(base, arch: str, device: str, state: TuneState, dtypes: Sequence[str]):
    """``base`` with ``arch``'s entries for the planned keys set: the timed config, else the earlier
    entry, else the default; metadata and timings say which is which."""
    import torch
    import triton

    from scalefold.kernels import launch_table

    table = launch_table.Table(base.archs)
    meta = dict(table.archs.get(arch, {}))
    earlier = launch_table.Table({arch: meta})
    timings = dict(meta.get("timings", {}))
    for key, default in sorted(state.planned.items()):
        result = state.results.get(key)
        old = earlier.entry(arch, *key)
        config = result["config"] if result else (old if old is not None else default)
        table.set_entry(arch, *key, config)
        if result:  # NaN (the default config not timed) as null: strict JSON
            timings[" ".join(key)] = {k: None if result[k] != result[k] else result[k]
                                      for k in ("ms", "default_ms", "timed", "candidates")}  # fmt: skip
    untimed = [" ".join(k) for k in sorted(state.planned) if k not in state.results]
    gains = [
        r["default_ms"] / r["ms"] for r in state.results.values() if r["ms"] and r["default_ms"] == r["default_ms"]
    ]
    arch_meta = table.archs[arch]
    arch_meta.update(
        source=f"tuned on {device}, {_today()}" if state.results else meta.get("source", launch_table.UNTIMED),
        device=device, triton=triton.__version__, torch=torch.__version__, timings=timings,
        note=f"{len(state.results)} of {len(state.planned)} {'/'.join(dtypes)} keys timed by scalefold tune-kernels"
        + (f"; not timed (earlier entry or default config): {', '.join(untimed)}" if untimed else "")
        + (f"; speed-up of the tuned over the default configs: geometric mean {math.exp(sum(map(math.log, gains)) / len(gains)):.3f}x"
           if gains else ""),
    )  # fmt: skip
    _say(arch_meta["note"])
    return table


# ----------------------------------------------------------------------------------------------
# Untimed defaults, checked ahead of time (no GPU)
# ----------------------------------------------------------------------------------------------


def untimed_defaults(base, archs: Sequence[str] | None, dtypes: Sequence[str], jobs: int = 1):
    """``base`` with the named architectures' entries (default: every AOT target without tuned
    entries) set to each kernel's default config at every MLPerf key in ``dtypes``, compiled ahead of
    time; a config that fails or spills is replaced by the next candidate that passes."""
    import triton

    from scalefold.errors import UserError
    from scalefold.kernels import launch_table
    from scalefold.kerneltools import compile_report
    from scalefold.kerneltools import sites as call_sites

    if not archs:
        archs = [a for a in call_sites.ARCHS if not base.archs.get(a, {}).get("source", "").startswith("tuned on")]
        kept = sorted(set(call_sites.ARCHS) - set(archs))
        if kept:
            _say(f"{', '.join(kept)} keep their tuned entries (name them with --arch to replace them)")
    table = launch_table.Table({a: m for a, m in base.archs.items() if a not in archs})
    for arch, keys in call_sites.table_keys(archs, dtypes).items():
        table.archs[arch] = {
            "source": launch_table.UNTIMED,
            "note": "each kernel's default config (the first of its candidates that compiles for this architecture "
            "without spills), not timed: scalefold aot-check --table checks them",
            "triton": triton.__version__,
        }
        for key, (config, _) in sorted(keys.items()):
            table.set_entry(arch, *key, config)
    with tempfile.TemporaryDirectory(prefix="scalefold-aot-") as cache, scoped_env("TRITON_CACHE_DIR", cache):
        for round_ in range(MAX_DEFAULT_ROUNDS):
            records, problems = compile_report.check_table(table, archs, dtypes, jobs=jobs, progress=False)
            _say(f"ahead-of-time check, round {round_ + 1}: {len(records)} compiles, {len(problems)} problem(s)")
            failing = {(r.arch, tuple(k)) for r in records if compile_report.problems([r]) for k in r.keys}
            if not problems:
                return table
            if not failing or not _next_candidates(table, failing):
                raise UserError("no passing config for: " + "; ".join(problems[:3]))
    raise UserError(f"the ahead-of-time check still fails after {MAX_DEFAULT_ROUNDS} rounds")


def _next_candidates(table, failing: set) -> bool:
    """Move each failing entry to the candidate after it; False when one has none left."""
    from scalefold.kernels import autotune
    from scalefold.kerneltools import sites as call_sites

    for arch, (kernel, dtype, shape) in sorted(failing):
        candidates = autotune._tuners[kernel].candidates(call_sites.ARCHS[arch][0])
        current = table.entry(arch, kernel, dtype, shape)
        index = next((i for i, c in enumerate(candidates) if c == current), -1) + 1
        if index >= len(candidates):
            return False
        _say(f"{arch} {kernel} {dtype} {shape}: {current} fails the check; trying {candidates[index]}")
        table.set_entry(arch, kernel, dtype, shape, candidates[index])
    return True


__all__ = ["TimingTuner", "TuneState", "merge_results", "plan", "run_sites", "timing", "tune",
           "untimed_defaults"]  # fmt: skip
