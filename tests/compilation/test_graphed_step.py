"""The loop's CUDA-graphed step forward (scalefold.compilation.graphed_step), on CPU with a fake graph backend.

The fake backend's "graph" re-runs the captured function on the static input buffers, so every test
here checks the dispatch logic (keys, warm-up capture, static-input copies, the short-circuited
no-grad passes, fallbacks) bit for bit against the plain ``model(batch)`` path; the real capture is
checked by the CUDA-only test at the end.
"""

from __future__ import annotations

import json
import re
from unittest import mock

import pytest
import torch

from scalefold.compilation.graphed_step import (
    CudaGraphsUnavailable,
    GraphedStep,
    resolve_mode,
    setup_graphed_step,
    synthetic_step_batch,
)
from scalefold.data.pipeline import FeatureConfig
from scalefold.losses import AlphaFoldLoss
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.features import make_synthetic_batch
from scalefold.model.precision import float_outputs

DROPOUT = {  # dropout on, so the RNG order of the graphed path is checked too
    "evoformer_stack_config": {"msa_dropout": 0.15, "pair_dropout": 0.25},
    "extra_msa_stack_config": {"msa_dropout": 0.15, "pair_dropout": 0.25},
    "template_pair_stack_config": {"dropout_rate": 0.25},
    "structure_module_config": {"dropout_rate": 0.1},
}


class FakeBackend:
    """CPU stand-in for CUDA graphs: a replay re-runs the function on the static inputs."""

    device_type = "cpu"

    def __init__(self, fail: bool = False, corrupt: bool = False, frozen_rng: bool = False) -> None:
        self.fail, self.corrupt, self.frozen_rng = fail, corrupt, frozen_rng
        self.captures = 0

    def is_available(self) -> bool:
        return True

    def capture(self, fn, static_args):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        if self.corrupt:  # a graph reading the wrong memory
            return lambda: tuple(torch.full_like(t, 7.0) for t in fn(*static_args))
        if self.frozen_rng:  # a graph that does not advance the generator (or baked host random numbers in)

            def replay():
                with torch.random.fork_rng(devices=[]):
                    return fn(*static_args)

            return replay
        return lambda: fn(*static_args)

    def capture_with_grad(self, module, example_args):  # pragma: no cover -- never asked for
        raise AssertionError("the graphed step captures no-grad passes only")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    """A tiny model with dropout, R = 3 (recycling counts 0, 1, 2), its loss and a training-shaped batch."""
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"num_recycling_iters": 2, **DROPOUT})
    torch.manual_seed(0)
    model = AlphaFold(cfg, activation_checkpointing=False)
    emb = cfg.input_embedder_config
    batch = make_synthetic_batch(16, 4, 8, 2, num_recycling_iters=2, tf_dim=emb.tf_dim, msa_dim=emb.msa_dim, seed=3)
    return model, AlphaFoldLoss(cfg.loss_config), batch


def _sliced(batch, n):
    return {k: v[..., : n + 1] for k, v in batch.items()}


