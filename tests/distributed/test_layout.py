"""The rank layout: world = DP x BP x DAP training ranks + evaluation ranks (no processes)."""

from __future__ import annotations

import pytest

from scalefold.distributed.layout import ParallelLayout


def test_rank_arithmetic_dap_groups_are_consecutive():
    layout = ParallelLayout(world_size=18, dap=4, bp=2, num_eval_ranks=2).validate(parallel_evoformer=True)
    assert (layout.num_train_ranks, layout.dp) == (16, 2)
    assert layout.dap_groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.bp_groups()[:2] == [[0, 4], [1, 5]]
    assert layout.dp_groups()[0] == [0, 8]
    assert layout.eval_ranks() == [16, 17]
    for r in range(16):
        assert layout.rank_of(*layout.coords(r)) == r
    assert layout.coords(13) == (1, 1, 1)
    with pytest.raises(ValueError, match="not a training rank"):
        layout.coords(16)
    assert "dp 2 x bp 2 x dap 4" in layout.describe() and "+ 2 eval" in layout.describe()


@pytest.mark.parametrize(
    "kwargs, validate, message",
    [
        ({"world_size": 6, "dap": 4}, {}, "not divisible by bp x dap = 1 x 4"),
        ({"world_size": 9, "dap": 2, "num_eval_ranks": 2}, {}, r"7 training ranks \(world 9 - 2 eval\)"),
        ({"world_size": 4, "dap": 2, "bp": 2}, {}, "--bp 2 needs --parallel-evoformer"),
        ({"world_size": 4, "bp": 3}, {"parallel_evoformer": True}, "--bp must be 1 or 2"),
        ({"world_size": 4, "dap": 0}, {}, "--dap must be >= 1"),
        ({"world_size": 4, "dap": 4}, {"crop_size": 30}, "--dap 4 does not divide the crop size 30"),
        ({"world_size": 2, "num_eval_ranks": 2}, {}, "leave no training rank"),
    ],
)
def test_invalid_layouts_are_rejected_with_a_clear_message(kwargs, validate, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs).validate(**validate)


def test_valid_layouts():
    ParallelLayout(world_size=8, dap=8).validate(crop_size=256)
    ParallelLayout(world_size=5, dap=2, bp=2, num_eval_ranks=1).validate(parallel_evoformer=True, crop_size=256)
    assert ParallelLayout(world_size=1).validate().dp == 1


def test_dap_groups_spanning_nodes_are_named_at_start_up():
    """Consecutive ranks form a DAP group: with 8 ranks per node DAP 8 (and 2, 4) stays inside a
    node; DAP 4 on 6-rank nodes puts group [4..7] across two nodes -> a start-up warning."""
    assert ParallelLayout(world_size=2080, dap=8, num_eval_ranks=32).validate().warnings(ranks_per_node=8) == []
    assert ParallelLayout(world_size=16, dap=2, bp=2).validate(parallel_evoformer=True).warnings(8) == []
    layout = ParallelLayout(world_size=12, dap=4).validate()
    assert layout.cross_node_dap_groups(6) == [[4, 5, 6, 7]]
    (warning,) = layout.warnings(ranks_per_node=6)
    assert "1 of 3 DAP groups span two nodes" in warning and "[4, 5, 6, 7]" in warning
    assert "WARNING: 1 of 3 DAP groups" in layout.describe(ranks_per_node=6)
    assert layout.warnings(None) == [] and "WARNING" not in layout.describe()  # unknown: no claim


def test_setup_reads_the_local_world_size(monkeypatch, capsys):
    """Without a process group (world 1) the layout is still validated; LOCAL_WORLD_SIZE is read."""
    from scalefold.distributed import setup_model_parallel

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ctx = setup_model_parallel(dap=1)
    assert ctx.ranks_per_node == 1 and "WARNING" not in ctx.describe()
    assert "WARNING" not in capsys.readouterr().err
