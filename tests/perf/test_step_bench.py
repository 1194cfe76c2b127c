"""``scalefold bench step``: the JSON it prints and its input checks (no timing is asserted)."""

from __future__ import annotations

import json

from scalefold.cli import main


def test_bench_step_json_counts_breaks_and_recompiles(capsys):
    # the cheap "eager" dynamo backend: the same tracing and guards as inductor, no code generation
    rc = main(["bench", "step", "--preset", "tiny", "--compile", "--backend", "eager", "--strict", "--repeats", "1",
               "--warmup", "1", "--threads", "1", "--json", "--compile-cache", "off",
               "--regions", "evoformer_stack,extra_msa_stack,template_pair_stack,structure_module,loss"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("eager_s", "compiled_s", "graph_breaks", "recompiles", "speedup", "loadavg_before"):
        assert key in out
    assert out["eager_s"] > 0 and out["compiled_s"] > 0
    assert out["graph_breaks"] == 0 and out["recompiles"] == 0
    assert out["recycling_counts"] == [0, 1]
    assert set(out["eager"]["phases_s"]) == {"forward", "loss", "backward", "optimizer"}
    assert out["compiled"]["frames"] == {"evoformer_stack": 2, "extra_msa_stack": 2, "template_pair_stack": 2,
                                         "structure_module": 2, "loss": 1}  # loss: grad pass only


def test_bench_step_bad_input(capsys):
    assert main(["bench", "step", "--preset", "nope"]) == 3
    assert main(["bench", "step", "--preset", "tiny", "--repeats", "0"]) == 3
    assert "bench step" in capsys.readouterr().err
    assert main(["bench", "step", "--preset", "tiny", "--compile", "--regions", "evoformer_stak"]) == 3
    assert "evoformer_stak" in capsys.readouterr().err
    assert main(["bench", "step", "--preset", "tiny", "--compile", "--regions", "elementwise:nope"]) == 3
    assert "nope" in capsys.readouterr().err


def test_bench_step_elementwise_paired_per_region_and_cache(capsys, tmp_path):
    """The default region (the elementwise chains): the top-level figures, eager and compiled measured paired
    (one timed cycle each per repeat), each chain alone with its compile seconds and gain, the compile cache
    named and cold, then warm in a second run."""
    from scalefold.kernels import elementwise

    argv = ["bench", "step", "--preset", "tiny", "--compile", "--backend", "eager", "--repeats", "2", "--warmup", "1",
            "--threads", "1", "--json", "--compile-cache", str(tmp_path), "--per-region"]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        elementwise.disable()
    out = json.loads(capsys.readouterr().out)
    for key in ("compile_s", "eager_s", "compiled_s", "graph_breaks", "recompiles", "speedup", "speedup_range"):
        assert out[key] is not None, key
    assert out["regions"] == ["elementwise"] and out["graph_breaks"] == 0 and out["recompiles"] == 0
    assert len(out["eager"]["repeats_s"]) == len(out["compiled"]["repeats_s"]) == 2
    assert out["speedup_range"][0] <= out["speedup"] <= out["speedup_range"][1]
    assert set(out["per_region"]) == {f"elementwise:{c}" for c in elementwise.CHAINS}
    for row in out["per_region"].values():
        assert row["compile_s"] >= 0 and row["step_s"] > 0 and "gain_s" in row
    assert out["compile_cache"]["path"].startswith(str(tmp_path)) and out["compile_cache"]["warm"] is False
    (tmp_path / next(p.name for p in tmp_path.iterdir()) / "inductor" / "entry").write_text("x")  # as inductor would
    try:
        assert main(argv[:-1] + ["--compile-only"]) == 0
    finally:
        elementwise.disable()
    again = json.loads(capsys.readouterr().out)
    assert again["compile_cache"]["warm"] is True and again["compile_s"] is not None and again["compiled_s"] is None


def test_host_syncs_are_counted_at_cluster_layouts(capsys):
    """``--dap 2 --dp 2`` and ``--dap 2 --bp 2``: rank 0's step of the layout (the DAP/BP wrap, the flat
    gradient all-reduce, the agreement) reads nothing back inside the step -- the branches' generators are
    seeded outside it (issue 39); a layout the crop does not split is refused naming the flags."""
    from scalefold.config.training import TrainConfig
    from scalefold.perf.step_bench import step_host_syncs

    base = TrainConfig.from_preset("tiny", env={})
    for overrides, dp in (({"dap": 2}, 2), ({"dap": 2, "bp": 2, "parallel_evoformer": True}, 1)):
        out = step_host_syncs(TrainConfig.from_preset("tiny", env={}, overrides=overrides), dp=dp)
        assert out["host_syncs_per_step"] == 0 and "host_syncs_where" not in out, out
        assert out["host_syncs_layout"].startswith(f"DAP 2 x BP {overrides.get('bp', 1)} x DP {dp}")
    assert "host_syncs_layout" not in step_host_syncs(base)
    assert main(["bench", "step", "--preset", "tiny", "--dap", "5"]) == 3
    assert "--dap 5" in capsys.readouterr().err
