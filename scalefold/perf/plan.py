"""Time to train, planned (``scalefold plan``): MLPerf's ``run_start`` -> ``run_stop`` on N cards of one type.

    ttt = startup + steps x step + the first cycle's warm-up + (cycles - 1) x the hand-over between cycles
          + the training ranks' waits on evaluation + the last evaluation's latency

* **step** -- the training step at the layout (:func:`scalefold.perf.layout_model.predict_step`: the step-time
  model per card plus DAP's, BP's and the gradient all-reduce's communication), or a measured one
  (``--step-seconds``).
* **steps to the target** (lDDT-Cα 0.8, checked every :data:`EVAL_EVERY` steps) as a function of the global
  batch ``B``: ``steps = 480 (B / 256)^-k`` through NVIDIA's two v3.0 runs (:data:`CALIBRATION`: 480 steps at
  ``B`` = 256, 680 at 128, so ``k`` = 0.503: the samples to the target grow about as ``sqrt(B)``), rounded up
  to whole evaluation cycles. Only ``B`` in 128..256 is calibrated; outside it the result says
  ``extrapolated``.
* **evaluation** (180 CAMEO targets) on ``E`` GPUs takes ``eval(E) = a + b / E`` (a: the longest targets and
  the fixed work, b: the rest, shared), the first one ``first(E) = a' + b' / E`` more (the features computed
  and cached in host memory), fitted to the two runs' evaluations (25.4 s on 32 evaluation GPUs, 17.8 s on the
  128 training GPUs; first 99.0 s and 79.8 s). ``E`` is capped at the 180 targets; on another card it scales
  with the card's predicted step against the H100's. With **evaluation ranks** (``--eval-ranks E > 0``) the
  evaluation of cycle ``k`` runs while cycle ``k + 1`` trains: the training ranks wait only where an
  evaluation outlasts a cycle, and at the first cycle for the first evaluation (of the initial weights, begun
  :data:`EVAL_SETUP_S` after ``run_start``); the last evaluation's latency ends the run. **Synchronous**
  (``--eval-ranks 0``): every cycle's evaluation runs on the training ranks, in series.
* **startup** (``run_start`` -> the first step: datasets, the loader's first batches), the first cycle's
  warm-up (the loader and caches filling; in step-equivalents) and the hand-over between cycles (SWA weights to
  host memory and the evaluation ranks) are constants of the two runs (:data:`CALIBRATION`).
* **init** (``init_start`` -> ``init_stop``, not part of MLPerf's time to train): reported beside, NVIDIA's
  236 s (model build, checkpoint load, graph capture, 2,080 ranks' process groups).

**Calibration.** Only NVIDIA's two v3.0 OpenFold submissions (``mlcommons/hpc_results_v3.0``,
``NVIDIA/results/eos_n260_ngc23.09_pytorch/strong/openfold/result_0.txt``: 2,080 H100 = 2,048 training at DAP-8 +
32 evaluating, batch 256; ``NVIDIA/results/eos_n256_ngc23.09_pytorch/weak/openfold/result_0.txt``, instance 7:
one of 16 x 128 H100, DAP off, batch 128, synchronous evaluation). The steps to the target are the issue's
figures for those runs (480 and 680; the strong run's ``result_0`` itself needed 560, its ``result_1`` 480).
The A100 submissions of v3.0 are not used (the held-out check). ``tests/perf/test_plan.py`` checks that the
model reproduces both runs' time to train from their own step times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scalefold.perf.cluster import CARDS, Card
from scalefold.perf.layout_model import DAP_SIZES, Layout, PlanLayoutError, predict_step, step_profile, validate_layout

EVAL_EVERY = 40  # MLPerf's val_every_iters
EVAL_TARGETS = 180  # the validation set's CAMEO targets

#: NVIDIA's two v3.0 runs as their logs show them (seconds from ``run_start``; see the module docstring).
CALIBRATION: dict[str, dict[str, float]] = {
    "strong": {  # 2,080 H100, DAP-8, 32 eval ranks, batch 256 (result_0: 14 cycles)
        "cards": 2080, "dap": 8, "eval_ranks": 32, "batch": 256, "steps": 480, "published_ttt_min": 7.51,
        "first_epoch_start_s": 17.578,  # run_start 1695866176810 -> epoch_start 1695866194388
        "first_cycle_s": 39.756, "cycle_s": 26.543,  # epoch 10240; epoch 20480: 287.019 -> 313.562
        "handover_s": 1.08,  # epoch_stop -> next epoch_start (cycles 2..)
        "eval_start_s": 10.441,  # eval of epoch 0 begins (eval_start 1695866187251)
        "first_eval_s": 98.985, "eval_s": 25.40,  # 187.251 -> 286.236; then 25.37..25.40 s
        "stall_s": 52.875,  # epoch_stop 234.144 -> epoch_start 287.019
        "init_s": 236.178,  # init_start 1695865940630 -> init_stop 1695866176808
        "step_s": 0.6636,  # cycle_s / 40
    },
    "throughput": {  # one of 16 x 128 H100, DAP off, batch 128, synchronous evaluation (instance 7)
        "cards": 128, "dap": 1, "eval_ranks": 0, "batch": 128, "steps": 680, "published_ttt_min": 28.5,
        "first_epoch_start_s": 28.025,  # run_start 1696482196886 -> epoch_start 1696482224911
        "first_cycle_s": 154.813, "cycle_s": 72.289,  # epoch 5120; epoch 10240: 459.547 -> 531.836
        "handover_s": 0.0,
        "first_eval_s": 79.820, "eval_s": 17.80,  # 379.726 -> 459.546; then 17.80..17.82 s
        "step_s": 1.8072,
    },
}  # fmt: skip
STEPS_AT_256, STEPS_AT_128 = 480, 680
BATCH_EXPONENT = math.log(STEPS_AT_128 / STEPS_AT_256) / math.log(2)  # steps ~ B^-k
CALIBRATED_BATCHES = (128, 256)


def _eval_fit() -> tuple[float, float, float, float]:
    """``(a, b, a', b')`` of ``eval(E) = a + b/E`` and the first evaluation's extra ``a' + b'/E``."""
    s, t = CALIBRATION["strong"], CALIBRATION["throughput"]
    e1, e2 = s["eval_ranks"], t["cards"]  # the synchronous run evaluates on its 128 training GPUs
    b = (s["eval_s"] - t["eval_s"]) / (1 / e1 - 1 / e2)
    a = s["eval_s"] - b / e1
    x1, x2 = s["first_eval_s"] - s["eval_s"], t["first_eval_s"] - t["eval_s"]
    b2 = (x1 - x2) / (1 / e1 - 1 / e2)
    return a, b, x1 - b2 / e1, b2


