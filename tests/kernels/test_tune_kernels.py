"""``scalefold tune-kernels``: its input errors and the no-CUDA message; the timing tuner's choice
(fastest of the candidates that neither fail nor spill, within the deadline) and the merged table,
with a simulated benchmark. The timing on a real GPU is the GPU session's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scalefold import cli
from scalefold.kernels import autotune, launch_table
from scalefold.kerneltools import tune

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = [{"B": 64, "num_warps": 4}, {"B": 128, "num_warps": 8}, {"B": 256, "num_warps": 8}]
KEY = autotune.Key("N=256", "bf16")


def _main(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["tune-kernels", *argv])
    return code, capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without CUDA")
def test_without_cuda_a_one_line_message(tmp_path, capsys):
    """No GPU: exit 3, one line saying why and what works without one; no traceback, no file."""
    out = tmp_path / "table.json"
    code, err = _main(capsys, "--out", str(out))
    assert code == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--untimed-defaults" in lines[0]
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--max-seconds", "0"], "--max-seconds 0"),
        (["--arch", "sm_90"], "--arch applies to --untimed-defaults"),
        (["--jobs", "0", "--untimed-defaults"], "--jobs 0"),
        (["--site", "msa_row", "--untimed-defaults"], "--site applies to timing on a GPU"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, argv, expected):
    code, err = _main(capsys, "--out", str(tmp_path / "t.json"), *argv)
    assert code == 3 and expected in err and "Traceback" not in err


def test_an_existing_out_that_is_not_a_table_is_kept(tmp_path, capsys):
    """--out names a file that is not a table: refused (it would be merged into), left as it was."""
    out = tmp_path / "notes.json"
    out.write_text('{"my": "notes"}')
    code, err = _main(capsys, "--out", str(out), "--untimed-defaults")
    assert code == 3 and "--out" in err and "not a launch-config table" in err
    assert out.read_text() == '{"my": "notes"}'
    code, err = _main(capsys, "--out", str(tmp_path))
    assert code == 3 and "Traceback" not in err


class _Bench:
    """A simulated ``do_bench``: runs the launch once, returns the config's time; configs in
    ``spilling`` report spills through the state as the watched kernels would."""

    def __init__(self, state, ms: dict, spilling=(), failing=(), stop_after: int | None = None) -> None:
        self.state, self.ms, self.spilling, self.failing, self.stop_after = state, ms, spilling, failing, stop_after
        self.timed: list[int] = []

    def __call__(self, fn) -> float:
        cfg = fn.args[0]
        self.timed.append(cfg["B"])
        if cfg["B"] in self.failing:
            raise RuntimeError("out of resource: shared memory")
        fn()
        if cfg["B"] in self.spilling:
            self.state.spills = 24
        if self.stop_after is not None and len(self.timed) >= self.stop_after:
            self.state.deadline = 0.0  # the budget runs out
        return self.ms[cfg["B"]]


def _state(planned=None, deadline=math.inf) -> tune.TuneState:
    return tune.TuneState(deadline, 90, planned or {("t", KEY.dtype, KEY.shape): CANDIDATES[0]})


def test_timing_tuner_keeps_the_fastest_that_neither_fails_nor_spills(capsys):
    state = _state()
    bench = _Bench(state, {64: 3.0, 128: 1.0, 256: 2.0}, spilling={128})
    tuner = tune.TimingTuner(autotune.Tuner("t", CANDIDATES, {"B": 1}), state, bench)
    launched = []
    assert tuner.run(KEY, launched.append) == CANDIDATES[2]
    assert bench.timed == [64, 128, 256] and launched[-1] == CANDIDATES[2]
    result = state.results[("t", "bf16", "N=256")]
    assert result["ms"] == 2.0 and result["default_ms"] == 3.0 and result["timed"] == 2
    assert len(result["rejected"]) == 1 and "spills 24 B" in result["rejected"][0]
    assert tuner.run(KEY, launched.append) == CANDIDATES[2] and bench.timed == [64, 128, 256]  # not timed again
    line = capsys.readouterr().err.strip()
    assert line.startswith("tune-kernels: [1/1] t bf16 N=256: ") and "(1.50x)" in line and "1 rejected" in line


def test_timing_tuner_within_the_deadline():
    """Past the deadline nothing more is timed: a key cut short keeps the fastest timed (the default
    is timed first); a key not reached launches the default untimed."""
    state = _state()
    bench = _Bench(state, {64: 3.0, 128: 1.0, 256: 2.0}, failing={64}, stop_after=2)
    tuner = tune.TimingTuner(autotune.Tuner("t", CANDIDATES, {"B": 1}), state, bench)
    assert tuner.run(KEY, lambda cfg: None) == CANDIDATES[1]
    assert bench.timed == [64, 128] and math.isnan(state.results[("t", "bf16", "N=256")]["default_ms"])
    other = autotune.Key("N=512", "bf16")
    launched = []
    assert tuner.run(other, launched.append) == CANDIDATES[0] and launched == [CANDIDATES[0]]
    assert bench.timed == [64, 128] and ("t", "bf16", "N=512") not in state.results


def test_results_merge_into_the_table(capsys):
    """This architecture: timed keys get their config, the others keep an earlier entry or get the
    default; other architectures are kept; the metadata says tuned on which GPU, when, and what was
    timed."""
    base = launch_table.Table({"sm_80": {"source": launch_table.UNTIMED}})
    base.set_entry("sm_80", "t", "bf16", "N=256", CANDIDATES[0])
    base.archs["sm_90"] = {"source": launch_table.UNTIMED}
    base.set_entry("sm_90", "t", "bf16", "N=512", CANDIDATES[2])
    keys = [("t", "bf16", s) for s in ("N=256", "N=512", "N=1024")]
    state = _state({k: CANDIDATES[0] for k in keys})
    state.results[keys[0]] = dict(config=CANDIDATES[1], ms=1.0, default_ms=1.5, timed=3, candidates=3, rejected=[],
                                  seconds=1.0)  # fmt: skip
    table = tune.merge_results(base, "sm_90", "Test GPU", state, ["bf16"])
    assert table.archs["sm_80"] == base.archs["sm_80"]
    assert [table.entry("sm_90", *k) for k in keys] == [CANDIDATES[1], CANDIDATES[2], CANDIDATES[0]]
    meta = table.archs["sm_90"]
    assert meta["source"].startswith("tuned on Test GPU, 20")
    assert meta["timings"] == {"t bf16 N=256": {"ms": 1.0, "default_ms": 1.5, "timed": 3, "candidates": 3}}
    assert "1 of 3 bf16 keys timed" in meta["note"] and "t bf16 N=1024" in meta["note"] and "1.500x" in meta["note"]
    assert base.entry("sm_90", "t", "bf16", "N=256") is None  # the base is not modified


def test_untimed_defaults_move_a_failing_entry_to_the_next_candidate(monkeypatch):
    """--untimed-defaults: an entry that fails the ahead-of-time check moves to the next candidate;
    past the last one there is none left."""
    monkeypatch.setattr(autotune, "_tuners", {"t": autotune.Tuner("t", {80: CANDIDATES[:2], 90: CANDIDATES}, {})})
    table = launch_table.Table()
    table.set_entry("sm_80", "t", "bf16", "N=256", CANDIDATES[0])
    failing = {("sm_80", ("t", "bf16", "N=256"))}
    assert tune._next_candidates(table, failing)
    assert table.entry("sm_80", "t", "bf16", "N=256") == CANDIDATES[1]
    assert not tune._next_candidates(table, failing)


def test_results_hold_no_nan(capsys):
    """A key whose default config was not timed (it failed) records null, not NaN (strict JSON)."""
    key = ("t", "bf16", "N=256")
    state = _state({key: CANDIDATES[0]})
    state.results[key] = dict(config=CANDIDATES[1], ms=1.0, default_ms=math.nan, timed=2, candidates=3,
                              rejected=["x"], seconds=1.0)  # fmt: skip
    table = tune.merge_results(launch_table.Table(), "sm_90", "Test GPU", state, ["bf16"])
    assert table.archs["sm_90"]["timings"]["t bf16 N=256"]["default_ms"] is None
    json.loads(launch_table.dumps(table), parse_constant=lambda c: pytest.fail(f"{c} in the table"))


# Run in a process of its own (the kernels must be defined compiled, not interpreted, as the command
# does): the MLPerf sites on the meta device with the kernels recorded instead of launched (aot's
# capture), timed by a simulated benchmark -- every key the plan lists is timed, once.
_WIRING = """
import json, math, sys
from scalefold.kernels import autotune, launch_table
from scalefold.kerneltools import sites as aot, tune
aot.kernel_modules()
dtypes, sites = sys.argv[1].split(","), sys.argv[2:]
real_get_tuner = autotune.get_tuner
planned = tune.plan(90, dtypes, sites)
state = tune.TuneState(math.inf, 90, planned)
calls = []
def bench(fn):
    calls.append(1)
    fn()
    return 1.0 + 0.1 * sum(v for k, v in fn.args[0].items() if k.startswith("BLOCK"))
