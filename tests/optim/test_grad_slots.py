"""Gradients written into the optimizer's flat buffer by each block's own backward
(``scalefold.optim.grad_slots``): bit for bit autograd's accumulation, without its ``add_`` per parameter;
the slow path where a group cannot take it, said in one line."""

from __future__ import annotations

import contextlib
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from scalefold.config.training import TrainConfig
from scalefold.distributed import setup_model_parallel
from scalefold.distributed.launch import run_processes
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.factory import build_model_config
from scalefold.model.features import make_synthetic_batch
from scalefold.model.primitives import Linear, WeightCasts
from scalefold.optim.adam_swa import FlatAdamSWA
from scalefold.optim.clipping import GradClipper
from scalefold.optim.flat_reduce import FlatGradReducer
from scalefold.optim.grad_slots import attach_grad_slots, weight_cast_sets
from scalefold.train.step import TrainingStep, forward_seed, recycling_count, synthetic_batch, training_model

INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}


class _Ops(TorchDispatchMode):
    """Operators dispatched, by name (an independent count, not the project's launch counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _tiny_step(slots: bool, dtype: torch.dtype, autocast: bool) -> tuple[torch.Tensor, Counter, list[str]]:
    """One step of the tiny model (one Evoformer block, a no-grad recycling pass, checkpointing, dropout):
    the flat gradient buffer, the operators dispatched (with the slots) and the slots' report."""
    torch.manual_seed(0)
    cfg = AlphaFoldConfig.from_preset("tiny", overrides={"evoformer_stack_config": {"num_blocks": 1}})
    model = AlphaFold(cfg, activation_checkpointing=True).train().to(dtype)
    opt = FlatAdamSWA(list(model.named_parameters()))
    lines: list[str] = []
    if slots:
        attach_grad_slots(model, opt, lines.append)
    batch = make_synthetic_batch(8, 3, 4, 2, num_recycling_iters=1, seed=1)
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    torch.manual_seed(1)
    with _Ops() if slots else contextlib.nullcontext(_Ops()) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(batch)
            loss = sum(v.float().square().mean() for k, v in out.items() if k.endswith("logits"))
            loss = loss + out["sm_positions"].float().mean()
        loss.backward()
    return torch.cat([g.grad for g in opt.groups]).clone(), counter.ops, lines


@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, False), (torch.float64, False), (torch.float32, True)],
                         ids=["fp32", "fp64", "bf16-autocast"])  # fmt: skip
def test_the_blocks_write_their_gradients_bit_for_bit_without_an_add_per_parameter(dtype, autocast):
    ref, _, _ = _tiny_step(False, dtype, autocast)
    got, ops, lines = _tiny_step(True, dtype, autocast)
    assert torch.equal(got.view(INT_OF[dtype]), ref.view(INT_OF[dtype]))  # bit for bit, signs of zeros included
    assert ref.abs().sum() > 0
    # autograd's accumulation ran once per parameter (~300) before; now for the one outside the groups (IPA's
    # head weights) and the activations' gradients that meet in place; one add_ per group and run instead
    assert lines == ["gradients: 335 of 336 parameters written into the flat buffer by their block's backward; 1 takes "
                     "autograd's accumulation (the slow path: one add_ each), e.g. structure_module.ipa.head_weights"]
    assert ops["add_"] < 70, ops["add_"]
    assert ops["index_add_"] >= 1  # a group over several runs of slots (LayerNorm weights spread over a block)


