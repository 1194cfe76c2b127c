"""Activation checkpointing with dropout on, without the RNG state (scalefold.model.memory.run_block): the
recomputation takes the forward's masks from the block's MaskTape, so the gradients equal those without
checkpointing -- which turning ``preserve_rng_state`` off alone would silently break (new masks in the
recomputation) -- and no generator state is read or set, so a CUDA graph can capture it."""

from __future__ import annotations

import pytest
import torch

from scalefold.config.training import TrainConfig
from scalefold.model.dropout import MaskTape
from scalefold.train.step import TrainingStep

pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(checkpointing: str, seed: int = 11) -> tuple[TrainingStep, list[torch.Tensor], torch.Tensor]:
    cfg = TrainConfig.from_preset("demo", env={}, overrides={"activation_checkpointing": checkpointing, "crop_size": 24})
    step = TrainingStep.build(cfg)
    torch.manual_seed(seed)
    loss, _ = step.forward_loss(step.sliced(1))
    step.backward(loss)
    return step, [g.grad.clone() for g in step.opt.groups], torch.get_rng_state()


def test_gradients_with_checkpointing_equal_those_without_with_dropout_on():
    step, off, rng_off = _grads("off")
    assert step.model.checkpointed_blocks() == {} or not any(step.model.checkpointed_blocks().values())
    on_step, on, rng_on = _grads("on")
    assert any(on_step.model.checkpointed_blocks().values())
    assert any(m.p > 0 for m in on_step.model.modules() if hasattr(m, "share_dim"))  # dropout is on
    for a, b in zip(off, on):
        assert torch.equal(a, b)
    assert torch.equal(rng_off, rng_on)  # the recomputation drew nothing from the generator
    _, other, _ = _grads("on", seed=12)  # the masks matter: another seed, other gradients
    assert not all(torch.equal(a, b) for a, b in zip(on, other))


def test_redrawn_masks_would_be_caught():
    """The trap the tape avoids: a recomputation that draws new masks gives other gradients."""
    import scalefold.model.dropout as dropout

    _, taped, _ = _grads("on")
    real = MaskTape.take

    def redraw(self, draw, shape):  # what preserve_rng_state=False without the tape does
        return draw()

    MaskTape.take = redraw
    try:
        _, redrawn, _ = _grads("on")
    finally:
        MaskTape.take = real
    assert dropout.MaskTape.take is real
    assert not all(torch.equal(a, b) for a, b in zip(taped, redrawn))


def test_a_recomputation_that_strays_from_its_forward_is_an_error():
    tape = MaskTape()
    with tape.run():
        tape.take(lambda: torch.ones(2), (2,))
    with pytest.raises(RuntimeError, match="used 0 of the 1 dropout masks"):
        with tape.run():
            pass
    with pytest.raises(RuntimeError, match="drew more dropout masks"):
        with tape.run():
            tape.take(lambda: torch.ones(2), (2,))
            tape.take(lambda: torch.ones(2), (2,))
