"""Evoformer-family blocks against the MLPerf reference goldens, plus dropout, dtype, chunking and
activation-checkpointing behaviour of the stacks."""

from __future__ import annotations

import pytest
import torch

from scalefold.model.config import (
    AlphaFoldConfig,
    EvoformerStackConfig,
    ExtraMSAStackConfig,
    TemplatePairStackConfig,
    TemplatePointwiseAttentionConfig,
)
from scalefold.model.dropout import DropoutColumnwise, DropoutRowwise, shared_dropout_mask
from scalefold.model.evoformer import EvoformerBlock, EvoformerStack
from scalefold.model.extra_msa import ExtraMSABlock, ExtraMSAStack
from scalefold.model.template import TemplatePairBlock, TemplatePairStack, TemplatePointwiseAttention

GOLDEN_TOL = 1e-6  # float64 re-implementation; observed ~1e-15

# Reference config dicts (same keys as ``golden_small.pt["config"]``) with tiny dims, so the
# tests that need no goldens run anywhere.
TINY = {
    "evoformer_stack_config": dict(
        c_m=16,
        c_z=8,
        c_hidden_msa_att=4,
        c_hidden_opm=4,
        c_hidden_tri_mul=8,
        c_hidden_tri_att=4,
        c_s=12,
        num_heads_msa=2,
        num_heads_tri=2,
        num_blocks=2,
        transition_n=2,
        msa_dropout=0.15,
        pair_dropout=0.25,
        inf=1e9,
        eps_opm=1e-3,
        chunk_size_msa_att=None,
        chunk_size_opm=None,
        chunk_size_tri_att=None,
    ),
    "extra_msa_stack_config": dict(
        c_e=8,
        c_z=8,
        c_hidden_msa_att=4,
        c_hidden_opm=4,
        c_hidden_tri_mul=8,
        c_hidden_tri_att=4,
        num_heads_msa=2,
        num_heads_tri=2,
        num_blocks=1,
        transition_n=2,
        msa_dropout=0.15,
        pair_dropout=0.25,
        inf=1e9,
        eps=1e-8,
        eps_opm=1e-3,
        chunk_size_msa_att=None,
        chunk_size_opm=None,
        chunk_size_tri_att=None,
    ),
    "template_pair_stack_config": dict(
        c_t=8,
        c_hidden_tri_att=4,
        c_hidden_tri_mul=8,
        num_blocks=2,
        num_heads_tri=2,
        pair_transition_n=2,
        dropout_rate=0.25,
        inf=1e9,
        chunk_size_tri_att=None,
    ),
    "template_pointwise_attention_config": dict(c_t=8, c_z=8, c_hidden=4, num_heads=2, inf=1e5, chunk_size=None),
}


# A block is built from its stack's config (the stack-only fields, num_blocks and c_s, unused).
BLOCKS = {
    "evoformer_block": (EvoformerBlock, "evoformer_stack_config", EvoformerStackConfig),
    "extra_msa_block": (ExtraMSABlock, "extra_msa_stack_config", ExtraMSAStackConfig),
    "template_pair_block": (TemplatePairBlock, "template_pair_stack_config", TemplatePairStackConfig),
}


def _rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """Max abs error relative to ``max|b|``, or to ``floor`` when that is larger.

    The floor matters for gradients that are analytically zero (e.g. the bias of a LayerNorm whose
    output only enters softmax logits as a per-head constant): both sides are rounding noise there,
    whose pattern depends on thread count, so they are compared against the block's gradient scale."""
    scale = max(b.abs().max().item(), floor, torch.finfo(b.dtype).tiny)
    return ((a - b).abs().max() / scale).item()


def _valid_mask(name: str, key: str, inputs: dict) -> torch.Tensor:
    """0/1 mask of the output positions the reference defines (broadcast over channels)."""
    if key == "m":
        return inputs["msa_mask"][..., None]
    if key == "z":
        return inputs["pair_mask"][..., None]
    return inputs["mask"][:, None, :, :, None]  # t: [B, N_templ, N, N, c_t]


