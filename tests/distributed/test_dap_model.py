"""DAP-sharded stacks equal the single-rank stacks: outputs, input gradients and every parameter
gradient (after gradient sync), float64, dropout on, masks with fully masked rows/columns, sizes
not divisible by the DAP size (padding), chunking and activation checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch

from scalefold.distributed import grad_sync
from scalefold.distributed.group import DAPGroup
from scalefold.distributed.launch import run_processes
from scalefold.distributed.parallelize import parallelize
from scalefold.distributed.volume import evoformer_block_bytes
from scalefold.model.config import EvoformerStackConfig, ExtraMSAStackConfig, TemplatePairStackConfig
from scalefold.model.evoformer import EvoformerStack
from scalefold.model.extra_msa import ExtraMSAStack
from scalefold.model.parallel import enter_stack
from scalefold.model.template import TemplatePairStack

pytestmark = pytest.mark.distributed

N_SEQ, N_RES = 5, 7  # divisible by neither 2 nor 4
TOL = {"rtol": 1e-9, "atol": 1e-11}


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _masks(n_seq: int):
    gen = torch.Generator().manual_seed(7)
    msa_mask = (torch.rand(1, n_seq, N_RES, generator=gen) > 0.2).double()
    msa_mask[:, -1] = 0.0  # a fully masked MSA row (padding sequence)
    seq_mask = torch.ones(1, N_RES, dtype=torch.float64)
    seq_mask[:, -1] = 0.0  # a padding residue
    return msa_mask * seq_mask[:, None], seq_mask[:, :, None] * seq_mask[:, None, :]


def _stack(kind: str, chunked: bool, checkpointing: bool, parallel: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    chunks = {"chunk_size_tri_att": 2} if chunked else {}
    tri = dict(c_hidden_tri_att=4, c_hidden_tri_mul=4, num_heads_tri=2)
    if kind == "template":
        cfg = TemplatePairStackConfig(c_t=4, num_blocks=2, pair_transition_n=2, dropout_rate=0.25, **tri, **chunks)
        stack = TemplatePairStack(cfg, checkpointing=checkpointing)
    else:
        common = dict(
            c_z=4, c_hidden_msa_att=4, c_hidden_opm=3, num_heads_msa=2, num_blocks=2, transition_n=2,
            msa_dropout=0.15, pair_dropout=0.25, **tri, **chunks,
        )
        if chunked:
            common.update(chunk_size_msa_att=2, chunk_size_opm=2)
        if kind == "evoformer":
            stack = EvoformerStack(EvoformerStackConfig(c_m=8, c_s=6, **common), checkpointing, parallel=parallel)
        else:
            stack = ExtraMSAStack(ExtraMSAStackConfig(c_e=8, **common), checkpointing)
    stack = stack.double().train()
    for p in stack.parameters():  # "final" inits are zero: make every path carry gradient
        with torch.no_grad():
            p.add_(0.1 * _rand(hash(p.shape) % 1000, *p.shape))
    return stack


def _run(stack, kind: str):
    n_seq = N_SEQ if kind == "evoformer" else N_SEQ + 2
    msa_mask, pair_mask = _masks(n_seq)
    if kind == "template":
        t = _rand(1, 1, 2, N_RES, N_RES, 4).requires_grad_()
        torch.manual_seed(123)
        out = stack(t, mask=pair_mask)
        (out * _rand(3, *out.shape)).sum().backward()
        return [out], [t.grad]
    m = _rand(1, 1, n_seq, N_RES, 8).requires_grad_()
    z = _rand(2, 1, N_RES, N_RES, 4).requires_grad_()
    torch.manual_seed(123)
    out = stack(m, z, msa_mask=msa_mask, pair_mask=pair_mask)
    outs = list(out) if isinstance(out, tuple) else [out]
    sum((o * _rand(3 + i, *o.shape)).sum() for i, o in enumerate(outs)).backward()
    return outs, [m.grad, z.grad]


def _dap_run(reference, kind: str, world: int, overlap: bool):
    stack = copy.deepcopy(reference)
    stack.zero_grad(set_to_none=True)
    parallelize(stack, dap_group=DAPGroup.world(overlap=overlap), branch=None, dap=world, bp=1)
    outs, input_grads = _run(stack, kind)
    # every overlapped collective was waited for (checkpoint recomputation included)
    assert stack.dap_group.stats.in_flight == 0, f"{kind}: {stack.dap_group.stats.in_flight} collectives in flight"
    grad_sync.all_reduce_mean(stack.parameters())
    return outs, input_grads, [p.grad for p in stack.parameters()]


def _compare_worker(rank: int, world: int, kind: str, chunked: bool, checkpointing: bool, both: bool = False) -> None:
    reference = _stack(kind, chunked, checkpointing)
    ref_outs, ref_input_grads = _run(reference, kind)
    outs, input_grads, grads = _dap_run(reference, kind, world, overlap=True)

    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref, **TOL)
    for g, ref in zip(input_grads, ref_input_grads):
        torch.testing.assert_close(g, ref, **TOL)
    for (name, q), g in zip(reference.named_parameters(), grads):
        assert q.grad is not None and q.grad.abs().sum() > 0, f"{name}: no reference gradient"
        torch.testing.assert_close(g, q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")

    if both:  # async (Duality Async Operations) and synchronous collectives: identical results
        sync = _dap_run(reference, kind, world, overlap=False)
        for a, b in zip(outs + input_grads + grads, sync[0] + sync[1] + sync[2]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _volume_worker(rank: int, world: int) -> None:
    """Bytes counted by the collectives of one Evoformer block == the analytic volume."""
    dims = dict(c_m=8, c_z=4, num_heads_msa=2, c_hidden_opm=3, c_hidden_tri_mul=4, num_heads_tri=2, itemsize=8)
    block = _stack("evoformer", False, False).blocks[0]
    for n_seq, n_res in ((N_SEQ, N_RES), (2 * world, 4 * world)):
        g = DAPGroup.world()
        msa_mask, pair_mask = torch.ones(1, n_seq, n_res, dtype=torch.float64), torch.ones(1, n_res, n_res, dtype=torch.float64)
        dap, m, z = enter_stack(g, _rand(1, 1, n_seq, n_res, 8), _rand(2, 1, n_res, n_res, 4), n_seq)
        m, z = m.requires_grad_(), z.requires_grad_()
        g.stats.reset()
        m_out, z_out = block(m, z, msa_mask=msa_mask, pair_mask=pair_mask, dap=dap)
        expected = evoformer_block_bytes(n_seq, n_res, world, **dims)
        assert dict(g.stats.calls) == {"all_to_all": 6, "all_gather": 6}
        assert dict(g.stats.bytes) == expected, (n_seq, n_res, dict(g.stats.bytes), expected)
        if n_seq % world == 0 and n_res % world == 0:  # all-to-all S(d-1)/d^2, all-gather S(d-1)/d per rank
            s_m, s_z = n_seq * n_res * 8 * 8, n_res * n_res * 4 * 8
            gathered = (n_res * n_res * (2 + 2 * 4 + 2 * 2) + n_seq * n_res * 3) * 8
            assert expected["all_to_all"] == (2 * s_m + 4 * s_z) * (world - 1) // world**2
            assert expected["all_gather"] == gathered * (world - 1) // world
        g.stats.reset()  # backward: the reverse all_to_all and a reduce-scatter per "sum" gather
        ((m_out * _rand(5, *m_out.shape)).sum() + (z_out * _rand(6, *z_out.shape)).sum()).backward()
        assert dict(g.stats.bytes) == {"all_to_all": expected["all_to_all"], "reduce_scatter": expected["all_gather"]}


def _cases_worker(rank: int, world: int, cases: list, volume: bool = False) -> None:
    for case in cases:
        _compare_worker(rank, world, *case)
    if volume:
        _volume_worker(rank, world)


def test_stacks_equal_single_rank_dap2():
    """DAP 2 == single rank for: the Evoformer stack (2 blocks); the same with chunking and
    activation checkpointing (recomputation re-issues the collectives), where async and
    synchronous collectives must also agree bit for bit; the extra-MSA stack (global column
    attention in the column layout); the template pair stack ([B, T, N, N, c], dim 2). Then the
    byte counter of one Evoformer block == the analytic volume (padded and divisible sizes)."""
    cases = [
        ("evoformer", False, False),
        ("evoformer", True, True, True),
        ("extra_msa", False, False),
        ("template", False, False),
    ]
    run_processes(_cases_worker, 2, cases, True)


def test_evoformer_stack_equals_single_rank_dap4():
    """DAP 4 (N_seq 5, N_res 7: most ranks hold padding) == single rank, async == sync; byte
    counter == analytic volume."""
    run_processes(_cases_worker, 4, [("evoformer", False, False, True)], True)


@pytest.mark.slow
def test_evoformer_stack_equals_single_rank_dap8():
    """DAP 8, the record layout's group size (N_seq 5, N_res 7: every rank holds at most one real
    row, some only padding) == single rank, async == sync; byte counter == analytic volume."""
    run_processes(_cases_worker, 8, [("evoformer", False, False, True)], True)
