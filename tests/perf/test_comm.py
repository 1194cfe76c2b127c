"""The communication model (``scalefold.perf.comm``): DAP's per-rank bytes against the collectives the real code
issues (the fake step's DAP counter), against a hand count, BP's, the gradient all-reduce and their limits."""

from __future__ import annotations

import pytest

from scalefold.config.training import TrainConfig
from scalefold.perf import comm
from scalefold.perf.cluster import CARDS
from scalefold.perf.layout_model import checkpointed_blocks


def _cfg(preset: str, **overrides) -> TrainConfig:
    return TrainConfig.from_preset(preset, overrides=overrides, env={})


@pytest.mark.parametrize(
    "dap, precision, checkpointing",
    [(2, "bf16", "on"), (4, "fp32", "off"), (4, "bf16", "2")],  # DAP 4: the MSA's 10 rows padded to 12
)
def test_dap_collectives_equal_what_the_code_issues(dap, precision, checkpointing):
    """The model's bytes and calls per collective kind equal the DAP group's counter over one fake step of the
    tiny preset (one no-grad recycling pass, the grad pass, recomputation, backward), exactly."""
    cfg = _cfg("tiny", dap=dap, precision=precision, activation_checkpointing=checkpointing)
    dims = comm.ModelDims.from_config(cfg)
    observed = comm.observe_collectives(cfg)
    predicted = comm.totals(comm.dap_collectives(dims, dap, recycling=1, recompute=checkpointed_blocks(cfg, dims)), by=("kind",))
    assert predicted == observed
    assert set(observed) == {"all_to_all", "all_gather", "reduce_scatter"}


def _hand_dims() -> comm.ModelDims:
    block = comm.BlockDims(c_msa=4, c_pair=2, heads_msa=1, c_opm=3, c_tri_mul=5, heads_tri=1, blocks=1)
    return comm.ModelDims(n_res=8, n_seq=4, n_extra=6, n_templ=0, itemsize=2, parameters=1000,
                          stacks={"template_pair_stack": comm.BlockDims(0, 2, 0, 0, 5, 1, 0),
                                  "extra_msa_stack": comm.BlockDims(4, 2, 1, 3, 5, 1, 0), "evoformer_stack": block})  # fmt: skip