with aot.capturing(aot.CaptureContext(), 90, launch_table.Table()), tune.timing(state, bench, real_get_tuner):
    skipped = tune.run_sites(state, dtypes, sites, device="meta")
table = tune.merge_results(launch_table.Table(), "sm_90", "Test GPU", state, dtypes)
candidates = sum(len(autotune._tuners[name].candidates(90)) for name, _, _ in planned)
print(json.dumps(dict(planned=sorted(map(list, planned)), timed=sorted(map(list, state.results)), skipped=skipped,
                      calls=len(calls), candidates=candidates, entries=[list(e[1:4]) for e in table.entries("sm_90")])))
"""


def _wiring(dtypes: list[str], sites: list[str]) -> set:
    """Run :data:`_WIRING` at ``sites`` in ``dtypes``; check every planned key was timed once and is
    the table's; return the planned keys."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SCALEFOLD_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    argv = [sys.executable, "-c", _WIRING, ",".join(dtypes), *sites]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    planned = {tuple(k) for k in out["planned"]}
    assert {tuple(k) for k in out["timed"]} == planned and out["skipped"] == 0
    assert {tuple(e) for e in out["entries"]} == planned
    assert out["calls"] == out["candidates"]  # every candidate of every key timed, no key twice
    assert proc.stderr.count("tune-kernels: [") == len(planned)
    return planned