def _loss_and_grads(forward, model, loss_fn, batch, seed, autocast=False):
    """As the loop: forward under (bf16) autocast, the loss in fp32, backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast(batch["aatype"].device.type, dtype=torch.bfloat16, enabled=autocast):
        outputs = forward(batch)
    loss, _ = loss_fn(float_outputs(outputs) if autocast else outputs, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _assert_identical(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(grads_a, grads_b))


def test_resolve_mode():
    """auto: on for CUDA without DAP/BP, off elsewhere; on: refused where unusable; off: off."""
    assert resolve_mode("auto", "cuda")[0] is True
    assert resolve_mode("on", "cuda")[0] is True
    assert resolve_mode("off", "cuda") == (False, "--cuda-graphs off")
    assert resolve_mode("auto", "cpu")[0] is False
    assert resolve_mode("auto", "cuda", model_parallel=2)[0] is False
    assert resolve_mode("auto", "cuda", backend_available=False)[0] is False
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_mode("on", "cpu")
    with pytest.raises(ValueError, match="dap/--bp"):
        resolve_mode("on", "cuda", model_parallel=4)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_mode("yes", "cuda")
    assert resolve_mode("auto", "cuda", unsupported="frozen RNG") == (False, "frozen RNG")
    with pytest.raises(CudaGraphsUnavailable, match="frozen RNG"):
        resolve_mode("on", "cuda", unsupported="frozen RNG")


def test_cpu_auto_is_a_pass_through(tiny):
    """--cuda-graphs auto on CPU: no backend, no warm-up, every call is net(batch) itself."""
    model, _, _ = tiny
    calls = []
    net = lambda batch: calls.append(batch) or "out"  # noqa: E731
    features = FeatureConfig.from_reference_config(model.config.to_dict())
    step = setup_graphed_step("auto", model, net, features, torch.device("cpu"), torch.float32, False, verbose=False)
    assert not step.active and step.backend is None
    assert step({"aatype": torch.zeros(1, 4, 3)}) == "out" and len(calls) == 1
    assert step.stats.eager_off == 1


def test_graphed_steps_equal_eager_bit_for_bit(tiny):
    """Warm-up captures recycling counts 1 and 2 (keys: recycling count + training/autocast state, the
    input slices' shapes, grad off); then for n = 0, 1, 2 the graphed step gives the plain path's loss
    and gradients exactly (dropout included), and the model's iteration() is restored after each call."""
    model, loss_fn, batch = tiny
    backend = FakeBackend()
    step = GraphedStep(model, enabled=True, backend=backend, log=None)
    assert step.warm_up(batch) == [1, 2]
    assert backend.captures == 2 and not step.cache.in_warmup
    keys = step.cache.keys()
    assert sorted(k.tag for k in keys) == [("recycling", 1, True, False, None), ("recycling", 2, True, False, None)]
    assert all(not k.grad_enabled for k in keys)
    assert {k.tag[1]: k.signature[0][0] for k in keys} == {1: (1, 16, 1), 2: (1, 16, 2)}  # aatype [B, N_res, n]
    assert not torch.equal(
        _loss_and_grads(model, model, loss_fn, batch, 1)[0], _loss_and_grads(model, model, loss_fn, batch, 2)[0]
    )
    for n in (2, 1, 0):  # (dropout is live: the seed changes the loss)
        b = _sliced(batch, n)
        plain = _loss_and_grads(model, model, loss_fn, b, seed=10 + n)
        graphed = _loss_and_grads(step, model, loss_fn, b, seed=10 + n)
        _assert_identical(plain, graphed)
        assert "iteration" not in vars(model)
    assert (step.stats.graphed, step.stats.eager_no_passes, step.stats.eager_miss) == (2, 1, 0)
    assert backend.captures == 2  # replays only


def test_uncaptured_shapes_fall_back_to_eager_with_one_logged_reason(tiny):
    """After warm-up, a key never captured (another crop size) runs net(batch) eagerly, logged once."""
    model, loss_fn, _ = tiny
    emb = model.config.input_embedder_config
    warned = []
    step = GraphedStep(model, enabled=True, backend=FakeBackend(), warn=warned.append)
    small = make_synthetic_batch(8, 4, 8, 2, num_recycling_iters=1, tf_dim=emb.tf_dim, msa_dim=emb.msa_dim)
    step.warm_up(small)
    other = make_synthetic_batch(12, 4, 8, 2, num_recycling_iters=1, tf_dim=emb.tf_dim, msa_dim=emb.msa_dim)
    third = make_synthetic_batch(10, 4, 8, 2, num_recycling_iters=1, tf_dim=emb.tf_dim, msa_dim=emb.msa_dim)
    for b in (other, other, third):  # two uncaptured shape sets of one recycling count: one line
        _assert_identical(_loss_and_grads(model, model, loss_fn, b, 5), _loss_and_grads(step, model, loss_fn, b, 5))
    assert step.stats.eager_miss == 3 and step.stats.graphed == 0
    assert len(warned) == 1 and "no graph for recycling count 1" in warned[0]
    assert len(step.cache) == 1  # nothing captured after warm-up


@pytest.mark.parametrize("backend", [FakeBackend(fail=True), FakeBackend(corrupt=True)], ids=["raises", "wrong"])
def test_failed_or_wrong_capture_turns_graphs_off(tiny, backend):
    """A capture that raises, or a replay that disagrees with eager at warm-up, switches graphs off for
    the run with one logged reason; steps then run net(batch)."""
    model, _, batch = tiny
    warned = []
    step = GraphedStep(model, enabled=True, backend=backend, warn=warned.append)
    assert step.warm_up(_sliced(batch, 1)) == []
    assert not step.active and len(step.cache) == 0
    assert len(warned) == 1 and "recycling count 1" in warned[0] and "eagerly" in warned[0]
    assert ("capture failed" in warned[0]) if backend.fail else ("differs from eager" in warned[0])


def test_replay_that_leaves_the_rng_elsewhere_turns_graphs_off(tiny):
    """A replay whose values match eager but which does not advance the random number generators as the
    eager passes do (so the grad pass would draw other dropout masks) is refused at warm-up."""
    model, _, batch = tiny
    warned = []
    step = GraphedStep(model, enabled=True, backend=FakeBackend(frozen_rng=True), warn=warned.append)
    assert step.warm_up(_sliced(batch, 1)) == []
    assert not step.active and len(warned) == 1 and "torch CPU random number generator" in warned[0]


def test_capture_failure_names_the_model_line(tiny):
    """A capture that fails inside the model (here: a host sync, as the real backend's sync-checked
    warm-up reports it) is logged with the model's file and line, so the first GPU run says what to fix."""
    model, _, batch = tiny
    warned = []

    def host_sync(*args, **kwargs):
        raise RuntimeError("called a synchronizing CUDA operation")

    class SyncingBackend(FakeBackend):
        def capture(self, fn, static_args):
            with mock.patch("torch.nn.functional.one_hot", host_sync):
                fn(*static_args)
            return super().capture(fn, static_args)

    step = GraphedStep(model, enabled=True, backend=SyncingBackend(), warn=warned.append)
    assert step.warm_up(_sliced(batch, 1)) == []
    assert len(warned) == 1 and "synchronizing CUDA operation" in warned[0]
    assert re.search(r" at scalefold/model/\w+\.py:\d+ \(\w+\)", warned[0]), warned[0]


def test_parallel_evoformer_is_not_captured():
    """The Parallel Evoformer's branches draw from generators the recycling graphs do not register (a graph
    would freeze their draws): `auto` leaves graphs off without capturing, `on` is refused before training."""
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"num_recycling_iters": 1})
    model = AlphaFold(cfg, activation_checkpointing=False, parallel_evoformer=True)
    features = FeatureConfig.from_reference_config(cfg.to_dict())
    backend = FakeBackend()
    args = (model, model, features, torch.device("cpu"), torch.float32, False)
    step = setup_graphed_step("auto", *args, verbose=False, backend=backend)
    assert not step.active and backend.captures == 0 and "Parallel Evoformer" in step.reason
    with pytest.raises(CudaGraphsUnavailable, match="Parallel Evoformer"):
        setup_graphed_step("on", *args, verbose=False, backend=backend)