def _random_inputs(n_seq=5, n_extra=6, n_res=7, n_templ=2, dtype=torch.float64, seed=0):
    """Random MSA/pair/template activations and masks with padding, for the TINY dims."""
    g = torch.Generator().manual_seed(seed)
    evo, extra, tmpl = (
        TINY[k] for k in ("evoformer_stack_config", "extra_msa_stack_config", "template_pair_stack_config")
    )
    seq_mask = torch.ones(1, n_res)
    seq_mask[:, -2:] = 0
    msa_mask = (torch.rand(1, n_seq, n_res, generator=g) > 0.2).float() * seq_mask[:, None]
    extra_mask = (torch.rand(1, n_extra, n_res, generator=g) > 0.2).float() * seq_mask[:, None]
    return dict(
        m=torch.randn(1, n_seq, n_res, evo["c_m"], generator=g).to(dtype),
        e=torch.randn(1, n_extra, n_res, extra["c_e"], generator=g).to(dtype),
        z=torch.randn(1, n_res, n_res, evo["c_z"], generator=g).to(dtype),
        t=torch.randn(1, n_templ, n_res, n_res, tmpl["c_t"], generator=g).to(dtype),
        msa_mask=msa_mask,
        extra_mask=extra_mask,
        pair_mask=seq_mask[:, :, None] * seq_mask[:, None, :],
        template_mask=torch.tensor([[1.0, 0.0]])[:, :n_templ],
    )


# --------------------------------------------------------------------------------------------
# Golden equivalence with the MLPerf reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_matches_reference_golden(golden_modules, name):
    """In float64 train mode (dropout 0) the block loads the reference weights strictly and
    reproduces the reference outputs at valid positions, the input gradients and every parameter
    gradient of ``sum_k <outputs[k], cotangents[k]>`` to <= 1e-6 relative (observed ~1e-15)."""
    golden = golden_modules[name]
    cls, cfg_key, cfg_cls = BLOCKS[name]
    block = cls(cfg_cls(**golden_modules["config"][cfg_key]))
    block.load_state_dict(golden["state_dict"], strict=True)
    block = block.double().train()

    inputs = {k: v.clone() for k, v in golden["inputs"].items()}
    for k in golden["input_grads"]:
        inputs[k].requires_grad_(True)
    out = block(**inputs)
    out = out if isinstance(out, tuple) else (out,)
    outputs = dict(zip(golden["outputs"], out))

    for key, ref in golden["outputs"].items():
        valid = _valid_mask(name, key, inputs)
        assert outputs[key].shape == ref.shape
        assert _rel_err(outputs[key] * valid, ref * valid) <= GOLDEN_TOL, key

    scalar = sum((outputs[k] * golden["cotangents"][k]).sum() for k in outputs)
    scalar.backward()
    for key, ref in golden["input_grads"].items():
        assert _rel_err(inputs[key].grad, ref) <= GOLDEN_TOL, key
    params = dict(block.named_parameters())
    assert set(params) == set(golden["param_grads"])
    grad_scale = max(ref.abs().max().item() for ref in golden["param_grads"].values())
    for key, ref in golden["param_grads"].items():
        assert _rel_err(params[key].grad, ref, floor=1e-6 * grad_scale) <= GOLDEN_TOL, key


