"""Launches as the chosen path executes them (``scalefold.perf.flops.OpCounter``): views are none, an operator
one, a compiled elementwise chain one forward and one backward with the bytes at its boundary."""

from __future__ import annotations

import torch

from scalefold import kernels
from scalefold.kernels import elementwise
from scalefold.model.config import AlphaFoldConfig
from scalefold.model.evoformer import EvoformerBlock
from scalefold.perf.flops import LAUNCHES, MM, OpCounter


def _total(counter: OpCounter, field: int) -> int:
    return sum(v[field] for v in counter.counts.values())


def test_views_and_allocations_are_not_launches():
    x = torch.randn(4, 6)
    with OpCounter({}) as counter:
        y = x.reshape(24)[:5].unsqueeze(0).transpose(0, 1).t()  # views
        torch.empty(3)
        z = y + 1  # one kernel
        x.t().contiguous()  # a copy: one kernel
    assert _total(counter, LAUNCHES) == 2
    assert dict(counter.ops) == {("forward", "add"): 1, ("forward", "clone"): 1}
    assert z.shape == (1, 5)
    # the launch profile holds each launch's bytes: add reads 5 floats and writes 5; the copy 24 and 24
    profile = counter.profile["forward", "<step>"]
    assert profile == {(0, 0, 0, 40, 1): 1, (0, 0, 0, 192, 1): 1}


def _gate(record: bool) -> OpCounter:
    x = torch.randn(2, 3, 4, 8, requires_grad=True)
    g = torch.randn(2, 3, 4, 8, requires_grad=True)
    with OpCounter({}) as counter:
        ctx = elementwise.recording(counter.chain_started, counter.chain_finished) if record else elementwise.mode(None)
        with ctx:
            out = kernels.sigmoid_gate(x, g)
        out.backward(torch.ones_like(out))
    return counter


def test_a_compiled_chain_is_one_launch_each_way_at_its_boundary():
    eager, fused = _gate(False), _gate(True)
    assert fused.ops["forward", "chain:sigmoid_gate"] == 1
    assert fused.ops["backward", "chain:sigmoid_gate_backward"] == 1
    assert ("forward", "sigmoid") in eager.ops and ("forward", "sigmoid") not in fused.ops
    assert not any(op.endswith("_backward") and not op.startswith("chain:") for _, op in fused.ops)
    # the same arithmetic
    assert _total(fused, 3) == _total(eager, 3)
    # forward: x and g read, the output written (3 x 192 floats); backward: the output's gradient, x and g
    # read, both gradients written (5 x 192)
    nbytes = 2 * 3 * 4 * 8 * 4
    assert fused.profile["forward", "<step>"][(0, 0, 0, 3 * nbytes, 1)] == 1
    assert fused.profile["backward", "<step>"][(0, 0, 0, 5 * nbytes, 1)] == 1
    assert _total(fused, LAUNCHES) < _total(eager, LAUNCHES)


def _block(record: bool) -> OpCounter:
    cfg = AlphaFoldConfig.from_preset("tiny").evoformer_stack_config
    torch.manual_seed(0)
    block = EvoformerBlock(cfg).train()
    m = torch.randn(1, 5, 7, cfg.c_m, requires_grad=True)
    z = torch.randn(1, 7, 7, cfg.c_z, requires_grad=True)
    msa_mask, pair_mask = torch.ones(1, 5, 7), torch.ones(1, 7, 7)
    with OpCounter({"block": block}) as counter:
        ctx = elementwise.recording(counter.chain_started, counter.chain_finished) if record else elementwise.mode(None)
        with ctx:
            m2, z2 = block(m, z, msa_mask, pair_mask)
        (m2.sum() + z2.sum()).backward()
    return counter


