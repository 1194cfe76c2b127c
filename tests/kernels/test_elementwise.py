"""The elementwise chains: each compiled function equals its plain PyTorch reference, values and gradients,
and a training step with the chains compiled equals the eager step (dropout included)."""

from __future__ import annotations

import pytest
import torch

from scalefold import kernels
from scalefold.kernels import elementwise, reference


@pytest.fixture(autouse=True)
def _references_afterwards():
    yield
    elementwise.disable()


def _leaves(*shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(*s, dtype=dtype).requires_grad_() for s in shapes]


def _mask(shape, share_dim):
    mask_shape = list(shape)
    mask_shape[share_dim] = 1
    return torch.nn.functional.dropout(torch.ones(mask_shape), p=0.25, training=True)


CASES = {  # chain -> (call through the dispatch point, tensor shapes): the model's broadcast patterns, small
    "dropout_add rows": (lambda x, u: kernels.dropout_add(x, u, _mask(u.shape, -3)), [(2, 5, 6, 8)] * 2),
    "dropout_add columns (update transposed)": (
        lambda x, u: kernels.dropout_add(x, u.transpose(-2, -3), _mask(x.shape, -2)), [(3, 6, 6, 8)] * 2),
    "sigmoid_gate": (lambda x, g: kernels.sigmoid_gate(x, g), [(2, 3, 4, 5, 8)] * 2),
    "sigmoid_gate broadcast": (lambda x, g: kernels.sigmoid_gate(x, g), [(4, 1, 2, 8), (4, 5, 2, 8)]),
    "gated_projection": (lambda g, p, m: kernels.gated_projection(g, m.sigmoid(), p), [(2, 6, 6, 8)] * 2 + [(2, 6, 6, 1)]),
    "attention (softmax glue, gate)": (
        lambda q, k, v, b, g: kernels.attention(q, k, v, bias=b, mask=torch.ones(3, 1, 1, 7).tril(3)[..., :7] > 0,
                                                gate=g, inf=1e5, backend="torch"),
        [(3, 2, 7, 4), (3, 2, 7, 4), (3, 2, 7, 4), (1, 2, 7, 7), (3, 2, 7, 4)]),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_chain_equals_reference(case, backend):
    """Values and gradients of the compiled chain (inductor: the generated code itself) equal the reference's."""
    fn, shapes = CASES[case]
    results = []
    for mode in (None, backend):
        inputs = _leaves(*shapes)
        torch.manual_seed(1)  # the same dropout mask for both
        with elementwise.mode(mode):
            assert elementwise.enabled() == (mode is not None)
            out = fn(*inputs)
        out.square().sum().backward()
        results.append((out, [t.grad for t in inputs]))
    (out_r, grads_r), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_r, rtol=1e-5, atol=1e-6)
    for g_c, g_r in zip(grads_c, grads_r):
        torch.testing.assert_close(g_c, g_r, rtol=1e-5, atol=1e-6)


def test_mode_switches_and_restores():
    # mode() keeps the chain selection of the last enable() (bench step's compiled cycles rely on it), which an
    # earlier test in the same process may have left: start from every chain
    elementwise.enable("aot_eager", elementwise.CHAINS)
    elementwise.disable()
    assert not elementwise.enabled() and elementwise.chain("sigmoid_gate") is reference.sigmoid_gate
    with elementwise.mode("aot_eager"):
        assert elementwise.chain("sigmoid_gate") is not reference.sigmoid_gate
        with elementwise.mode(None):
            assert elementwise.chain("sigmoid_gate") is reference.sigmoid_gate
        assert elementwise.enabled()
    assert not elementwise.enabled()


def test_reference_attention_is_the_glue_in_order():
    """The reference attention after the split into glue functions: the same numbers as written out."""
    q, k, v, b, g = _leaves((2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4), (1, 3, 5, 5), (2, 3, 5, 4), dtype=torch.float64)
    mask = torch.rand(2, 1, 1, 5) > 0.3
    a = (q / 2.0) @ k.transpose(-1, -2) + (mask.double() - 1.0) * 1e9 + b
    want = torch.softmax(a, -1) @ v * torch.sigmoid(g)
    torch.testing.assert_close(reference.attention(q, k, v, bias=b, mask=mask, gate=g), want, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_step_with_compiled_chains_equals_eager(precision):
    """One training step (a no-grad recycling pass, the grad pass, dropout on) with the Evoformer's elementwise
    chains compiled (``aot_eager``: dynamo + AOTAutograd, cheap on the CPU) gives the eager step's loss and
    gradients: the dropout masks are drawn outside the compiled functions, from the same random stream. (The
    structure module's geometry chains, fp32 in every precision, both grad modes: test_geometry_chains.py's
    structure module test -- compiled here too they cost ~3/4 of this test's compile time.)"""
    from scalefold.config.training import TrainConfig
    from scalefold.model.dropout import SharedDropout
    from scalefold.train.step import TrainingStep

    cfg = TrainConfig.from_preset("tiny", overrides={"precision": precision}, env={})
    chains = tuple(c for c in elementwise.CHAINS if c not in elementwise.GEOMETRY_CHAINS)
    before = dict(elementwise._state)
    elementwise.enable("aot_eager", chains)  # the selection mode() compiles
    elementwise.disable()
    results = []
    try:
        for mode in (None, "aot_eager"):
            step = TrainingStep.build(cfg)
            for module in step.model.modules():  # the tiny preset has no dropout: switch it on
                if isinstance(module, SharedDropout):
                    module.p = 0.2
            torch.manual_seed(3)
            with elementwise.mode(mode):
                assert elementwise.chain("gated_projection") is not reference.gated_projection or mode is None
                loss, _ = step.forward_loss(step.sliced(1))
                step.backward(loss)
            results.append((loss.detach(), step.opt.grad_buffers()))
    finally:
        elementwise._state.update(before)
    (loss_e, grads_e), (loss_c, grads_c) = results
    tol = {"rtol": 1e-5, "atol": 1e-6} if precision == "fp32" else {"rtol": 2e-2, "atol": 1e-3}
    torch.testing.assert_close(loss_c, loss_e, **tol)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e, **tol)