def test_stacks_load_golden_small_weights(golden_small):
    """The stacks built from the reference config dict's sub-configs hold exactly the reference
    parameter names and shapes (strict load of the golden model's weights)."""
    cfg, state = AlphaFoldConfig.from_dict(golden_small["config"]), golden_small["state_dict"]
    stacks = {
        "evoformer_stack": EvoformerStack(cfg.evoformer_stack_config),
        "extra_msa_stack": ExtraMSAStack(cfg.extra_msa_stack_config),
        "template_pair_stack": TemplatePairStack(cfg.template_pair_stack_config),
        "template_pointwise_attention": TemplatePointwiseAttention(cfg.template_pointwise_attention_config),
    }
    for prefix, module in stacks.items():
        sub = {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")}
        assert sub, prefix
        module.load_state_dict(sub, strict=True)


def test_parameter_names_shapes_order_match_initial_training_tsv(reference_dir):
    """At MLPerf initial-training size the stacks' state-dict names, shapes and order equal the
    reference's (``state_dict_initial_training.tsv``), so reference checkpoints load strictly and
    Adam state indices line up. Built on the meta device (no memory) from the config defaults,
    which are the MLPerf sizes."""
    rows = [line.split("\t") for line in (reference_dir / "state_dict_initial_training.tsv").read_text().splitlines()]
    with torch.device("meta"):
        stacks = {
            "template_pair_stack": TemplatePairStack(TemplatePairStackConfig()),
            "template_pointwise_attention": TemplatePointwiseAttention(TemplatePointwiseAttentionConfig()),
            "extra_msa_stack": ExtraMSAStack(ExtraMSAStackConfig()),
            "evoformer_stack": EvoformerStack(EvoformerStackConfig()),
        }
    for prefix, module in stacks.items():
        ours = [(f"{prefix}.{n}", str(tuple(t.shape))) for n, t in module.state_dict().items()]
        ref = [(r[0], r[1]) for r in rows if r[0].startswith(prefix + ".")]
        assert ours == ref, prefix


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------


def test_dropout_masks_are_shared_along_rows_or_columns():
    """Row-wise dropout uses one mask for all rows (dim -3), column-wise one for all columns
    (dim -2); kept entries are scaled by 1/(1-p); the mask function returns the broadcast shape."""
    torch.manual_seed(0)
    x = torch.ones(2, 6, 7, 16, dtype=torch.float64)
    p = 0.4

    row = DropoutRowwise(p).train()(x)
    assert torch.equal(row, row[:, :1].expand_as(row))  # identical across rows
    assert not torch.equal(row[..., :1, :], row[..., 1:2, :])  # but not across columns
    assert set(row.unique().tolist()) <= {0.0, 1.0 / (1 - p)}

    col = DropoutColumnwise(p).train()(x)
    assert torch.equal(col, col[:, :, :1].expand_as(col))
    assert not torch.equal(col[:, :1], col[:, 1:2])

    mask = shared_dropout_mask(x.shape, p, -3, x.device, x.dtype)
    assert mask.shape == (2, 1, 7, 16)


def test_dropout_is_identity_in_eval_and_at_rate_zero():
    """Eval mode and rate 0 return the input unchanged (and draw no random numbers)."""
    x = torch.randn(3, 4, 5, 6)
    for module in (DropoutRowwise(0.5).eval(), DropoutColumnwise(0.5).eval(), DropoutRowwise(0.0).train()):
        state = torch.get_rng_state()
        assert torch.equal(module(x), x)
        assert torch.equal(torch.get_rng_state(), state)


# --------------------------------------------------------------------------------------------
# Stacks: dtypes, chunking, checkpointing
# --------------------------------------------------------------------------------------------


def _run_all_stacks(stacks: dict, x: dict) -> dict:
    m, z, s = stacks["evoformer"](x["m"], x["z"], x["msa_mask"], x["pair_mask"])
    z_extra = stacks["extra_msa"](x["e"], x["z"], x["extra_mask"], x["pair_mask"])
    t = stacks["template_pair"](x["t"], x["pair_mask"])
    z_templ = stacks["template_pointwise"](t, x["z"], x["template_mask"])
    return dict(m=m, z=z, s=s, z_extra=z_extra, t=t, z_templ=z_templ)


def _build_stacks(seed: int = 0, checkpointing: bool = False, **overrides) -> dict:
    torch.manual_seed(seed)
    cfg = {k: dict(v, **overrides.get(k, {})) for k, v in TINY.items()}
    stacks = dict(
        evoformer=EvoformerStack(EvoformerStackConfig(**cfg["evoformer_stack_config"]), checkpointing),
        extra_msa=ExtraMSAStack(ExtraMSAStackConfig(**cfg["extra_msa_stack_config"])),
        template_pair=TemplatePairStack(TemplatePairStackConfig(**cfg["template_pair_stack_config"])),
        template_pointwise=TemplatePointwiseAttention(
            TemplatePointwiseAttentionConfig(**cfg["template_pointwise_attention_config"])
        ),
    )
    # Zero-initialised ("final") layers would hide most of the computation: perturb every weight.
    with torch.no_grad():
        for module in stacks.values():
            for p in module.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return stacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacks_smoke_forward_low_precision(dtype):
    """All stacks run in float32 and bf16 (dtype follows the inputs; float masks are accepted),
    in train mode with dropout, and return finite outputs of the expected shapes and dtype."""
    stacks = _build_stacks()
    for module in stacks.values():
        module.to(dtype).train()
    x = _random_inputs(dtype=dtype)
    out = _run_all_stacks(stacks, x)
    expected = dict(
        m=x["m"].shape,
        z=x["z"].shape,
        s=x["m"].shape[:1] + x["m"].shape[2:3] + (12,),
        z_extra=x["z"].shape,
        t=x["t"].shape,
        z_templ=x["z"].shape,
    )
    for key, value in out.items():
        assert value.shape == expected[key], key
        assert value.dtype == dtype, key
        assert torch.isfinite(value).all(), key


def test_chunking_does_not_change_results():
    """Chunk sizes for MSA attention, outer product mean, triangle attention and template
    pointwise attention only change memory use: float64 results equal the unchunked ones."""
    x = _random_inputs()
    plain = _build_stacks()
    chunks = dict(chunk_size_msa_att=2, chunk_size_opm=3, chunk_size_tri_att=2)
    chunked = _build_stacks(
        evoformer_stack_config=chunks,
        extra_msa_stack_config=chunks,
        template_pair_stack_config=dict(chunk_size_tri_att=3),
        template_pointwise_attention_config=dict(chunk_size=2),
    )
    results = []
    for stacks in (plain, chunked):
        for module in stacks.values():
            module.double().eval()
        with torch.no_grad():
            results.append(_run_all_stacks(stacks, x))
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], rtol=1e-12, atol=1e-12)


