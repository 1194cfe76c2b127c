"""The launch-config table: lookup per architecture, dtype and shape class; the fallbacks to the
default configs (an entry that does not fit, a missing or corrupt table) with one line each; timing
only with SCALEFOLD_AUTOTUNE=1; the shipped table's format and entries.

The GPU is simulated (``torch.cuda.is_available`` and the compute capability patched): only the
selection is under test, nothing is launched on a device. That every entry of the shipped table is
the one the MLPerf call sites look up, and compiles without spills, is test_aot.py's.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from scalefold.kernels import autotune, launch_table

A100 = [{"BLOCK": 32, "num_warps": 4}, {"BLOCK": 64, "num_warps": 4}]
H100 = [{"BLOCK": 64, "num_warps": 4}, {"BLOCK": 128, "num_warps": 8}]
KEY = autotune.Key("N=256,bias=1", "bf16")


@pytest.fixture
def gpu(monkeypatch):
    """A simulated GPU of compute capability ``gpu["capability"]`` (90 unless changed)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(autotune.ENABLE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    state = {"capability": 90}
    monkeypatch.setattr(autotune, "_capability", lambda: state["capability"])
    autotune.reset_launch_table()
    yield state
    autotune.reset_launch_table()


def _use_table(tmp_path, monkeypatch, entries: dict, name: str = "table.json"):
    """Write a table of ``{arch: {(kernel, dtype, shape): config}}`` and make it the one in use."""
    table = launch_table.Table()
    for arch, by_key in entries.items():
        table.archs[arch] = {"source": launch_table.UNTIMED}
        for key, config in by_key.items():
            table.set_entry(arch, *key, config)
    path = tmp_path / name
    launch_table.write(table, path)
    monkeypatch.setenv(launch_table.PATH_ENV, str(path))
    autotune.reset_launch_table()
    return path


def _never(cfg):
    raise AssertionError(f"timed {cfg} without SCALEFOLD_AUTOTUNE=1")


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_lookup_by_architecture_dtype_and_shape_class(gpu, tmp_path, monkeypatch, capsys):
    """sm_90 and sm_80 each get their own entry; another shape class or dtype gets the device's
    default config; an architecture the table lacks gets the defaults, said once; nothing is timed."""
    _use_table(tmp_path, monkeypatch, {
        "sm_90": {("t", "bf16", KEY.shape): H100[1]},
        "sm_80": {("t", "bf16", KEY.shape): A100[1]},
    })  # fmt: skip
    tuner = autotune.Tuner("t", {80: A100, 90: H100}, {"BLOCK": 1})
    assert tuner.pick(KEY, _never) == H100[1]
    assert tuner.pick(autotune.Key("N=512,bias=1", "bf16"), _never) == H100[0]
    assert tuner.pick(autotune.Key(KEY.shape, "fp32"), _never) == H100[0]
    assert autotune.Tuner("other", H100, {"BLOCK": 1}).pick(KEY, _never) == H100[0]
    gpu["capability"] = 80
    assert tuner.pick(KEY, _never) == A100[1]
    assert _lines(capsys) == []
    gpu["capability"] = 89  # an L40: no sm_89 entries; its candidates are sm_80's
    assert tuner.pick(KEY, _never) == A100[0]
    assert tuner.pick(autotune.Key("N=512,bias=1", "bf16"), _never) == A100[0]
    lines = _lines(capsys)
    assert len(lines) == 1 and "no entries for sm_89" in lines[0] and lines[0].startswith("launch configs: ")


@pytest.mark.parametrize(
    "entry, reason",
    [
        ({"BLOCK": 96, "num_warps": 4}, "BLOCK=96 is not a power of two"),
        ({"BLOCK": 64, "num_warps": 4, "SPLITS": 2}, "unknown SPLITS"),
        ({"BLOCK": 64}, "missing num_warps"),
        ({"BLOCK": "64", "num_warps": 4}, "is not a positive integer"),
        ({"BLOCK": 64, "num_warps": 64}, "num_warps=64 > 32"),
    ],
)
def test_entry_that_does_not_fit_the_kernel_falls_back_with_one_line(gpu, tmp_path, monkeypatch, capsys, entry, reason):
    """A malformed entry (wrong parameters, a block size that is not a power of two ...) gives the
    default config and one line naming the entry, the reason and the default -- once."""
    path = _use_table(tmp_path, monkeypatch, {"sm_90": {("t", "bf16", KEY.shape): entry}})
    tuner = autotune.Tuner("t", H100, {"BLOCK": 1})
    assert tuner.pick(KEY, _never) == H100[0]
    assert tuner.pick(KEY, _never) == H100[0]
    lines = _lines(capsys)
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and "sm_90 t bf16 N=256,bias=1" in lines[0] and reason in lines[0]
    assert str(H100[0]) in lines[0]


def test_entry_that_does_not_run_on_this_gpu_falls_back_to_the_default(gpu, tmp_path, monkeypatch, capsys):
    """An entry whose launch fails on this GPU (here: more shared memory than it has) is replaced by
    the default config for that key, with one line; later launches go straight to the default. A
    failure of a config that is not a table entry is not the table's: it propagates."""
    from triton.runtime.errors import OutOfResources

    _use_table(tmp_path, monkeypatch, {"sm_90": {("t", "bf16", KEY.shape): H100[1]}})
    tuner = autotune.Tuner("t", H100, {"BLOCK": 1})
    launched = []

    def launch(cfg):
        launched.append(cfg["BLOCK"])
        if cfg["BLOCK"] == 128:
            raise OutOfResources(300_000, 232_448, "shared memory")

    assert tuner.run(KEY, launch) == H100[0]
    assert tuner.run(KEY, launch) == H100[0]
    assert launched == [128, 64, 64]
    lines = _lines(capsys)
    assert len(lines) == 1, lines
    assert "does not run on Test GPU" in lines[0] and "shared memory" in lines[0] and str(H100[0]) in lines[0]

    def broken(cfg):
        raise ValueError("a bug in the launcher")

    with pytest.raises(ValueError, match="a bug in the launcher"):
        tuner.run(autotune.Key("N=512,bias=1", "bf16"), broken)  # the default: no fallback


def test_missing_table_falls_back_to_the_defaults_never_to_autotuning(gpu, tmp_path, monkeypatch, capsys):
    """No table file: every kernel launches its default config, said in one line; nothing timed."""
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", _never)
    missing = tmp_path / "gone.json"
    monkeypatch.setenv(launch_table.PATH_ENV, str(missing))
    tuner = autotune.Tuner("t", {80: A100, 90: H100}, {"BLOCK": 1})
    assert tuner.pick(KEY, _never) == H100[0]
    assert autotune.Tuner("u", A100, {"BLOCK": 1}).pick(KEY, _never) == A100[0]
    lines = _lines(capsys)
    assert len(lines) == 1 and str(missing) in lines[0] and "not found" in lines[0] and "default config" in lines[0]


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"format": "scalefold-launch-configs/1", "archs": {', "not JSON"),
        ('{"format": "something-else", "archs": {}}', "format 'something-else'"),
        ('["a", "list"]', "format 'list'"),
        ('{"format": "scalefold-launch-configs/1", "archs": {"sm_90": {"entries": {"t": [1]}}}}', "sm_90 t"),
    ],
)
def test_corrupt_table_falls_back_to_the_defaults(gpu, tmp_path, monkeypatch, capsys, text, reason):
    """A table that is not JSON, of another format, or of the wrong structure: the defaults, one line."""
    path = tmp_path / "bad.json"
    path.write_text(text)
    monkeypatch.setenv(launch_table.PATH_ENV, str(path))
    tuner = autotune.Tuner("t", H100, {"BLOCK": 1})
    assert tuner.pick(KEY, _never) == H100[0]
    assert tuner.pick(autotune.Key("N=512,bias=1", "bf16"), _never) == H100[0]
    lines = _lines(capsys)
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and "not a readable launch-config table" in lines[0] and reason in lines[0]