def test_every_planned_key_is_timed_once_at_the_sites():
    """tune-kernels' wiring without a GPU: the keys its plan lists (captured like the AOT check) are the
    keys the sites' launches time, each once, through the real launchers and tuners; the table written
    holds exactly them."""
    pytest.importorskip("triton")
    planned = _wiring(["bf16", "tf32"], ["msa_row", "template_pointwise", "layer_norm_pair", "adam_swa_first"])
    assert {k[0] for k in planned} == {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq", "layer_norm_fwd",
                                       "layer_norm_bwd", "adam_swa"}  # fmt: skip
    assert {k[1] for k in planned} == {"bf16", "tf32"}


def test_trimul_keys_are_planned_and_timed_in_every_precision():
    """The fused triangle multiplication's sites in tune-kernels: its four tuners at both MLPerf pair
    shapes, in bf16 and under TF32 (its dots: a tf32 pass runs its sites) with the tensor-core configs,
    in exact fp32 with the ``_exact`` twins -- each key timed once."""
    pytest.importorskip("triton")
    planned = _wiring(["bf16", "tf32", "fp32"], ["trimul_pair", "trimul_template_pair"])
    names = ("trimul_in_fwd", "trimul_out_fwd", "trimul_out_bwd", "trimul_gates_bwd")
    shapes = {"CZ=128,C=128,M=65536", "CZ=64,C=64,M=262144"}
    expected = {(n, d, s) for n in names for d in ("bf16", "tf32") for s in shapes}
    expected |= {(f"{n}_exact", "fp32", s) for n in names for s in shapes}
    assert planned == expected