class _Net(nn.Module):
    """Two grouped ``Linear`` layers and a user's own module (torch's ``nn.Linear``, outside the groups)."""

    def __init__(self, extra: nn.Module | None = None) -> None:
        super().__init__()
        self.a, self.b, self.user = Linear(5, 8), Linear(8, 3, init="relu"), nn.Linear(3, 2)
        self.extra = extra
        self.casts = WeightCasts()
        for m in (self.a, self.b, extra):
            if isinstance(m, Linear):
                m.weight_casts = self.casts
        self.casts.group([self.a, self.b] + ([extra] if extra is not None else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.casts.begin()
        try:
            h = self.b(torch.relu(self.a(x)))
            h = h + self.extra(h) if self.extra is not None else h
            return self.user(h)
        finally:
            self.casts.end()


def _train(net: _Net, opt: FlatAdamSWA, steps: int = 2) -> list[torch.Tensor]:
    grads = []
    for k in range(steps):
        opt.zero_grad()
        torch.manual_seed(k)
        net(torch.randn(4, 5, dtype=torch.float64)).square().sum().backward()
        grads.append(torch.cat([g.grad for g in opt.groups]).clone())
        opt.step(torch.ones((), dtype=torch.float64))
    return grads


def test_a_users_module_trains_on_the_slow_path_said_in_one_line():
    torch.manual_seed(0)
    ref_net = _Net().double()
    net = _Net().double()
    net.load_state_dict(ref_net.state_dict())
    ref_opt, opt = FlatAdamSWA(list(ref_net.named_parameters())), FlatAdamSWA(list(net.named_parameters()))
    lines: list[str] = []
    attach_grad_slots(net, opt, lines.append)
    assert lines == ["gradients: 4 of 6 parameters written into the flat buffer by their block's backward; 2 take "
                     "autograd's accumulation (the slow path: one add_ each), e.g. user.weight, user.bias"]  # fmt: skip
    arrived: list[str] = []  # post-accumulate hooks (the flat reducer's arrivals) still run, after the write
    net.a.weight.register_post_accumulate_grad_hook(lambda p: arrived.append(float(p.grad.abs().sum())))
    for got, ref in zip(_train(net, opt), _train(ref_net, ref_opt)):
        assert torch.equal(got, ref)
    assert len(arrived) == 2 and all(a > 0 for a in arrived)
    assert torch.equal(torch.cat([g.master for g in opt.groups]), torch.cat([g.master for g in ref_opt.groups]))


def test_a_group_with_a_parameter_outside_the_buffer_or_a_hook_takes_the_slow_path():
    torch.manual_seed(0)
    extra = Linear(3, 3, init="relu")  # added to the model, not given to the optimizer
    net = _Net(extra).double()
    ref_net = _Net(Linear(3, 3)).double()
    ref_net.load_state_dict(net.state_dict())
    named = [(n, p) for n, p in net.named_parameters() if not n.startswith("extra.")]
    opt = FlatAdamSWA(named)
    ref_opt = FlatAdamSWA([(n, p) for n, p in ref_net.named_parameters() if not n.startswith("extra.")])
    slots = attach_grad_slots(net, opt)
    for got, ref in zip(_train(net, opt), _train(ref_net, ref_opt)):
        assert torch.equal(got, ref)
    assert slots.fallbacks == ["a (3, 3) parameter outside the optimizer"]
    assert extra.weight.grad is not None and torch.equal(extra.weight.grad, ref_net.extra.weight.grad)
    # a tensor hook (the DAP/BP gradient factors of --grad-reduce ddp) on a member: autograd's path, hook applied
    net2 = _Net().double()
    net2.load_state_dict(ref_net.state_dict(), strict=False)
    opt2 = FlatAdamSWA(list(net2.named_parameters()))
    attach_grad_slots(net2, opt2)
    net2.a.weight.register_hook(lambda g: g * 2)
    opt2.zero_grad()
    x = torch.randn(4, 5, dtype=torch.float64)
    net2(x).square().sum().backward()
    twice = net2.a.weight.grad.clone()
    net2.a.weight._backward_hooks.clear()
    opt2.zero_grad()
    net2(x).square().sum().backward()
    assert torch.equal(twice, 2 * net2.a.weight.grad)
    # torch.autograd.grad: the gradients go to its caller, .grad stays as it is
    opt2.zero_grad()
    (dw,) = torch.autograd.grad(net2(x).square().sum(), [net2.b.weight])
    assert not any(g.grad.any() for g in opt2.groups)
    net2(x).square().sum().backward()
    assert torch.equal(dw, net2.b.weight.grad) and dw.abs().sum() > 0


def test_the_training_step_attaches_the_slots():
    cfg = TrainConfig.from_preset("tiny", env={})
    step = TrainingStep.build(cfg)
    (casts,) = weight_cast_sets(step.model)
    assert casts.slots is not None and casts.slots.holds(step.opt.params[-1])


def _ddp_grads(rank: int, world: int, slots: bool) -> list[torch.Tensor]:
    cfg = TrainConfig.from_preset("tiny", env={})
    ctx = setup_model_parallel(dap=1, bp=1)
    model = ctx.wrap(training_model(cfg, build_model_config(cfg)), grad_hooks=True)
    step = TrainingStep.build(cfg, model=model, batch=synthetic_batch(cfg.replace(seed=cfg.seed + rank), model))
    if not slots:
        for casts in weight_cast_sets(model):
            casts.slots = None
    step.clipper = GradClipper(max_norm=cfg.clip_grad_max_norm, process_group=ctx.train_group)
    step.group, step.world_size = ctx.train_group, ctx.num_train_ranks
    if slots == "flat":
        reducer = FlatGradReducer(step.opt, ctx.train_group, overlap=True, bucket_bytes=1 << 15)
        step.reduce = lambda: reducer.reduce_and_clip(step.clipper)
    else:
        step.model = torch.nn.parallel.DistributedDataParallel(model, process_group=ctx.train_group,
                                                               gradient_as_bucket_view=False)  # fmt: skip
        step.clipper.register(step.model)
        step.reduce = step.clipper.compute
    grads = []
    for k in range(1, 3):
        torch.manual_seed(forward_seed(cfg.seed, rank, k))
        result = step.compute(step.sliced(recycling_count(cfg.seed, k, step.num_ensembles)))
        step.settle(result.read(world))
        grads.append(torch.cat([g.grad for g in step.opt.groups]).clone())
    return grads


def _compare_ddp(rank: int, world: int, out: str) -> None:
    ref = _ddp_grads(rank, world, False)
    got = _ddp_grads(rank, world, True)
    flat = _ddp_grads(rank, world, "flat")
    same = [torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, ref)]
    first_flat = torch.equal(flat[0].view(torch.int32), ref[0].view(torch.int32))
    gathered = [None] * world
    dist.all_gather_object(gathered, [same, first_flat])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


@pytest.mark.distributed
def test_ddp_and_the_flat_reducer_see_the_same_buffer(tmp_path):
    """DP-2 (gloo): DDP with the slots reduces the gradients of DDP without them bit for bit, two steps; the flat
    reducer (small buckets, issued from backward's hooks) the first step's too."""
    out = tmp_path / "same.json"
    run_processes(_compare_ddp, 2, str(out))
    assert json.loads(out.read_text()) == [[[True, True], True]] * 2
