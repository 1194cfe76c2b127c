"""Weights cast to bf16 once per forward (``scalefold.model.primitives.WeightCasts``): the step's outputs and
gradients are bit-identical to autocast casting them per pass and per recomputation, with fewer casts."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.features import make_synthetic_batch
from scalefold.model.primitives import Linear

N_RES, N_CLUST, N_EXTRA, N_TEMPL = 12, 4, 6, 2


class _Casts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_to_copy":
            self.ops["backward" if torch._C._current_autograd_node() is not None else "forward"] += 1
        return func(*args, **(kwargs or {}))


def _step(shared: bool, checkpointing: bool = True) -> tuple[dict, dict, Counter]:
    """One bf16-autocast step of the tiny model (two passes: one no-grad, the grad pass; dropout on):
    outputs, gradients and the casts, with the shared weight casts on or off."""
    torch.manual_seed(0)
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"evoformer_stack_config": {"num_blocks": 2}})
    model = AlphaFold(cfg, activation_checkpointing=checkpointing).train()
    if not shared:
        for m in model.modules():
            if isinstance(m, Linear):
                m.weight_casts = None
    batch = make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, seed=1)
    torch.manual_seed(1)
    with _Casts() as casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch)
            loss = sum(v.float().square().mean() for k, v in out.items() if k.endswith("logits")) + out["sm_positions"].float().mean()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, grads, casts.ops


def test_shared_weight_casts_are_bit_identical_and_fewer():
    out_ref, grad_ref, casts_ref = _step(shared=False)
    out, grad, casts = _step(shared=True)
    assert out.keys() == out_ref.keys() and grad.keys() == grad_ref.keys()
    for k in out_ref:
        assert torch.equal(out[k], out_ref[k]), k
    for k in grad_ref:
        assert torch.equal(grad[k], grad_ref[k]), k
    # the no-grad pass's and the recomputation's casts are gone, and so are the recomputation's in backward
    assert casts["forward"] < casts_ref["forward"]
    assert sum(casts.values()) < 0.75 * sum(casts_ref.values()), (casts, casts_ref)


def test_weight_casts_not_used_outside_the_models_forward():
    """A Linear called on its own after a forward casts as autocast does (no copy of an older weight)."""
    torch.manual_seed(0)
    model = AlphaFold(AlphaFoldConfig.from_preset("tiny")).eval()
    batch = make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=0, seed=1)
    lin = model.evoformer_stack.blocks[0].core.msa_transition.linear_2  # (linear_1 applies its ReLU)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(batch)
        lin.weight.data.mul_(2.0)  # through .data: no version bump
        x = torch.randn(3, lin.in_features)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_the_copies_go_with_the_backward_or_a_forward_without_grad():
    """After a training step's backward no copy of a weight that got its gradient is kept (the rest: weights
    the loss does not reach), and after a forward without grad none."""
    torch.manual_seed(0)
    model = AlphaFold(AlphaFoldConfig.from_preset("tiny"), activation_checkpointing=True).train()
    batch = make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
        assert model._weight_casts._casts  # made in the forward, kept for the recomputation
        loss = out["distogram_logits"].float().mean() + out["sm_positions"].float().mean()
    loss.backward()
    kept = [weight for weight, _, _ in model._weight_casts._casts.values()]
    assert all(w.grad is None for w in kept)
    assert len(kept) < len([p for p in model.parameters() if p.grad is not None])
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(batch)
    assert not model._weight_casts._casts


def test_a_blocks_weights_are_cast_together(monkeypatch):
    """Each block's weights cast in one go (``WeightCasts.group``): the same outputs and gradients, bit for bit, as
    each weight cast alone, in about half the casts (two kernels per block each way instead of one per weight)."""
    from scalefold.model.primitives import WeightCasts

    out, grad, casts = _step(shared=True)
    monkeypatch.setattr(WeightCasts, "group", lambda self, modules: None)
    out_alone, grad_alone, casts_alone = _step(shared=True)
    assert out.keys() == out_alone.keys() and grad.keys() == grad_alone.keys()
    for k in out:
        assert torch.equal(out[k], out_alone[k]), k
    for k in grad:
        assert torch.equal(grad[k], grad_alone[k]), k
    assert casts["forward"] < 0.6 * casts_alone["forward"] and casts["backward"] < 0.6 * casts_alone["backward"]
