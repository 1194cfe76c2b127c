"""``parallelize``: parallelism applied to the model's listed stacks through the typed seam, with no
process group needed to check what it sets (the collectives are tested in test_dap_model.py and
test_parallel_alphafold.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from scalefold.distributed.branch_parallel import Branches
from scalefold.distributed.group import DAPGroup
from scalefold.distributed.parallelize import ParallelModel, ParallelStack, parallelize
from scalefold.model import AlphaFold, AlphaFoldConfig


def _model(parallel: bool) -> AlphaFold:
    torch.manual_seed(0)
    return AlphaFold(AlphaFoldConfig.from_preset("tiny"), parallel_evoformer=parallel)


def test_alphafold_lists_its_three_stacks():
    model = _model(parallel=False)
    assert isinstance(model, ParallelModel)
    stacks = model.parallel_stacks()
    assert stacks == [model.template_pair_stack, model.extra_msa_stack, model.evoformer_stack]
    assert all(isinstance(s, ParallelStack) for s in stacks)
    assert [s.branch_parallel for s in stacks] == [False, False, False]


def test_sets_the_groups_on_the_stacks_and_scales_their_gradients():
    """DAP 2 x BP 2: every stack gets the DAP group, only the Parallel Evoformer the BP pair; the
    grad factor is 2 on the stacks' block parameters, 4 on the branch-owned ones, 1 elsewhere."""
    model = _model(parallel=True)
    group, pair = DAPGroup(group=None, size=2, rank=0), Branches(group=None, branch=0, owners=(0, 1))
    hooks = parallelize(model, dap_group=group, branch=pair, dap=2, bp=2)
    assert all(s.dap_group is group for s in model.parallel_stacks())
    assert model.evoformer_stack.branch is pair
    assert model.extra_msa_stack.branch is None and model.template_pair_stack.branch is None

    for p in model.parameters():
        p.grad = None
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    factors = {name: p.grad.flatten()[0].item() for name, p in model.named_parameters()}
    assert factors["evoformer_stack.blocks.0.msa_att_row.mha.linear_q.weight"] == 4.0
    assert factors["evoformer_stack.blocks.0.core.tri_mul_in.linear_z.weight"] == 4.0
    assert factors["evoformer_stack.blocks.0.core.outer_product_mean.linear_1.weight"] == 2.0  # both branches
    assert factors["extra_msa_stack.blocks.0.core.outer_product_mean.linear_1.weight"] == 2.0
    assert factors["template_pair_stack.blocks.0.tri_mul_out.linear_z.weight"] == 2.0
    assert factors["evoformer_stack.linear.weight"] == 1.0  # after the exit gather: replicated
    assert factors["structure_module.linear_in.weight"] == 1.0
    assert len(hooks) == sum(1 for v in factors.values() if v != 1.0)


def test_refuses_what_it_cannot_parallelize():
    with pytest.raises(ValueError, match="--bp 2 needs --parallel-evoformer"):
        parallelize(_model(parallel=False), dap_group=None, branch=None, dap=1, bp=2)
    with pytest.raises(TypeError, match="Linear lists no parallel stacks"):
        parallelize(nn.Linear(2, 2), dap_group=DAPGroup(group=None, size=2, rank=0), branch=None, dap=2, bp=1)
    assert parallelize(nn.Linear(2, 2), dap_group=None, branch=None, dap=1, bp=1) == []
    with pytest.raises(ValueError, match="Branch Parallelism needs the Parallel Evoformer"):
        _model(parallel=False).extra_msa_stack.set_parallelism(None, Branches(group=None, branch=0, owners=(0, 1)))
