"""The time-to-train planner (``scalefold.perf.plan``, ``scalefold plan``): the calibration against NVIDIA's two
v3.0 runs, the steps-to-target and evaluation models' shape, the layout rules, the command's errors and JSON."""

from __future__ import annotations

import json

import pytest

from scalefold.cli import main
from scalefold.perf import plan as P
from scalefold.perf.cluster import CARDS, UnknownName, card
from scalefold.perf.layout_model import Layout, PlanLayoutError, validate_layout

#: The agreement asked of the calibration: each run's time to train from its own step time and steps.
TOLERANCE = 0.03


@pytest.mark.parametrize(
    "steps, step_s, eval_ranks, train_ranks, measured_s",
    [
        (480, 0.68, 32, 2048, 7.51 * 60),  # 2,080 H100, DAP-8, published olympic mean
        (560, 0.6636, 32, 2048, 1695866679.558 - 1695866176.810),  # its result_0.txt: 14 cycles
        (680, 1.81, 0, 128, 28.5 * 60),  # 16 x 128 H100, DAP off, synchronous evaluation, published per model
        (720, 1.8072, 0, 128, 1696483993.564 - 1696482196.886),  # its result_0.txt, instance 7: 18 cycles
    ],
)
def test_the_calibration_reproduces_nvidias_runs(steps, step_s, eval_ranks, train_ranks, measured_s):
    got = P.time_to_train(steps, step_s, eval_ranks, train_ranks).ttt_s
    assert got == pytest.approx(measured_s, rel=TOLERANCE)


def test_the_strong_runs_breakdown_matches_its_log():
    """The first evaluation (of the initial weights, with the feature cache built) holds the training ranks
    ~50 s after the first cycle; the later ones (25.4 s) hide under the 27 s cycles; the last ends the run."""
    b = P.time_to_train(480, 0.6636, 32, 2048)
    s = P.CALIBRATION["strong"]
    assert b.eval_s == pytest.approx(s["eval_s"]) and b.first_eval_s == pytest.approx(s["first_eval_s"])
    assert b.eval_wait_s == pytest.approx(s["stall_s"], abs=10)  # the warm-up's mean over both runs shifts it
    assert b.last_eval_s == pytest.approx(25.64)
    t = P.time_to_train(680, 1.8072, 0, 128)
    assert t.eval_wait_s == pytest.approx(79.82 + 16 * 17.80) and t.last_eval_s == 0


def test_steps_to_target_is_calibrated_and_monotonic():
    assert P.steps_to_target(256) == (480, False)
    assert P.steps_to_target(128) == (680, False)
    steps = [P.steps_to_target(b)[0] for b in (32, 64, 128, 192, 256, 512, 1024)]
    assert steps == sorted(steps, reverse=True)  # fewer steps with a larger batch...
    samples = [s * b for s, b in zip(steps, (32, 64, 128, 192, 256, 512, 1024))]
    assert samples == sorted(samples)  # ...but more samples
    assert all(s % P.EVAL_EVERY == 0 for s in steps)
    assert P.steps_to_target(512)[1] and P.steps_to_target(64)[1]  # outside 128..256: extrapolated


def test_evaluation_falls_with_ranks_and_stops_at_the_targets():
    times = [P.eval_seconds(e)[0] for e in (8, 16, 32, 64, 128, 180)]
    assert times == sorted(times, reverse=True)
    assert P.eval_seconds(4096) == P.eval_seconds(180)  # no more than one target per GPU
    assert all(first > regular for regular, first in (P.eval_seconds(e) for e in (8, 32, 128)))
    slow = P.time_to_train(480, 0.3, 8, 2048)  # a fast step and few evaluation ranks: waits every cycle
    fast = P.time_to_train(480, 0.3, 64, 2048)
    assert slow.eval_wait_s > fast.eval_wait_s


@pytest.mark.parametrize(
    "layout, rule",
    [
        (Layout(2080, dap=3, eval_ranks=32), "must divide the 8 GPUs per node"),
        (Layout(64, dap=8, eval_ranks=64), "fewer than the 64 cards"),
        (Layout(2080, dap=8, eval_ranks=30), "not divisible by bp x dap = 8"),
        (Layout(2080, dap=8, eval_ranks=32, batch=300), "not divisible by the data-parallel size 256"),
        (Layout(64, dap=8, bp=2), "bp x dap = 16 must divide the 8 GPUs per node"),
    ],
)
def test_layouts_that_cannot_exist_are_refused(layout, rule):
    with pytest.raises(PlanLayoutError, match=rule):
        validate_layout(layout, CARDS["h100"], 256)