EVAL_A, EVAL_B, FIRST_EVAL_A, FIRST_EVAL_B = _eval_fit()
#: The first cycle's extra time in steps of the run's own step: the mean of the two runs (19.9 and 45.7).
WARMUP_STEPS = sum((c["first_cycle_s"] - c["cycle_s"]) / c["step_s"] for c in CALIBRATION.values()) / 2
STARTUP_ASYNC_S = CALIBRATION["strong"]["first_epoch_start_s"]
STARTUP_SYNC_S = CALIBRATION["throughput"]["first_epoch_start_s"]  # the evaluation set is built on the training ranks
HANDOVER_S = CALIBRATION["strong"]["handover_s"]
EVAL_SETUP_S = CALIBRATION["strong"]["eval_start_s"]
INIT_S = CALIBRATION["strong"]["init_s"]
LATENCY_S = 0.24  # epoch_start -> eval_start: the weights reach the evaluation ranks
#: Evaluation ranks the layout search tries (0: synchronous evaluation on the training ranks).
EVAL_RANK_CANDIDATES = (0, 8, 16, 32, 64, 128)


def steps_to_target(batch: int) -> tuple[int, bool]:
    """``(steps, extrapolated)``: optimizer steps to lDDT-Cα 0.8 at global batch ``batch``, whole cycles."""
    if batch < 1:
        raise ValueError(f"global batch must be >= 1, got {batch}")
    raw = STEPS_AT_256 * (batch / 256) ** -BATCH_EXPONENT
    steps = EVAL_EVERY * math.ceil(raw / EVAL_EVERY - 1e-9)
    return steps, not CALIBRATED_BATCHES[0] <= batch <= CALIBRATED_BATCHES[1]


def eval_seconds(gpus: int, speed: float = 1.0) -> tuple[float, float]:
    """``(an evaluation, the first one)`` in seconds on ``gpus`` GPUs ``speed`` times an H100's speed."""
    e = max(1, min(gpus, EVAL_TARGETS))
    regular = (EVAL_A + EVAL_B / e) / speed
    return regular, regular + (FIRST_EVAL_A + FIRST_EVAL_B / e) / speed


@dataclass(frozen=True)
class Breakdown:
    """Where the seconds of one planned run go (``run_start`` -> ``run_stop``)."""

    steps: int
    step_s: float
    startup_s: float
    train_s: float  # steps x step
    warmup_s: float
    handover_s: float
    eval_wait_s: float  # training ranks waiting on evaluation (synchronous: all evaluations)
    last_eval_s: float  # the target's evaluation -> run_stop (asynchronous)
    eval_s: float
    first_eval_s: float

    @property
    def ttt_s(self) -> float:
        return self.startup_s + self.train_s + self.warmup_s + self.handover_s + self.eval_wait_s + self.last_eval_s

    def to_json(self) -> dict:
        return {"steps": self.steps, "step_s": self.step_s, "startup_s": self.startup_s, "train_s": self.train_s,
                "warmup_s": self.warmup_s, "handover_s": self.handover_s, "eval_wait_s": self.eval_wait_s,
                "last_eval_latency_s": self.last_eval_s, "eval_s": self.eval_s, "first_eval_s": self.first_eval_s,
                "ttt_s": self.ttt_s}  # fmt: skip


