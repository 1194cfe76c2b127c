"""Whole AlphaFold (tiny preset, float64, dropout on, recycling, activation checkpointing) under
DAP / BP / BP x DAP / BP x DAP x DP equals the single-rank model: outputs, loss and every parameter
gradient after ``ParallelContext.sync_grads``. The context, the batch broadcast and the grad factors
are the ones the training loop uses."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from scalefold.distributed import setup_model_parallel
from scalefold.distributed.launch import run_processes
from scalefold.losses import AlphaFoldLoss
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.features import FEATURES, make_synthetic_batch

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


def _step(model, loss_fn, batch, seed: int = 1234):
    torch.manual_seed(seed)
    out = model(batch)
    loss, _ = loss_fn(out, batch)
    loss.backward()
    return out, loss.detach()


@functools.lru_cache(maxsize=None)
def _reference(parallel: bool):
    """(the untrained model, the single-rank model after its step, loss, batch, outputs, loss value) of the
    serial model: computed once per process for each ``parallel`` (every case of a launch on the same model,
    batch and dropout seed reuses it; each case wraps its own copy of the untrained model)."""
    model, loss_fn = _model(parallel)
    reference = copy.deepcopy(model)
    batch = make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, dtype=torch.float64, seed=3)
    ref_out, ref_loss = _step(reference, loss_fn, batch)
    return model, reference, loss_fn, batch, ref_out, ref_loss


def _check(rank: int, world: int, dap: int, bp: int, parallel: bool) -> None:
    untrained, reference, loss_fn, batch, ref_out, ref_loss = _reference(parallel)
    model = copy.deepcopy(untrained)

    ctx = setup_model_parallel(dap=dap, bp=bp, parallel_evoformer=parallel)
    assert ctx.layout.dp == world // (dap * bp)
    ctx.wrap(model)
    batch = {k: v.clone() for k, v in batch.items()}  # the cached batch stays as the reference saw it
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


OUT_KEYS = ("msa", "pair", "single", "final_atom_positions", "distogram_logits", "plddt")


def _padded_batch(seed: int, n_pad: int = 2) -> dict[str, torch.Tensor]:
    """A batch whose last ``n_pad`` residues are crop padding (every per-residue mask / exists
    feature 0, ``seq_length`` shorter) and with one masked-out MSA and extra-MSA row."""
    batch = make_synthetic_batch(
        N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, dtype=torch.float64, seed=seed
    )
    for name, spec in FEATURES.items():
        if ("mask" in name or "exists" in name) and "N_res" in spec.shape:
            axis = 1 + spec.shape.index("N_res")  # [B, *spec.shape, R]
            batch[name].narrow(axis, N_RES - n_pad, n_pad).zero_()
    batch["seq_length"].fill_(N_RES - n_pad)
    batch["msa_mask"][:, N_CLUST - 1] = 0
    batch["bert_mask"][:, N_CLUST - 1] = 0
    batch["extra_msa_mask"][:, 1] = 0
    return batch


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def _check_bp_dap_dp(rank: int, world: int) -> None:
    """BP 2 x DAP 2 x DP 2 on 8 ranks, replica ``d`` on its own sample with dropout seed
    ``1234 + d`` (the training loop's ``seed + ctx.seed_offset``): each rank's outputs and loss ==
    the single-rank model on that sample; every gradient after ``sync_grads`` == the mean of the
    two samples' single-rank gradients."""
    dap, bp, dp = 2, 2, 2
    assert world == dap * bp * dp
    model, loss_fn = _model(True)
    reference = copy.deepcopy(model)
    samples = [
        make_synthetic_batch(N_RES, N_CLUST, N_EXTRA, N_TEMPL, num_recycling_iters=1, dtype=torch.float64, seed=3),
        _padded_batch(seed=4),
    ]
    # layout.py: dap_rank = r % dap, bp_rank = (r // dap) % bp, dp_rank = r // (dap * bp)
    dp_rank = rank // (dap * bp)

    # single-rank reference on this rank's sample; the other sample's gradient comes from a rank
    # of the other replica through a plain all_gather on the default group (no scalefold code)
    ref_out, ref_loss = _step(reference, loss_fn, samples[dp_rank], seed=1234 + dp_rank)
    gathered = [torch.empty(sum(p.numel() for p in model.parameters()), dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(gathered, _flat_grads(reference))
    per_sample = [gathered[d * dap * bp] for d in range(dp)]
    for r in range(world):  # the serial reference is deterministic: every rank of a replica agrees
        assert torch.equal(gathered[r], per_sample[r // (dap * bp)]), f"rank {rank}: reference of rank {r} differs"
    assert (per_sample[0] - per_sample[1]).abs().max() > 1e-3, "the two samples must give different gradients"
    ref_grad = (per_sample[0] + per_sample[1]) / dp

    ctx = setup_model_parallel(dap=dap, bp=bp, parallel_evoformer=True)
    where = f"bp {bp} x dap {dap} x dp {dp} rank {rank}"
    assert ctx.layout.dp == dp, where
    assert ctx.coords == (dp_rank, (rank // dap) % bp, rank % dap), where
    assert ctx.dap_group is not None and ctx.dap_group.size == dap and ctx.dap_group.rank == rank % dap, where
    assert ctx.branch is not None and ctx.branch.branch == (rank // dap) % bp, where
    ctx.wrap(model)
    local = ctx.broadcast_batch(samples[dp_rank] if ctx.is_loader_rank else None)
    assert local.keys() == samples[dp_rank].keys(), where
    for key, value in local.items():  # each replica's model group got its own loader's sample
        assert torch.equal(value, samples[dp_rank][key]), f"{where} batch {key}"
    out, loss = _step(model, loss_fn, local, seed=1234 + ctx.seed_offset)
    ctx.sync_grads(model)

    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where} loss: {m}")
    for key in OUT_KEYS:
        torch.testing.assert_close(out[key], ref_out[key], **TOL, msg=lambda m, key=key: f"{where} {key}: {m}")
    offset, checked, total = 0, 0, 0
    for name, p in model.named_parameters():
        expected = ref_grad[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        total += 1
        assert p.grad is not None, f"{where} {name}: no gradient after sync_grads"
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m, name=name: f"{where} {name}: {m}")
        checked += bool(expected.abs().sum() > 0)
    assert offset == ref_grad.numel()
    assert checked > 0.9 * total, f"{where}: only {checked} of {total} non-zero gradients"


@pytest.mark.slow
def test_alphafold_bp2_dap2_dp2_equals_single_rank_mean():
    """8 processes: BP 2 x DAP 2 x DP 2 (Parallel Evoformer), the two replicas on different
    samples (one with padded residues and masked MSA rows) and different dropout seeds: outputs
    and loss == the single-rank model on each rank's sample, every gradient after ``sync_grads``
    (DAP/BP factors, mean over all 8 ranks) == the mean of the two single-rank gradients."""
    run_processes(_check_bp_dap_dp, 8)
