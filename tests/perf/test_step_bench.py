"""``scalefold bench step``: the JSON it prints and its input checks (no timing is asserted)."""

from __future__ import annotations

import json

from scalefold.cli import main


def test_bench_step_json_counts_breaks_and_recompiles(capsys):
    # the cheap "eager" dynamo backend: the same tracing and guards as inductor, no code generation
    rc = main(["bench", "step", "--preset", "tiny", "--compile", "--backend", "eager", "--strict", "--repeats", "1",
               "--warmup", "1", "--threads", "1", "--json"])  # fmt: skip
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