def test_an_evoformer_block_with_compiled_chains_launches_less_for_the_same_flops():
    eager, fused = _block(False), _block(True)
    for i in MM:
        assert _total(fused, i) == _total(eager, i)
    assert _total(fused, LAUNCHES) < _total(eager, LAUNCHES)
    assert _total(fused, 4) + _total(fused, 5) < _total(eager, 4) + _total(eager, 5)
    chains = {op for _, op in fused.ops if op.startswith("chain:")}
    assert {"chain:sigmoid_gate", "chain:gated_projection", "chain:masked_softmax"} <= chains
    # every launch is in the profile, with its matrix FLOPs
    launches = sum(calls * sig[-1] for prof in fused.profile.values() for sig, calls in prof.items())
    assert launches == _total(fused, LAUNCHES)
    assert sum(calls * sum(sig[:3]) for prof in fused.profile.values() for sig, calls in prof.items()) == sum(
        _total(fused, i) for i in MM
    )


def _backbone_update(record: bool) -> OpCounter:
    quats = torch.nn.functional.normalize(torch.randn(2, 5, 4), dim=-1)
    trans, update = torch.randn(2, 5, 3, requires_grad=True), torch.randn(2, 5, 6, requires_grad=True)
    grads = [torch.randn(2, 5, *shape) for shape in ((4,), (3,), (3, 3), (3,))]
    with OpCounter({}) as counter:
        ctx = elementwise.recording(counter.chain_started, counter.chain_finished) if record else elementwise.mode(None)
        with ctx:
            outs = elementwise.chain("backbone_update")(quats, trans, update, 10.0)
        torch.autograd.backward(outs, grads)
    return counter


def test_a_chain_with_several_outputs_is_one_launch_each_way_writing_them_all():
    eager, fused = _backbone_update(False), _backbone_update(True)
    assert fused.ops["forward", "chain:backbone_update"] == 1
    assert fused.ops["backward", "chain:backbone_update_backward"] == 1
    # besides the chain, only the autograd engine's accumulation of a leaf's gradient
    assert {op for _, op in fused.ops if not op.startswith("chain:")} <= {"copy_"}
    assert _total(fused, LAUNCHES) < _total(eager, LAUNCHES)
    # forward: quats, trans, update read; new quats [4], trans [3], rotation matrices [9], scaled trans [3]
    # written. Backward: the 4 outputs' gradients and the inputs read, trans's and update's gradients written
    rows = 2 * 5 * 4
    inputs, outputs, grads = rows * (4 + 3 + 6), rows * (4 + 3 + 9 + 3), rows * (3 + 6)
    assert fused.profile["forward", "<step>"] == {(0, 0, 0, inputs + outputs, 1): 1}
    assert fused.profile["backward", "<step>"][(0, 0, 0, outputs + inputs + grads, 1)] == 1


def _structure_module(record: bool) -> OpCounter:
    from scalefold.model.structure_module import StructureModule

    cfg = AlphaFoldConfig.from_preset("tiny").structure_module_config
    torch.manual_seed(0)
    module = StructureModule(cfg)
    s, z = torch.randn(1, 7, cfg.c_s, requires_grad=True), torch.randn(1, 7, 7, cfg.c_z, requires_grad=True)
    mask, aatype = torch.ones(1, 7), torch.randint(0, 21, (1, 7))
    with OpCounter({"structure_module": module}) as counter:
        ctx = elementwise.recording(counter.chain_started, counter.chain_finished) if record else elementwise.mode(None)
        with ctx:
            out = module(s, z, mask, aatype)
        sum(v.sum() for v in out.values()).backward()
    return counter


def test_the_structure_module_with_compiled_geometry_launches_a_fraction():
    """The side chains, frame updates and IPA's point work: hundreds of small kernels per block iteration
    eagerly, a handful of chains compiled (the Linear layers and IPA's matmuls remain)."""
    eager, fused = _structure_module(False), _structure_module(True)
    for i in MM:
        assert _total(fused, i) == _total(eager, i)
    assert _total(fused, 3) == _total(eager, 3)  # the same elementwise arithmetic
    assert _total(fused, LAUNCHES) * 5 < _total(eager, LAUNCHES)
    chains = {op for _, op in fused.ops if op.startswith("chain:")}
    assert {f"chain:{name}" for name in elementwise.GEOMETRY_CHAINS} <= chains