def test_one_evoformer_block_by_hand():
    """n_res 8, n_seq 4, c_m 4, c_z 2, 1 MSA head, OPM hidden 3, tri-mul hidden 5, 1 triangle head, bf16, DAP 2:
    a rank holds 4 pair rows and 2 MSA rows."""
    got = comm.block_collectives(_hand_dims(), "evoformer_stack", 2)
    assert [(k, b) for k, b, _ in got] == [
        ("all_gather", 4 * 8 * 1 * 2 * 1),  # row attention's pair bias [4, 8, 1] bf16, sent d-1 = 1 time: 64
        ("all_to_all", 2 * 8 * 4 * 2 // 2),  # m rows -> cols: local [2, 8, 4], half leaves: 64
        ("all_gather", 4 * 4 * 3 * 2),  # OPM right projection [4 rows, 4 cols, 3]: 96
        ("all_to_all", 4 * 4 * 4 * 2 // 2),  # m cols -> rows: local [4, 4, 4]: 64
        ("all_gather", 4 * 8 * 5 * 2), ("all_to_all", 4 * 8 * 2 * 2 // 2),  # tri-mul out b [4, 8, 5]: 320; z: 64
        ("all_gather", 4 * 8 * 5 * 2), ("all_to_all", 64),  # tri-mul in a
        ("all_gather", 4 * 8 * 1 * 2), ("all_to_all", 64),  # triangle attention, starting node: bias [4, 8, 1]
        ("all_gather", 4 * 8 * 1 * 2), ("all_to_all", 64),  # ending node
    ]  # fmt: skip
    # the whole step, no recycling, no recomputation: forward + exit gathers, backward + entry gradients
    step = comm.totals(comm.dap_collectives(_hand_dims(), 2, recycling=0), by=("kind",))
    exit_ = (2 * 8 * 4 + 4 * 8 * 2) * 2  # m [2, 8, 4] and z [4, 8, 2], bf16
    assert step["all_gather"] == {"bytes": 64 + 96 + 320 + 320 + 64 + 64 + exit_ + exit_, "calls": 6 + 2 + 2}
    assert step["reduce_scatter"] == {"bytes": 64 + 96 + 320 + 320 + 64 + 64, "calls": 6}
    assert step["all_to_all"] == {"bytes": 2 * 6 * 64, "calls": 12}


def test_dap_limits_and_scaling():
    """DAP 1 sends nothing; a rank's all-to-all bytes fall with the DAP size (``S(d-1)/d^2``), its gather bytes
    rise towards the whole tensor (``S(d-1)/d``); recycling passes and recomputation only add."""
    dims = comm.ModelDims.from_config(_cfg("mlperf", precision="bf16"))
    assert comm.dap_collectives(dims, 1, recycling=3) == []
    kinds = {d: comm.totals(comm.dap_collectives(dims, d, recycling=0), by=("kind",)) for d in (2, 4, 8)}
    assert kinds[2]["all_to_all"]["bytes"] > kinds[4]["all_to_all"]["bytes"] > kinds[8]["all_to_all"]["bytes"]
    assert kinds[2]["all_gather"]["bytes"] < kinds[4]["all_gather"]["bytes"] < kinds[8]["all_gather"]["bytes"]
    assert all(kinds[d]["all_to_all"]["calls"] == kinds[2]["all_to_all"]["calls"] for d in kinds)  # launches: not d's
    base = comm.totals(comm.dap_collectives(dims, 8, recycling=0))
    more = comm.totals(comm.dap_collectives(dims, 8, recycling=3, recompute={"evoformer_stack": 48}))
    assert all(more[k]["bytes"] > base[k]["bytes"] for k in ("dap/all_to_all", "dap/all_gather"))
    # MLPerf at DAP 8: 48 Evoformer blocks x 12 collectives per pass dominate
    blk = comm.per_block(dims, 8)["evoformer_stack"]
    assert blk["all_to_all"]["calls"] == 6 and blk["all_gather"]["calls"] == 6
    z = 256 // 8 * 256 * 128 * 2  # a rank's pair shard, bf16: 2 MiB
    assert comm.block_collectives(dims, "evoformer_stack", 8)[-1][1] == z * 7 // 8


def test_bp_collectives_by_hand():
    """BP: per block two broadcasts forward (a rank sends the larger branch output), one all-reduce of both
    inputs' gradients backward."""
    dims = _hand_dims()
    m, z = 4 * 8 * 4 * 2, 8 * 8 * 2 * 2  # DAP 1: m [4, 8, 4], z [8, 8, 2], bf16
    got = {(c.kind, c.phase): (c.bytes, c.calls) for c in comm.bp_collectives(dims, 1, recycling=2)}
    assert got[("broadcast", "recycling")] == (max(m, z) * 2, 4)
    assert got[("broadcast", "forward")] == (max(m, z), 2)
    assert got[("all_reduce", "backward")] == (m + z, 1)


def test_gradient_allreduce_ring_and_hierarchy():
    """Ring bytes per rank are 2(N-1)/N of the buffer; one rank reduces nothing; inside one node only NVLink;
    between nodes the time grows with the node count, the tree's latency slower than the ring's."""
    h100 = CARDS["h100"]
    size = 93_229_082 * 4
    one = comm.grad_allreduce(93_229_082, 4, 1, h100)
    assert one.seconds == 0 and one.ring_bytes == 0
    node = comm.grad_allreduce(93_229_082, 4, 8, h100)
    assert node.ring_bytes == 2 * 7 * size // 8 and node.inter_ring_s == 0 and node.intra_s > 0
    assert node.buckets == -(-size // comm.DDP_BUCKET_BYTES)
    big = comm.grad_allreduce(93_229_082, 4, 2048, h100)
    assert big.ring_bytes == 2 * 2047 * size // 2048
    assert big.inter_tree_s < big.inter_ring_s  # 256 nodes: 16 tree steps against 510 ring steps
    # the bandwidth term: each GPU's port carries 1/8 of the buffer, 2 (n-1)/n of it, at 90 % of 50 GB/s
    assert big.inter_tree_s == pytest.approx(2 * 255 / 256 * size / 8 / 45e9 + 16 * 5e-6)
    slower = comm.grad_allreduce(93_229_082, 4, 2048, CARDS["a100-sxm"])  # HDR and NVLink 3: half the bandwidth
    assert slower.seconds > big.seconds
    assert comm.grad_allreduce(93_229_082, 2, 2048, h100).seconds < big.seconds  # bf16 gradients: half the bytes


def test_comm_seconds_graphed_exposes_the_allreduce_eager_overlaps_it():
    dims = comm.ModelDims.from_config(_cfg("mlperf", precision="bf16"))
    colls = comm.dap_collectives(dims, 8, recycling=1)
    ar = comm.grad_allreduce(dims.parameters, 4, 2048, CARDS["h100"])
    graphed = comm.comm_seconds(colls, ar, CARDS["h100"], graphed=True)
    eager = comm.comm_seconds(colls, ar, CARDS["h100"], graphed=False, host_s_per_launch=20e-6)
    assert graphed["allreduce_exposed_s"] == ar.seconds
    assert eager["allreduce_exposed_s"] == pytest.approx(ar.last_bucket_s) and eager["allreduce_exposed_s"] < ar.seconds
    assert 0 < graphed["dap_exposed_s"] < graphed["dap_s"]  # the overlapped switches and gathers left out
    assert eager["host_launch_s"] == pytest.approx(eager["launches"] * 20e-6)
    assert dims.parameters == 93_229_082  # MLPerf's model_parameters_count


def test_estimate_step_reports_the_layouts_communication(capsys):
    """``estimate-step --dap 2 --dp 4 --json`` on the tiny preset: bytes and launches per collective per block and
    step, the gradient all-reduce over the 8 training ranks, the links named, and the predicted step on the card
    (compute + exposed communication), graphed and eager; a layout that cannot exist is refused in one line."""
    import json

    from scalefold.cli import main

    assert main(["estimate-step", "--preset", "tiny", "--precision", "bf16", "--dap", "2", "--dp", "4", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["communication"]
    assert c["layout"]["train_ranks"] == 8 and c["card"]["intra_node"]["name"] == "nvlink4"
    assert c["card"]["inter_node"]["name"] == "ib-ndr" and c["parameters"] == 119_290
    assert set(c["per_block_forward"]["evoformer_stack"]) == {"all_to_all", "all_gather"}
    assert set(c["per_step"]) == {"0", "1"} and c["per_step_mean"]["dap/all_to_all"]["calls"] > 0
    assert c["gradient_allreduce"]["ring_bytes_per_rank"] == 2 * 7 * 119_290 * 4 // 8
    for mode in ("graphed", "eager"):
        m = c["predicted_step_s"][mode]["mean"]
        assert m["step_s"] == pytest.approx(m["compute_s"] + m["exposed_s"]) and m["dap_s"] > 0
    assert main(["estimate-step", "--preset", "tiny", "--dap", "3", "--dp", "2"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dap 3 must divide the 8 GPUs per node" in err[0]
    assert main(["estimate-step", "--preset", "tiny", "--card", "v100"]) == 3
    assert "known: h100, h200, a100-sxm, a100-pcie, b200" in capsys.readouterr().err
