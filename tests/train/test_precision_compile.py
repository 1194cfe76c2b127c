"""Numerics of a training step: bf16 regions kept in fp32, non-finite detection, ``--compile`` vs eager."""

from __future__ import annotations

import torch
from torch import nn

from scalefold.compilation.regions import BLOCK_REGIONS, compile_blocks, warm_up
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.features import make_synthetic_batch
from scalefold.model.precision import FP32_REGIONS, keep_fp32_regions
from scalefold.train.step import nonfinite_terms_to_nan

N_RES, N_CLUST, N_EXTRA, N_TEMPL = 12, 4, 6, 2


def _tiny(seed: int = 0) -> AlphaFold:
    torch.manual_seed(seed)
    return AlphaFold(AlphaFoldConfig.from_preset("tiny"), activation_checkpointing=False)


def _batch():
    return make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, seed=1)


def _linear_output_dtypes(model: nn.Module) -> dict[str, set[torch.dtype]]:
    """Record the output dtype of every Linear during the next forward, per top-level submodule."""
    seen: dict[str, set[torch.dtype]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            top = name.split(".")[0]
            module.register_forward_hook(lambda m, i, o, top=top: seen.setdefault(top, set()).add(o.dtype))
    return seen


def test_bf16_computes_in_bf16_but_structure_module_and_heads_in_fp32():
    """Under bf16 autocast the Evoformer's matmuls run in bf16, while every Linear of the structure module
    and of the heads runs in fp32, and the heads' outputs equal the heads run in plain fp32."""
    model = _tiny().train()
    assert keep_fp32_regions(model) == list(FP32_REGIONS)
    seen = _linear_output_dtypes(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(_batch())
    assert seen["evoformer_stack"] == {torch.bfloat16}
    assert seen["structure_module"] == {torch.float32}
    assert seen["auxiliary_heads"] == {torch.float32}
    for key in ("distogram_logits", "masked_msa_logits", "lddt_logits", "plddt", "final_atom_positions"):
        assert out[key].dtype == torch.float32, key
    # the heads' result from the (bf16) trunk outputs is what fp32 heads compute from fp32 copies
    trunk = {k: out[k] for k in ("single", "pair", "msa", "sm_single") if k in out}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        heads_bf16 = model.auxiliary_heads(trunk)
    fp32 = _tiny().auxiliary_heads
    fp32.load_state_dict(model.auxiliary_heads.state_dict())
    heads_fp32 = fp32({k: v.float() for k, v in trunk.items()})
    for key, value in heads_fp32.items():
        assert torch.equal(heads_bf16[key], value), key


def test_nonfinite_terms_make_the_step_loss_nan():
    """A step whose loss module dropped a non-finite term reports NaN (the loop then skips it)."""
    loss = torch.tensor(3.0, requires_grad=True)
    assert nonfinite_terms_to_nan(loss, {"fape": torch.tensor(1.0), "chi": torch.tensor(2.0)}) == 3.0
    assert torch.isnan(nonfinite_terms_to_nan(loss, {"fape": torch.tensor(float("nan")), "chi": torch.tensor(2.0)}))
    assert torch.isnan(nonfinite_terms_to_nan(loss, {"x": torch.tensor(float("inf"))}))


def test_compiled_blocks_equal_eager():
    """torch.compile of the Evoformer / extra-MSA / template-pair blocks and the structure module (dynamo +
    AOTAutograd, the ``aot_eager`` backend: fast on CPU) traces every block without falling back, and
    forward outputs and parameter gradients equal the eager model's."""
    from torch import _dynamo

    eager, compiled = _tiny(), _tiny()
    eager.eval(), compiled.eval()  # no dropout: same function
    n_blocks = sum(len(getattr(compiled, s).blocks) for s in ("evoformer_stack", "extra_msa_stack",
                                                              "template_pair_stack"))  # fmt: skip
    n_blocks += 1  # the structure module, compiled whole (the loss region needs loss_fn: not given here)
    _dynamo.reset()
    _dynamo.utils.counters.clear()
    assert compile_blocks(compiled, BLOCK_REGIONS, backend="aot_eager") == n_blocks
    assert compile_blocks(compiled, BLOCK_REGIONS, backend="aot_eager") == 0  # idempotent
    batch = _batch()
    out_e, out_c = eager(batch), compiled(batch)
    frames = _dynamo.utils.counters["frames"]
    assert frames["ok"] >= 1 and frames["ok"] == frames["total"], dict(frames)  # compiled, no fallback
    for key, value in out_e.items():
        if value.is_floating_point():
            torch.testing.assert_close(out_c[key], value, rtol=1e-5, atol=1e-5, msg=key)
    (out_e["final_atom_positions"].sum() + out_e["distogram_logits"].mean()).backward()
    (out_c["final_atom_positions"].sum() + out_c["distogram_logits"].mean()).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is None:
            assert q.grad is None, name
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)

    # warm_up (what the loop runs before run_start) compiles the training-mode graphs, so a training
    # step afterwards compiles nothing new
    warm_up(compiled, batch)
    assert all(torch.count_nonzero(p.grad) == 0 for p in compiled.parameters() if p.grad is not None)
    compiled_frames = frames["ok"]
    compiled.train()
    out = compiled(batch)
    out["final_atom_positions"].sum().backward()
    assert frames["ok"] == compiled_frames == frames["total"]
    _dynamo.reset()


def test_compiled_training_step_with_loss_equals_eager():
    """Every block region (``BLOCK_REGIONS``), the loss included (``compile_blocks(..., loss_fn=...)``: the
    loss's ``compute_terms``), on the tiny training step's batch (``aot_eager``: dynamo + AOTAutograd,
    strict): the loss, every reported term and every parameter gradient equal the eager step's."""
    from torch import _dynamo

    from scalefold.compilation.regions import LOSS_REGION
    from scalefold.config.training import TrainConfig
    from scalefold.train.step import TrainingStep

    cfg = TrainConfig.from_preset("tiny", overrides={"precision": "fp32"}, env={})
    eager, compiled = TrainingStep.build(cfg), TrainingStep.build(cfg)  # same seed: same weights and batch
    _dynamo.reset()
    report = compile_blocks(compiled.model, BLOCK_REGIONS, backend="aot_eager", strict=True, loss_fn=compiled.loss_fn)
    assert set(report.regions) == set(BLOCK_REGIONS) and report.regions[LOSS_REGION] == 1
    again = compile_blocks(compiled.model, BLOCK_REGIONS, backend="aot_eager", loss_fn=compiled.loss_fn)
    assert again == 0  # idempotent
    batch = eager.sliced(1)  # one no-grad recycling pass, then the grad pass
    results = []
    for step in (eager, compiled):
        step.model.eval()  # no dropout: the same function
        loss, terms = step.loss_fn(step.model(batch), batch)
        loss.backward()
        results.append((loss, terms, {n: p.grad for n, p in step.model.named_parameters()}))
    (loss_e, terms_e, grads_e), (loss_c, terms_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert terms_c.keys() == terms_e.keys()
    for key, value in terms_e.items():
        torch.testing.assert_close(terms_c[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert sum(g is not None for g in grads_e.values()) > 0
    for name, grad in grads_e.items():
        if grad is None:
            assert grads_c[name] is None, name
        else:
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    stats = report.stats()
    assert stats["graph_breaks"] == 0 and stats["recompiles"] == 0, report.summary()
    _dynamo.reset()


def test_deterministic_setup_sets_the_cublas_workspace_config(monkeypatch):
    """--deterministic sets CUBLAS_WORKSPACE_CONFIG=:4096:8 when unset (cuBLAS raises in deterministic mode
    without it), before it enables deterministic algorithms; an explicit value is kept."""
    import os

    from scalefold.model.precision import CUBLAS_WORKSPACE_CONFIG, deterministic_environment, setup_precision

    was = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so the value set below is undone after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    try:
        setup_precision("fp32", deterministic=False)
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # only the deterministic path touches it
        setup_precision("fp32", deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    deterministic_environment(env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


def test_train_sets_the_cublas_workspace_config_before_the_runtime_starts(monkeypatch):
    """train(--deterministic) sets the variable before init_distributed selects (and initialises) the device."""
    import os

    from scalefold.config.training import TrainConfig
    from scalefold.train import trainer as loop

    class _Stop(Exception):
        pass

    seen = {}

    def fake_init_distributed(*args, **kwargs):
        seen["env"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        raise _Stop

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so the value set below is undone after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(loop, "init_distributed", fake_init_distributed)
    cfg = TrainConfig.from_preset("tiny", overrides={"deterministic": True}, env={})
    try:
        loop.train(cfg)
    except _Stop:
        pass
    assert seen["env"] == ":4096:8"