def test_synthetic_warm_up_batch_has_the_training_shapes(tmp_path):
    """The warm-up batch has exactly the model-feature shapes/dtypes of a real tiny training batch, so
    the graphs captured before run_start are hit by the run's steps."""
    from scalefold.config.training import TrainConfig
    from scalefold.data.batch import step_batch
    from scalefold.data.dataset import StoreSample
    from scalefold.data.store import Store
    from scalefold.model.factory import build_model, build_model_config
    from scalefold.train.run_directory import ensure_store
    from scalefold.train.training_data import split_chains

    cfg = TrainConfig.from_preset("tiny", overrides={"store": str(tmp_path / "s.h5"), "synth_num_chains": 6}, env={})
    ensure_store(cfg)
    model_cfg = build_model_config(cfg)
    features = FeatureConfig.from_reference_config(model_cfg.to_dict())
    model = build_model(cfg, model_cfg, torch.device("cpu"), torch.float32)
    with Store.open(cfg.store) as store:
        train_ids, _, _ = split_chains(store, cfg)
    real = step_batch(StoreSample(cfg.store, train_ids, features, mode="train")(0, 1), features.num_ensembles - 1,
                      torch.device("cpu"), torch.float32)  # fmt: skip
    synthetic = synthetic_step_batch(features, model, torch.device("cpu"), torch.float32)
    step = GraphedStep(model, enabled=True, backend=FakeBackend())
    for n in range(1, features.num_ensembles):
        with torch.no_grad():
            tag = step._tag(n, "cpu")
            assert step.cache.key(step._inputs(real, n), tag=tag) == step.cache.key(step._inputs(synthetic, n), tag=tag)


