"""The launch counter (``scalefold.perf.flops.OpCounter``, what ``estimate-step`` reports) agrees with an
independent count kept here, outside the project: a dispatch mode that calls an operator a launch when, at run
time, it returned a tensor on storage none of its inputs had (not a bare allocation) or handed back one of its
inputs (in place, ``out=``) -- no schema, no tags, no list of views. On the PyTorch path of a training step of
the tiny model (fp32, forward and backward, the gradients written into the optimizer's flat buffer by the
blocks' backward), operator by operator."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.features import make_synthetic_batch
from scalefold.optim.adam_swa import FlatAdamSWA
from scalefold.optim.grad_slots import attach_grad_slots
from scalefold.perf.flops import OpCounter

#: Allocations without a kernel; ``lift_fresh``: a ``torch.tensor(...)`` constant handed to the graph (its copy
#: is ``torch.tensor``'s, before any operator).
_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"})


class _Independent(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        in_place = any(o is i for o in outputs for i in inputs)
        fresh = any(t.untyped_storage().data_ptr() not in storages for t in outputs)
        if func.namespace in ("aten", "scalefold") and name not in _NO_KERNEL and (in_place or fresh):
            self.ops[name] += 1
        return out


def test_the_launch_counter_agrees_with_an_independent_count():
    torch.manual_seed(0)
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"evoformer_stack_config": {"num_blocks": 1}})
    model = AlphaFold(cfg, activation_checkpointing=True).train()
    opt = FlatAdamSWA(list(model.named_parameters()))
    attach_grad_slots(model, opt)
    batch = make_synthetic_batch(8, 4, 6, 2, num_recycling_iters=0, seed=1)

    def step() -> None:
        opt.zero_grad()
        torch.manual_seed(1)
        out = model(batch)
        sum(v.square().mean() for k, v in out.items() if k.endswith("logits")).backward()

    step()  # warm: the slots' zeros and the constant tables are made once
    with OpCounter({"": model}) as counter:
        step()
    with _Independent() as independent:
        step()
    counted: Counter[str] = Counter()
    for (_, op), k in counter.ops.items():
        counted[op] += k
    assert counted == independent.ops
    assert counted["add_"] < 0.5 * len(opt.params)  # the blocks' gradients: no accumulation launch each
    assert sum(counted.values()) > 1000
