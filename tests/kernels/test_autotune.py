"""Autotune bookkeeping: keys, single config in interpreter mode, per-rank persistence."""

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

    assert tuner.pick("k", never) == {"B": 64}


def test_keys_and_size_classes():
    """Keys combine shape class, dtype and device; sizes bucket to the next power of two."""
    assert [autotune.size_class(n) for n in (1, 17, 32, 33)] == [1, 32, 32, 64]
    key = autotune.make_key((64, 32), torch.zeros(1, dtype=torch.bfloat16))
    assert "bfloat16" in key and "64" in key


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
