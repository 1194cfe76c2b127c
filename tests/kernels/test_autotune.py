"""Autotune bookkeeping: keys, single config in interpreter mode, per-rank persistence, timing only
with SCALEFOLD_AUTOTUNE=1 (the launch-config table's lookup and fallbacks: test_launch_table.py)."""

from __future__ import annotations

import json

import pytest
import torch

from scalefold.kernels import autotune


def test_interpreter_uses_single_config_without_benchmarking(monkeypatch):
    """Under TRITON_INTERPRET=1 (or without CUDA) the interpreter config is returned and nothing is timed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tuner = autotune.Tuner("t", [{"B": 1}, {"B": 2}], {"B": 64})

    def never(cfg):
        raise AssertionError("benchmarked in interpreter mode")

    assert tuner.pick(autotune.Key("N=1", "fp32"), never) == {"B": 64}


def test_keys_and_size_classes():
    """Keys combine a shape class (named fields, booleans as 0/1) and a dtype label (the tensor's, or
    one given, e.g. tf32); the autotuning cache adds the device name; sizes bucket to the next power
    of two."""
    assert [autotune.size_class(n) for n in (1, 17, 32, 33)] == [1, 32, 32, 64]
    key = autotune.make_key(dict(NQ=64, D=32, bias=True), torch.zeros(1, dtype=torch.bfloat16))
    assert key == autotune.Key("NQ=64,D=32,bias=1", "bf16")
    assert autotune.make_key("NQ=64", torch.zeros(1), "tf32") == autotune.Key("NQ=64", "tf32")
    assert key.cache_text("NVIDIA H100") == repr(("NQ=64,D=32,bias=1", "bf16", "NVIDIA H100"))


def test_results_persist_per_rank(tmp_path, monkeypatch):
    """Saved tables land in <dir>/rank<r>/<kernel>.json and are reloaded by a fresh tuner."""
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    tuner = autotune.Tuner("demo", [{"B": 1}], {"B": 1})
    tuner.table["key"] = {"B": 1}
    tuner.save()
    path = tmp_path / "rank3" / "demo.json"
    assert json.loads(path.read_text()) == {"key": {"B": 1}}
    fresh = autotune.Tuner("demo", [{"B": 1}], {"B": 1})
    fresh.load()
    assert fresh.table == {"key": {"B": 1}}


def test_per_rank_triton_cache_dir(tmp_path, monkeypatch):
    """TRITON_CACHE_DIR is pointed at a per-rank directory unless already set."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("RANK", "2")
    path = autotune.set_per_rank_triton_cache_dir(tmp_path)
    assert path == tmp_path / "rank2" and path.is_dir()


def test_benchmark_names_each_candidates_error_when_none_runs(monkeypatch):
    """When every candidate config fails to launch, the error lists each config with its exception (a
    bad launch such as an oversized grid must be visible, not reported as a too-small device); a
    config that runs wins over failing ones."""
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), float(kw.get("rep", 1)))[1])

    def launch(cfg):
        if cfg["B"] != 2:
            raise ValueError(f"grid too large for B={cfg['B']}")

    tuner = autotune.Tuner("t", [{"B": 1}, {"B": 2}, {"B": 3}], {"B": 64})
    assert tuner._benchmark(launch) == {"B": 2}
    tuner = autotune.Tuner("t", [{"B": 1}, {"B": 3}], {"B": 64})
    with pytest.raises(RuntimeError) as info:
        tuner._benchmark(lambda cfg: launch({"B": cfg["B"]}))
    message = str(info.value)
    assert "no launch config of t runs on this device" in message
    assert "{'B': 1}: ValueError: grid too large for B=1" in message and "B=3" in message


def test_per_architecture_candidates_and_default():
    """A per-capability table gives each device the list of the highest capability not above its
    own (the lowest list below all); the first candidate is the default."""
    a100, h100 = [{"B": 1}, {"B": 2}], [{"B": 3}, {"B": 4}]
    tuner = autotune.Tuner("t", {80: a100, 90: h100}, {"B": 64})
    assert tuner.candidates(90) == h100 and tuner.candidates(100) == h100
    assert tuner.candidates(86) == a100 and tuner.candidates(70) == a100 and tuner.candidates(None) == a100
    assert tuner.default(90) == {"B": 3} and tuner.default(80) == {"B": 1}
    flat = autotune.Tuner("t", a100, {"B": 64})
    assert flat.candidates(90) == a100 and flat.default() == {"B": 1}


@pytest.mark.parametrize("setting", [None, "0"])
def test_autotune_off_launches_the_default_without_timing(monkeypatch, tmp_path, setting):
    """Without SCALEFOLD_AUTOTUNE=1 on a GPU (unset: the default, or 0), a key the launch-config table
    lacks gets the device's default config, nothing benchmarked."""
    from scalefold.kernels import launch_table

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if setting is None:
        monkeypatch.delenv(autotune.ENABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(autotune.ENABLE_ENV, setting)
    monkeypatch.setenv(launch_table.PATH_ENV, str(tmp_path / "empty.json"))
    launch_table.write(launch_table.Table(), tmp_path / "empty.json")
    autotune.reset_launch_table()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(autotune, "_capability", lambda: 90)
    tuner = autotune.Tuner("t", {80: [{"B": 1}], 90: [{"B": 3}, {"B": 4}]}, {"B": 64})

    def never(cfg):
        raise AssertionError("benchmarked with autotuning off")

    assert tuner.pick(autotune.Key("N=1", "bf16"), never) == {"B": 3}


def test_each_tuning_is_reported_once_with_the_cache_and_the_switch(tmp_path, monkeypatch, capsys):
    """With SCALEFOLD_AUTOTUNE=1 a tuning (new kernel x key) prints one stderr line with its time and
    winner; the first also names the cache directory and that the table is used without the switch; a
    cached key prints nothing."""
    import triton.testing

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(autotune.ENABLE_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(autotune, "_capability", lambda: 90)
    monkeypatch.setattr(autotune, "_reported_first", False)
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    tuner = autotune.Tuner("t", [{"B": 1}, {"B": 2}], {"B": 64})
    k1, k2 = autotune.Key("N=1", "bf16"), autotune.Key("N=2", "bf16")
    assert tuner.pick(k1, lambda cfg: None) == {"B": 1}
    tuner.pick(k2, lambda cfg: None)
    tuner.pick(k1, lambda cfg: None)  # cached
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("autotune: t ('N=") for line in lines)
    assert "2 configs timed" in lines[0] and "-> {'B': 1}" in lines[0]
    assert str(tmp_path) in lines[0] and "SCALEFOLD_AUTOTUNE=1" in lines[0] and "SCALEFOLD_AUTOTUNE" not in lines[1]