def _metrics(path):
    return [
        (r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines()) if "loss" in r
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU integration test (auto means real graphs on CUDA: "
                    "test_real_cuda_graphs_match_eager and bench/gpu_session.sh cover that)")
def test_tiny_training_run_is_identical_with_graphs_auto_off_and_fake(tmp_path, monkeypatch):
    """`scalefold train --preset tiny --max-steps 2`: --cuda-graphs auto (CPU: pass-through) and off give
    bit-identical losses; so does a run whose graphs are captured before run_start by the fake backend
    (the loop's integration: warm-up placement, keys hit by the real batches, short-circuited passes)."""
    from scalefold.cli import main
    from scalefold.train import trainer as loop

    store = tmp_path / "store.h5"
    common = ["train", "--preset", "tiny", "--max-steps", "2", "--eval-every", "0", "--checkpoint-every", "0",
              "--store", str(store), "--no-progress"]  # fmt: skip
    for mode in ("off", "auto"):
        assert main([*common, "--out", str(tmp_path / mode), "--cuda-graphs", mode]) == 0
    created = []

    def fake_setup(*args, **kwargs):
        created.append(setup_graphed_step(*args, **{**kwargs, "backend": FakeBackend()}))
        return created[-1]

    monkeypatch.setattr(loop, "setup_graphed_step", fake_setup)
    monkeypatch.setattr(loop, "resolve_graph_mode", lambda *a, **k: (True, "fake backend"))  # train()'s early check
    assert main([*common, "--out", str(tmp_path / "fake"), "--cuda-graphs", "on"]) == 0
    off, auto, fake = (_metrics(tmp_path / m / "metrics.jsonl") for m in ("off", "auto", "fake"))
    assert len(off) == 2 and off == auto == fake
    (step,) = created
    n_steps = [loop.recycling_count(1234, s, 2) for s in (1, 2)]
    assert step.stats.graphed == sum(n > 0 for n in n_steps) >= 1 and step.stats.eager_miss == 0
    assert (tmp_path / "fake" / "mlperf.log").read_text().index("run_start") > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_real_cuda_graphs_match_eager(tiny, autocast):
    """On a GPU: captured no-grad passes give the eager losses and gradients for a few steps (every
    recycling count; dropout via the graph-safe generator), within rounding."""
    model, loss_fn, batch = tiny
    model = AlphaFold(model.config, activation_checkpointing=True).cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    step = GraphedStep(model, enabled=True, log=print)
    assert step.warm_up(batch, autocast=autocast) == [1, 2], step.reason  # e.g. a host sync in the model
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-4, atol=1e-5)
    for i, n in enumerate((2, 1, 0, 2)):
        b = _sliced(batch, n)
        (lp, gp), (lg, gg) = (_loss_and_grads(fwd, model, loss_fn, b, 100 + i, autocast) for fwd in (model, step))
        torch.testing.assert_close(lg, lp, **tol)
        for x, y in zip(gg, gp):
            if x is not None:
                torch.testing.assert_close(x, y, **tol)
    assert step.stats.graphed == 3 and step.stats.eager_miss == 0
    torch.cuda.synchronize()


def test_cuda_graphs_option_is_validated(tmp_path):
    """--cuda-graphs: an unknown mode or `on` with DAP/BP is a configuration error; `on` without CUDA is
    refused by `scalefold train` with exit status 3 before any step."""
    from scalefold.cli import main
    from scalefold.config.training import TrainConfig

    assert TrainConfig.from_preset("tiny", env={}).cuda_graphs == "auto"
    assert TrainConfig.from_preset("tiny", env={"SCALEFOLD_CUDA_GRAPHS": "off"}).cuda_graphs == "off"
    with pytest.raises(ValueError, match="unknown cuda_graphs mode"):
        TrainConfig.from_preset("tiny", overrides={"cuda_graphs": "yes"}, env={})
    with pytest.raises(CudaGraphsUnavailable, match="not supported with --dap/--bp > 1"):
        resolve_mode("on", "cuda", model_parallel=2)  # the one place the rule lives (train() asks it first)
    if not torch.cuda.is_available():
        out = tmp_path / "run"
        args = [
            "train",
            "--preset",
            "tiny",
            "--out",
            str(out),
            "--store",
            str(tmp_path / "s.h5"),
            "--cuda-graphs",
            "on",
        ]
        assert main(args) == 3
        assert not (out / "metrics.jsonl").exists()
        assert not (out / "mlperf.log").exists()  # refused before init_start, on every rank