def test_unknown_card_names_the_known_ones():
    with pytest.raises(UnknownName, match="known: h100, h200, a100-sxm, a100-pcie, b200"):
        card("v100")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--card", "v100", "--count", "8"], "known: h100, h200, a100-sxm, a100-pcie, b200"),
        (["--card", "h100", "--count", "8", "--inter-link", "ethernet"], "known: nvlink3, nvlink4, nvlink5, pcie4, pcie5, ib-hdr"),
        (["--card", "h100", "--count", "2080", "--dap", "3"], "--dap 3 must divide the 8 GPUs per node"),
        (["--card", "h100", "--count", "64", "--dap", "8", "--eval-ranks", "64"], "--eval-ranks 64"),
        (["--card", "h100", "--count", "2080", "--dap", "8", "--batch", "100"], "not divisible by the data-parallel size"),
        (["--card", "h100", "--count", "128", "--step-seconds", "1.8"], "--step-seconds needs --dap"),
        (["--card", "h100", "--count", "128", "--dap", "1", "--step-seconds", "0"], "--step-seconds 0: must be > 0"),
    ],
)
def test_plan_refuses_bad_input_in_one_line(capsys, argv, message):
    assert main(["plan", *argv]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scalefold plan: ") and message in err[0]


def test_plan_json_from_a_measured_step(capsys):
    """NVIDIA's throughput layout with its published step: the JSON a script reads."""
    assert main(["plan", "--card", "h100", "--count", "128", "--dap", "1", "--eval-ranks", "0", "--step-seconds", "1.81",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["ttt_minutes"] == pytest.approx(28.5, rel=TOLERANCE)
    p = out["plan"]
    assert p["steps_to_target"] == 680 and p["step_source"] == "measured"
    assert set(p["breakdown"]) >= {"steps", "step_s", "startup_s", "train_s", "warmup_s", "handover_s", "eval_wait_s",
                                   "last_eval_latency_s", "ttt_s"}  # fmt: skip
    assert p["layout"] == {"cards": 128, "dap": 1, "bp": 1, "eval_ranks": 0, "train_ranks": 128, "dp": 128,
                           "global_batch": 128, "samples_per_replica": 1}  # fmt: skip
    assert main(["plan", "--card", "h100", "--count", "2080", "--dap", "8", "--step-seconds", "0.68"]) == 0
    text = capsys.readouterr().out
    assert "DAP 8 x BP 1 x DP 256 = 2048 training ranks + 32 evaluating" in text and "480 steps" in text


def test_plan_predicts_and_ranks_layouts_on_a_small_preset(capsys, tmp_path, monkeypatch):
    """Without a measured step the plan counts the step of each DAP size (the tiny preset: seconds each) and
    ranks the layouts; with a layout, the predicted step's compute and communication are in the JSON."""
    monkeypatch.setenv("SCALEFOLD_FLOPS_CACHE", str(tmp_path))
    assert main(["plan", "--preset", "tiny", "--crop", "24", "--card", "h100", "--count", "16", "--dap", "2", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["plan"]
    step = p["predicted_step"]
    assert step["graphed"]["step_s"] == pytest.approx(p["breakdown"]["step_s"])
    assert step["eager"]["step_s"] > step["graphed"]["step_s"] > step["graphed"]["compute_s"] > 0
    assert step["graphed"]["dap_s"] > 0 and step["graphed"]["allreduce_s"] > 0
    # four cards: DAP 1, 2 and 4 (2 found in the cache the first plan filled: two fake steps, not three)
    assert main(["plan", "--preset", "tiny", "--crop", "24", "--card", "b200", "--count", "4", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ranked = out["best_layouts"]
    assert 1 <= len(ranked) <= 3 and out["ttt_minutes"] == ranked[0]["ttt_minutes"]
    assert [q["ttt_minutes"] for q in ranked] == sorted(q["ttt_minutes"] for q in ranked)
    assert all(q["layout"]["cards"] <= 4 for q in ranked)
    assert {q["layout"]["dap"] for q in ranked} <= {1, 2, 4}
    assert len(list(tmp_path.glob("plan/*.json"))) == 3  # one count per DAP size that fits 4 cards (1, 2, 4), kept


def test_branch_parallel_plans_need_a_measured_step(capsys):
    """The fake step counts no BP step: ``--bp 2`` plans only from ``--step-seconds`` (and BP x DAP must fit a node)."""
    assert main(["plan", "--card", "h100", "--count", "64", "--bp", "2", "--dap", "2"]) == 3
    assert "--bp 2 needs --dap and --step-seconds" in capsys.readouterr().err
    assert main(["plan", "--card", "h100", "--count", "64", "--bp", "2", "--dap", "4", "--eval-ranks", "0",
                 "--step-seconds", "1.0", "--json"]) == 0  # fmt: skip
    p = json.loads(capsys.readouterr().out)["plan"]
    assert p["layout"]["dp"] == 8 and p["steps_to_target"] == P.steps_to_target(8)[0]
