"""Ahead-of-time GPU compilation of the Triton kernels, on a machine without a GPU.

The interpreter tests beside this one cannot show that a kernel compiles for a real GPU (the
interpreter accepts ``tl.dot`` tiles under 16, any amount of shared memory, bf16 paths it never
really runs). Here Triton compiles to cubin for H100 (sm_90) and A100 (sm_80) through the
wheel's ``ptxas``: the default config of every program, at representative MLPerf call sites, in
bf16 and fp32. The full sweep (every site, candidate, dtype) is ``scalefold aot-check``.

The compile runs in a subprocess: this test session has already defined the kernels in
interpreter mode (conftest), and a compile needs real ``JITFunction`` objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scalefold import cli
from scalefold.errors import EXIT_USER_ERROR
from scalefold.kerneltools import compile_report as aot
from scalefold.kerneltools.sites import ARCHS

ROOT = Path(__file__).resolve().parents[2]

# Sites covering the kernel variants: pair bias shared over rows with gate and mask (dq through
# the fp32 buffer, dbias reduced in the kernel, D = 32), head size 8 -> 16-wide tiles with a
# stride-0 key head and no gate (global column attention), LayerNorm at a power-of-two width (the
# pair, 128) and at 384 (the single representation, masked to 512), both Adam+SWA variants, the fused
# triangle multiplication's four programs at the Evoformer pair (c_z 128, C 128: the larger tiles), the fused
# outer product mean's three at the Evoformer's MSA (128 rows, N 256, C 32, c_z 128).
# Every site: the command.
CI_SITES = ("msa_row", "extra_msa_col_global", "layer_norm_pair", "layer_norm_single", "adam_swa_average",
            "adam_swa_first", "trimul_pair", "opm_evoformer")  # fmt: skip
PROGRAMS = {
    "attention_fwd", "attention_bwd:preprocess", "attention_bwd:dkdv", "attention_bwd:dq_dbias",
    "layer_norm_fwd", "layer_norm_bwd:dx", "layer_norm_bwd:dwdb", "adam_swa",
    "trimul:in_fwd", "trimul:out_fwd", "trimul:out_bwd", "trimul:gates_bwd", "opm:fwd", "opm:dw", "opm:dx",
}  # fmt: skip


def _cuda_toolchain_or_skip() -> None:
    """Skip (with the reason) unless Triton's CUDA backend and its ptxas/cuobjdump can run here."""
    triton = pytest.importorskip("triton")
    problem = aot.triton_problem()
    if problem:
        pytest.skip(problem)
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip(f"triton {triton.__version__} has no CUDA backend (backends: {sorted(backends)})")
    for tool in ("ptxas", "cuobjdump"):
        path = Path(aot.tool_path(tool))
        if not path.exists():
            pytest.skip(f"{tool} not shipped with triton {triton.__version__} (looked for {path})")
        try:
            subprocess.run([str(path), "--version"], check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"{path} does not run on this machine: {exc}")


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory) -> str:
    """One Triton cache for this module's compiles: while the launch-config table holds the default
    configs, its check finds the defaults' compiles there (spills then read from the stack frame)."""
    return str(tmp_path_factory.mktemp("triton-cache"))


