"""Whole AlphaFold (tiny preset, float64, dropout on, recycling, activation checkpointing) under
DAP / BP / BP x DAP equals the single-rank model: outputs, loss and every parameter gradient after
``ParallelContext.sync_grads``. The context, the batch broadcast and the grad factors are the ones
the training loop uses."""

from __future__ import annotations

import copy

import pytest
import torch

from scalefold.distributed import setup_model_parallel
from scalefold.distributed.launch import run_processes
from scalefold.losses import AlphaFoldLoss
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.features import make_synthetic_batch

pytestmark = pytest.mark.distributed

N_RES, N_CLUST, N_EXTRA, N_TEMPL = 11, 3, 5, 2  # N_res divisible by neither 2 nor 4
TOL = {"rtol": 1e-8, "atol": 1e-10}
DROPOUT = {
    "evoformer_stack_config": {"msa_dropout": 0.15, "pair_dropout": 0.25, "num_blocks": 2},
    "extra_msa_stack_config": {"msa_dropout": 0.15, "pair_dropout": 0.25, "num_blocks": 1},
    "template_pair_stack_config": {"dropout_rate": 0.25, "num_blocks": 1},
    "structure_module_config": {"dropout_rate": 0.1},
}


def _model(parallel: bool) -> tuple[AlphaFold, AlphaFoldLoss]:
    torch.manual_seed(0)
    cfg = AlphaFoldConfig.from_preset("tiny", overrides=DROPOUT)
    model = AlphaFold(cfg, parallel_evoformer=parallel).double().train()
    with torch.no_grad():  # "final" inits are zero: give every path a gradient
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model, AlphaFoldLoss(cfg.loss_config)


def _step(model, loss_fn, batch):
    torch.manual_seed(1234)
    out = model(batch)
    loss, _ = loss_fn(out, batch)
    loss.backward()
    return out, loss.detach()


def _check(rank: int, world: int, dap: int, bp: int, parallel: bool) -> None:
    model, loss_fn = _model(parallel)
    reference = copy.deepcopy(model)
    batch = make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, dtype=torch.float64, seed=3)
    ref_out, ref_loss = _step(reference, loss_fn, batch)

    ctx = setup_model_parallel(dap=dap, bp=bp, parallel_evoformer=parallel)
    assert ctx.layout.dp == world // (dap * bp)
    ctx.wrap(model)
    local = ctx.broadcast_batch(batch if ctx.is_loader_rank else None)
    out, loss = _step(model, loss_fn, local)
    ctx.sync_grads(model)

    where = f"dap {dap} bp {bp} rank {rank}"
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where} loss: {m}")
    for key in ("msa", "pair", "single", "final_atom_positions", "distogram_logits", "plddt"):
        torch.testing.assert_close(out[key], ref_out[key], **TOL, msg=lambda m, key=key: f"{where} {key}: {m}")
    checked = 0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{where} {name}: {m}")
        checked += q.grad.abs().sum() > 0
    assert checked > 0.9 * sum(1 for _ in model.parameters()), f"{where}: only {checked} non-zero gradients"


def _worker(rank: int, world: int, cases: list) -> None:
    for dap, bp, parallel in cases:
        _check(rank, world, dap, bp, parallel)


def test_alphafold_dap2_and_bp2_equal_single_rank():
    """2 processes: DAP 2 (Evoformer) and BP 2 (Parallel Evoformer): loss, outputs and all
    gradients == the serial single-rank model."""
    run_processes(_worker, 2, [(2, 1, False), (1, 2, True)])


def test_alphafold_dap4_and_bp2_dap2_equal_single_rank():
    """4 processes: DAP 4, BP 2 x DAP 2 (Parallel Evoformer), DP 2 x DAP 2 and DP 2 x BP 2 (every
    replica on the same sample, so the DP mean is the single-rank gradient) == the serial
    single-rank model."""
    run_processes(_worker, 4, [(4, 1, False), (2, 2, True), (2, 1, False), (1, 2, True)])
