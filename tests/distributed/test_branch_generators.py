"""The Parallel Evoformer's branch generators (issue 39): each branch draws its dropout from its own generator,
seeded with the step's forward seed before the step, so a capture of the whole step holds them (a replay
advances them as eager does) and nothing inside the step reseeds on the host; unseeded (a model called
directly) each block reseeds them from the global stream as before, exactly the old masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scalefold.compilation.emulated_capture import CaptureRefused, record
from scalefold.distributed.branch_parallel import model_branch_generators, seed_forward
from scalefold.model.config import AlphaFoldConfig
from scalefold.model.dropout import drawing_from, shared_dropout_mask
from scalefold.model.evoformer import EvoformerStack

pytestmark = pytest.mark.usefixtures("one_thread")


def _stack() -> tuple[EvoformerStack, tuple[torch.Tensor, ...]]:
    cfg = AlphaFoldConfig.from_preset("demo").evoformer_stack_config  # tiny has no dropout
    torch.manual_seed(0)
    stack = EvoformerStack(cfg, parallel=True).train()
    with torch.no_grad():  # AlphaFold's zero-initialised output layers would hide every dropout mask
        for p in stack.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    g = torch.Generator().manual_seed(1)
    m, z = torch.randn(3, 8, cfg.c_m, generator=g), torch.randn(8, 8, cfg.c_z, generator=g)
    return stack, (m, z, torch.ones(3, 8), torch.ones(8, 8))


def _out(stack: EvoformerStack, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    m, z, s = stack(*inputs)
    return torch.cat([m.reshape(-1), z.reshape(-1), s.reshape(-1)])


def test_a_branch_generator_draws_f_dropouts_masks_on_the_cpu():
    """Unseeded blocks reseed a branch's generator with the old seeds: the same masks as the old reseeding of the
    global generator under ``F.dropout`` (so unseeded runs keep their numbers)."""
    torch.manual_seed(7)
    old = F.dropout(torch.ones(2, 1, 5, 4), p=0.25, training=True)
    with drawing_from(torch.Generator().manual_seed(7)):
        new = shared_dropout_mask((2, 3, 5, 4), 0.25, -3, torch.device("cpu"), torch.float32)
    assert torch.equal(old, new)


def test_step_seeded_branches_follow_the_seed_and_leave_the_global_stream_alone():
    stack, inputs = _stack()
    assert model_branch_generators(stack) == [stack.branch_generators]
    assert all(block.branch_generators is stack.branch_generators for block in stack.blocks)
    runs = {}
    for name, seed in (("a", 11), ("b", 11), ("c", 12)):
        seed_forward(seed, torch.device("cpu"), [stack.branch_generators])
        runs[name] = _out(stack, inputs)
    assert torch.equal(runs["a"], runs["b"]) and not torch.equal(runs["a"], runs["c"])
    seed_forward(11, torch.device("cpu"), [stack.branch_generators])
    before = torch.get_rng_state()
    _out(stack, inputs)
    assert torch.equal(before, torch.get_rng_state())  # every Evoformer dropout drew from a branch generator


def test_a_capture_holds_the_branch_generators_and_refuses_the_unseeded_reseeding():
    stack, inputs = _stack()
    with pytest.raises(CaptureRefused, match="device-to-host read") as refused:
        record(lambda: _out(stack, inputs))  # unseeded: each block draws its seeds on the host
    assert "branch_parallel.py" in refused.value.where
    generators = stack.branch_generators
    seed_forward(5, torch.device("cpu"), [generators])
    graph = record(lambda: _out(stack, inputs))
    for seed in (5, 6):  # each replay draws from the generators' state at replay time, as eager does
        seed_forward(seed, torch.device("cpu"), [generators])
        replayed = graph.replay().clone()
        states = [g.get_state() for g in generators.generators()]
        seed_forward(seed, torch.device("cpu"), [generators])
        assert torch.equal(replayed, _out(stack, inputs))
        assert all(torch.equal(a, g.get_state()) for a, g in zip(states, generators.generators()))