def _run_aot(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SCALEFOLD_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run(
        [sys.executable, "-m", "scalefold", "aot-check", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.slow
def test_default_configs_compile_for_h100_and_a100_without_spills(triton_cache):
    """Every program's default config compiles for sm_90 (bf16, tensor-core dots) and sm_80 (fp32,
    exact dots), fits the architecture's shared memory and does not spill registers. (~40
    compiles: a minute or two on the idle 2-core box.)"""
    _cuda_toolchain_or_skip()
    site_args = [a for site in CI_SITES for a in ("--site", site)]
    runs = [("sm_90", "bf16"), ("sm_80", "fp32")]
    records = []
    for arch, dtype in runs:
        proc = _run_aot("--json", "--default-only", "--no-progress", "--jobs", "2", "--arch", arch, "--dtype", dtype,
                        "--cache-dir", triton_cache, *site_args)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        records += [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {(r["arch"], r["dtype"]) for r in records} == set(runs)
    for arch, dtype in runs:
        programs = {r["kernel"] for r in records if (r["arch"], r["dtype"]) == (arch, dtype)}
        assert programs == PROGRAMS, f"{arch} {dtype}: programs compiled {sorted(programs)}"
    for r in records:
        where = f"{r['kernel']} {r['dtype']} {r['arch']} {r['config']} at {r['sites']}"
        assert r["default"], where
        assert r["ok"] and r["error"] is None, f"{where}: {r['error']}"
        assert 0 < r["registers"] <= 255, where
        assert r["shared_bytes"] <= ARCHS[r["arch"]][1], where
        assert r["spill_bytes"] == 0, f"{where}: spills {r['spill_bytes']} B"
    sites = {s for r in records for s in r["sites"]}
    assert sites == set(CI_SITES)


# The sample of the launch-config table compiled in CI: the MLPerf precision (bf16) on both
# architectures at CI_SITES, in one process (~25 compiles, most found in the cache the defaults' test
# filled). The whole table (every architecture, dtype and site: 234 compiles, 48 of them the trimul kernels; 186 before
# them took 4.5 min on the loaded 2-core box) is the command
#   scalefold aot-check --table --jobs 2
TABLE_SAMPLE = [("sm_90", "bf16"), ("sm_80", "bf16")]


@pytest.mark.slow
def test_launch_table_entries_compile_without_spills(triton_cache):
    """The shipped launch-config table (a sample: TABLE_SAMPLE at CI_SITES): every entry the sites
    launch compiles for its architecture, fits its shared memory and does not spill; and for each
    (architecture, dtype) of the sample the table holds an entry for every key the MLPerf call sites
    launch (at every site), and none that no site launches."""
    _cuda_toolchain_or_skip()
    site_args = [a for site in CI_SITES for a in ("--site", site)]
    arch_args = [a for arch in sorted({arch for arch, _ in TABLE_SAMPLE}) for a in ("--arch", arch)]
    dtype_args = [a for dtype in sorted({dtype for _, dtype in TABLE_SAMPLE}) for a in ("--dtype", dtype)]
    proc = _run_aot("--table", "--json", "--no-progress", "--jobs", "2", "--cache-dir", triton_cache,
                    *arch_args, *dtype_args, *site_args)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {(r["arch"], r["dtype"]) for r in records} == set(TABLE_SAMPLE)
    served = {k[0] for r in records for k in r["keys"]}  # the tuners whose table entries were compiled
    assert {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq", "layer_norm_fwd", "layer_norm_bwd",
            "adam_swa", "trimul_in_fwd", "trimul_out_fwd", "trimul_out_bwd", "trimul_gates_bwd", "opm_fwd", "opm_dw",
            "opm_dx"} == served  # fmt: skip
    for r in records:
        where = f"{r['kernel']} {r['dtype']} {r['arch']} {r['config']} at {r['sites']}"
        assert r["ok"] and r["error"] is None and r["spill_bytes"] == 0, where
        assert r["shared_bytes"] <= ARCHS[r["arch"]][1], where


@pytest.mark.slow
def test_launch_table_holds_every_mlperf_key(tmp_path):
    """Completeness without compiling (two runs of ~10 s): for every architecture and dtype of the shipped
    table (the trimul kernels' tf32 and exact fp32 keys among them) it holds an entry for every key the
    MLPerf sites launch; a table missing one, or holding one no site launches, or a malformed one, fails
    the check naming it."""
    _cuda_toolchain_or_skip()
    proc = _run_aot("--table", "--no-compile", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 compiles" in proc.stderr and "0 problem(s)" in proc.stderr
    from scalefold.kernels import launch_table

    table = launch_table.read(launch_table.SHIPPED)
    (_, kernel, dtype, shape, config), *_ = [e for e in table.entries("sm_90") if e[2] == "bf16"]
    del table.archs["sm_90"]["entries"][kernel][dtype][shape]
    table.set_entry("sm_90", kernel, dtype, "N=3", config)
    table.set_entry("sm_90", "layer_norm_fwd", "bf16", "C=128,M=65536", {"ROWS": 3, "num_warps": 4, "BWD_PROGRAMS": 8})
    path = tmp_path / "broken.json"
    launch_table.write(table, path)
    proc = _run_aot("--table", str(path), "--no-compile", "--no-progress", "--arch", "sm_90", "--dtype", "bf16")
    assert proc.returncode == 1
    assert f"sm_90 {kernel} bf16 {shape}: no entry" in proc.stderr
    assert f"sm_90 {kernel} bf16 N=3: stale entry" in proc.stderr
    assert "ROWS=3 is not a power of two" in proc.stderr


def test_unknown_site_is_a_short_error():
    """A mistyped --site ends in a one-line message naming it (exit 3), not a traceback."""
    _cuda_toolchain_or_skip()
    proc = _run_aot("--site", "msa_rows", "--no-progress")
    assert proc.returncode == EXIT_USER_ERROR
    assert "msa_rows" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("version", [(3, 2), (3, 4), None])
def test_too_old_or_missing_triton_is_a_short_error(version, monkeypatch, capsys):
    """With a Triton whose compiler internals differ (before 3.5) or none at all, the command says which
    Triton it needs (exit 2), instead of failing inside Triton; 3.5 and later pass the check."""
    from scalefold import kernels

    monkeypatch.setattr(kernels, "triton_version", lambda: version)
    assert cli.main(["aot-check", "--default-only", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "triton>=3.5" in err.replace(" ", "").lower() and "\n" not in err
    if version:
        assert f"found {version[0]}.{version[1]}" in err
    monkeypatch.setattr(kernels, "triton_version", lambda: (3, 5))
    assert aot.triton_problem() is None


def _record(**kw) -> aot.Record:
    base = dict(kernel="attention_fwd", dtype="bf16", arch="sm_90", config={"BLOCK_M": 64, "num_warps": 4},
                default=True, ok=True, error=None, registers=128, shared_bytes=1024, spill_bytes=0,
                shared_limit=ARCHS["sm_90"][1], candidates=[], sites=["msa_row"], compile_s=1.0)  # fmt: skip
    base.update(kw)
    return aot.Record(**base)


def test_problems_flag_failures_and_default_spills_only():
    """A failed or oversized compile is a problem; a spill only when the config is the default."""
    good = _record()
    failed = _record(ok=False, error="shared memory 300000 B > 232448 B (sm_90)")
    spilling_candidate = _record(default=False, spill_bytes=64)
    spilling_default = _record(spill_bytes=64)
    assert aot.problems([good, spilling_candidate]) == []
    found = aot.problems([good, failed, spilling_candidate, spilling_default])
    assert len(found) == 2 and "300000" in found[0] and "spills 64" in found[1]
    text = aot.table([good, failed])
    assert "attention_fwd" in text and "NO" in text and "msa_row" in text
    summary = aot.markdown([good, failed, spilling_candidate])
    assert "| attention_fwd | bf16 | sm_90 | 3 (2) | M64 w4 | 128 / 1.0 / 0 | 128 / 1.0 | 1 (64) |" in summary


def test_spill_report_parsing():
    """ptxas -v's spill line is read; no line (a cache hit) gives None."""
    log = "ptxas info    : Function properties for _attn_fwd\n    1216 bytes stack frame, 2028 bytes spill stores, 1972 bytes spill loads\n"
    assert aot.spill_stores(log) == 2028
    assert aot.spill_stores("") is None