def time_to_train(steps: int, step_s: float, eval_ranks: int, train_ranks: int, speed: float = 1.0) -> Breakdown:
    """The breakdown of a run of ``steps`` steps of ``step_s`` seconds (see the module docstring)."""
    cycles = max(1, math.ceil(steps / EVAL_EVERY))
    cycle = EVAL_EVERY * step_s
    warmup = WARMUP_STEPS * step_s
    if eval_ranks == 0:  # synchronous: every cycle's evaluation on the training ranks, in series
        regular, first = eval_seconds(train_ranks, speed)
        waits = first + (cycles - 1) * regular
        return Breakdown(steps, step_s, STARTUP_SYNC_S, steps * step_s, warmup, 0.0, waits, 0.0, regular, first)
    regular, first = eval_seconds(eval_ranks, speed)
    first_wait = max(0.0, EVAL_SETUP_S + first - (STARTUP_ASYNC_S + cycle + warmup))
    later = (cycles - 1) * max(0.0, regular - cycle - HANDOVER_S)
    return Breakdown(steps, step_s, STARTUP_ASYNC_S, steps * step_s, warmup, (cycles - 1) * HANDOVER_S,
                     first_wait + later, regular + LATENCY_S, regular, first)  # fmt: skip


def plan_layout(cfg: Any, card: Card, layout: Layout, mode: str = "graphed", step_seconds: float | None = None) -> dict:
    """The plan of one layout: its step (predicted, or ``step_seconds``), steps to the target, the breakdown."""
    if layout.bp > 1 and step_seconds is None:
        raise PlanLayoutError("--bp 2: the step-time model counts no branch-parallel step (the fake step refuses BP); "
                              "plan it from a measured step with --step-seconds")  # fmt: skip
    steps, extrapolated = steps_to_target(layout.global_batch)
    predicted = None
    speed = 1.0
    if step_seconds is None:
        predicted = predict_step(cfg, card, layout)
    if card.name != "h100":  # the evaluation's speed against the calibration's H100: the DAP rank's compute
        rank = Layout(count=layout.dap, dap=layout.dap)
        mine, ref = predict_step(cfg, card, rank), predict_step(cfg, CARDS["h100"], rank)
        speed = ref[mode]["mean"]["compute_s"] / mine[mode]["mean"]["compute_s"]
    step_s = step_seconds if step_seconds is not None else predicted[mode]["mean"]["step_s"]
    b = time_to_train(steps, step_s, layout.eval_ranks, layout.train_ranks, speed)
    out = {"card": card.name, "layout": layout.to_json(), "mode": mode, "step_source": "measured" if step_seconds else "predicted",
           "steps_to_target": steps, "batch_extrapolated": extrapolated, "ttt_minutes": b.ttt_s / 60,
           "init_minutes": INIT_S / 60, "breakdown": b.to_json(), "eval_speed_vs_h100": speed}  # fmt: skip
    if predicted is not None:
        out["predicted_step"] = {m: predicted[m]["mean"] for m in ("graphed", "eager")}
    return out


def candidate_layouts(card: Card, count: int, crop: int, batch: int | None = None, bp: int = 1,
                      eval_ranks: int | None = None) -> list[Layout]:  # fmt: skip
    """Layouts worth ranking on ``count`` cards: each DAP size the node and crop allow, evaluation ranks from
    a few candidates (or none), the largest data-parallel size whose batch (one sample per replica unless
    ``batch``) stays within the calibrated 128..256 (cards left over stay idle); ``eval_ranks``: only that many."""
    out: list[Layout] = []
    for dap in DAP_SIZES:
        group = dap * bp
        if card.gpus_per_node % group or crop % dap:
            continue
        for e in EVAL_RANK_CANDIDATES if eval_ranks is None else (eval_ranks,):
            if e >= count:
                continue
            dp = min((count - e) // group, CALIBRATED_BATCHES[1])
            if dp < 1 or (batch is not None and batch % dp):
                continue
            lay = Layout(count=dp * group + e, dap=dap, bp=bp, eval_ranks=e, batch=batch)
            try:
                out.append(validate_layout(lay, card, crop))
            except PlanLayoutError:
                continue
    return out


def best_layouts(cfg: Any, card: Card, count: int, crop: int, mode: str = "graphed", batch: int | None = None,
                 bp: int = 1, top: int = 5, eval_ranks: int | None = None) -> list[dict]:  # fmt: skip
    """The ``top`` candidate layouts by predicted time to train (each DAP size counted once: minutes the first
    time at MLPerf shapes, then from the disk cache)."""
    plans = [plan_layout(cfg, card, lay, mode) for lay in candidate_layouts(card, count, crop, batch, bp, eval_ranks)]
    plans.sort(key=lambda p: (p["batch_extrapolated"], p["ttt_minutes"]))
    return plans[:top]


def warm_profiles(cfg: Any, daps: tuple[int, ...] = DAP_SIZES) -> None:
    """Count (and keep on disk) the step of each DAP size in ``daps``."""
    from scalefold.perf.layout_model import layout_config

    for d in daps:
        step_profile(layout_config(cfg, d))


__all__ = [
    "CALIBRATION", "Breakdown", "best_layouts", "candidate_layouts", "eval_seconds", "plan_layout", "steps_to_target",
    "time_to_train", "warm_profiles",
]  # fmt: skip