def test_autotuning_only_when_asked(gpu, tmp_path, monkeypatch):
    """By default the table's entry is launched untimed; SCALEFOLD_AUTOTUNE=1 times every candidate and
    launches the fastest, whatever the table says."""
    import triton.testing

    _use_table(tmp_path, monkeypatch, {"sm_90": {("t", "bf16", KEY.shape): H100[1]}})
    timed = []

    def do_bench(fn, **kw):
        fn()
        return {64: 1.0, 128: 2.0}[timed[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
    tuner = autotune.Tuner("t", H100, {"BLOCK": 1})
    assert tuner.pick(KEY, lambda cfg: timed.append(cfg["BLOCK"])) == H100[1] and timed == []
    monkeypatch.setenv(autotune.ENABLE_ENV, "1")
    assert tuner.pick(KEY, lambda cfg: timed.append(cfg["BLOCK"])) == H100[0]
    assert timed == [64, 128]
    monkeypatch.setenv(autotune.ENABLE_ENV, "0")
    assert tuner.pick(KEY, _never) == H100[1]


def test_table_round_trip_one_config_per_line(tmp_path):
    """write -> read gives the same table; each config sits on one line (readable diffs)."""
    table = launch_table.Table({"sm_90": {"source": "tuned on Test GPU, 2026-01-01"}})
    table.set_entry("sm_90", "t", "bf16", "N=256", {"BLOCK": 64, "num_warps": 4})
    table.set_entry("sm_80", "t", "tf32", "N=256", {"BLOCK": 32, "num_warps": 4})
    path = tmp_path / "t.json"
    launch_table.write(table, path)
    again = launch_table.read(path)
    assert again.archs == table.archs and again.archs["sm_80"]["source"] == launch_table.UNTIMED
    assert '"N=256": {"BLOCK": 64, "num_warps": 4}' in path.read_text()
    assert json.loads(path.read_text())["format"] == launch_table.FORMAT


def _candidate_lists() -> dict:
    """Tuner name -> candidate list per architecture, from the kernel modules."""
    from scalefold.kernels import adam_swa_triton, attention_triton, layer_norm_triton, opm_triton, trimul_triton

    lists = {"adam_swa": adam_swa_triton.ADAM_CONFIGS, "layer_norm_fwd": layer_norm_triton.LAYER_NORM_CONFIGS,
             "layer_norm_bwd": layer_norm_triton.LAYER_NORM_CONFIGS, **trimul_triton.TRIMUL_CONFIGS}  # fmt: skip
    lists.update({f"{name}_exact": configs for name, configs in trimul_triton.TRIMUL_EXACT_CONFIGS.items()})
    lists.update({**opm_triton.OPM_CONFIGS, **{f"{n}_exact": c for n, c in opm_triton.OPM_EXACT_CONFIGS.items()}})
    for name in attention_triton.ATTENTION_CONFIGS:
        lists[name] = attention_triton.ATTENTION_CONFIGS[name]
        lists[f"{name}_exact"] = attention_triton.ATTENTION_EXACT_CONFIGS[name]
    return lists


def test_shipped_table_holds_sm_90_and_sm_80_for_every_kernel():
    """The table in the package: sm_90 and sm_80, each saying where its entries come from ("untimed
    defaults" or "tuned on <GPU>, <date>"), entries for every kernel in bf16 (the MLPerf precision),
    each with the parameters of its kernel's configs."""
    pytest.importorskip("triton")
    table = launch_table.read(launch_table.SHIPPED)
    lists = _candidate_lists()
    assert {"sm_90", "sm_80"} <= set(table.archs)
    for arch in ("sm_90", "sm_80"):
        source = table.archs[arch]["source"]
        assert source == launch_table.UNTIMED or re.fullmatch(r"tuned on .+, \d{4}-\d{2}-\d{2}", source), source
        kernels = {kernel for _, kernel, dtype, _, _ in table.entries(arch) if dtype in ("bf16", "tf32")}
        assert kernels == {name for name in lists if not name.endswith("_exact")}, arch
        capability = int(arch[3:])
        for _, kernel, dtype, shape, config in table.entries(arch):
            default = autotune.Tuner(kernel, lists[kernel], {}).default(capability)
            assert launch_table.misfit(config, default) is None, f"{arch} {kernel} {dtype} {shape}: {config}"