def test_activation_checkpointing_gives_identical_outputs_and_gradients():
    """Per-block activation checkpointing (float64, train mode with dropout active) leaves the
    outputs and all parameter/input gradients unchanged: recomputation replays the same dropout
    masks."""
    runs = []
    for checkpointing in (False, True):
        stacks = _build_stacks()
        for module in stacks.values():
            module.double().train()
            if hasattr(module, "checkpointing"):
                module.checkpointing = checkpointing
        x = _random_inputs()
        for key in ("m", "e", "z", "t"):
            x[key].requires_grad_(True)
        torch.manual_seed(1234)
        out = _run_all_stacks(stacks, x)
        loss = sum((v * torch.linspace(-1, 1, v.numel(), dtype=v.dtype).view_as(v)).sum() for v in out.values())
        loss.backward()
        grads = {f"{name}.{n}": p.grad for name, mod in stacks.items() for n, p in mod.named_parameters()}
        grads.update({f"input.{k}": x[k].grad for k in ("m", "e", "z", "t")})
        runs.append(({k: v.detach() for k, v in out.items()}, grads))
    (out_a, grads_a), (out_b, grads_b) = runs
    for key in out_a:
        torch.testing.assert_close(out_b[key], out_a[key], rtol=1e-12, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for key in grads_a:
        torch.testing.assert_close(grads_b[key], grads_a[key], rtol=1e-12, atol=1e-12)


def test_checkpointing_is_skipped_without_grad_or_in_eval(monkeypatch):
    """``checkpointing=True`` checkpoints every block in grad-enabled training, and is a no-op
    under ``torch.no_grad()`` and in eval mode (the reference only checkpoints the final,
    grad-enabled training iteration)."""
    import scalefold.model.memory as memory_module

    calls = []
    real_checkpoint = memory_module.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(memory_module, "checkpoint", counting_checkpoint)
    evo = _build_stacks(checkpointing=True)["evoformer"].double()
    x = _random_inputs()
    args = (x["m"], x["z"], x["msa_mask"], x["pair_mask"])

    with torch.no_grad():
        evo.train()(*args)
    evo.eval()(*args)
    evo.train()(*args, gradient_checkpointing=False)
    assert calls == []
    evo.train()(*args)
    assert len(calls) == len(evo.blocks)
