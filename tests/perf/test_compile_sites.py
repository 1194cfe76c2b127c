"""``scalefold bench step --call-sites``: the step's call sites recorded on fake tensors, each region compiled
and replayed there (no timing is asserted; the cheap ``eager`` dynamo backend: the same tracing and guards as
inductor, no code generation)."""

from __future__ import annotations

import json
from collections import Counter

import torch

from scalefold import kernels
from scalefold.cli import main
from scalefold.config.training import TrainConfig
from scalefold.kernels import elementwise
from scalefold.perf.compile_sites import Site, TensorSpec, record_sites, replay_sites


def test_tensor_spec_rebuilds_the_layout():
    base = torch.randn(4, 1, 6)
    expanded = base.expand(4, 5, 6).transpose(0, 1)  # stride 0 and a permutation
    spec = TensorSpec.of(expanded.requires_grad_(False))
    t = spec.make(torch.Generator().manual_seed(0))
    assert t.shape == expanded.shape and t.stride() == expanded.stride() and t.dtype == expanded.dtype
    g = TensorSpec((3, 4), (4, 1), torch.bfloat16, True).make(torch.Generator())
    assert g.requires_grad and g.dtype == torch.bfloat16 and not g.is_leaf  # a view of a grad-requiring base
    m = TensorSpec((3,), (1,), torch.bool, False).make(torch.Generator())
    assert m.dtype == torch.bool and bool(m.all())


def test_recording_routes_chains_as_compiled_and_restores_state():
    """Under recording the dispatch point merges leading dims as for compiled chains; the values are the
    references'; the previous state comes back."""
    seen: list[tuple[str, tuple]] = []
    x, g = torch.randn(2, 3, 4, 5, 6), torch.randn(2, 3, 4, 5, 6)
    assert not elementwise.enabled()
    with elementwise.recording(lambda name, args: seen.append((name, tuple(a.shape for a in args)))):
        out = kernels.sigmoid_gate(x, g)
    assert not elementwise.enabled()
    torch.testing.assert_close(out, x * torch.sigmoid(g))
    assert seen == [("sigmoid_gate", ((6, 4, 5, 6), (6, 4, 5, 6)))]  # [2, 3] merged, as compiled
    kernels.sigmoid_gate(x, g)
    assert len(seen) == 1  # nothing recorded outside


def test_record_sites_of_the_tiny_step():
    cfg = TrainConfig.from_preset("tiny")
    sites = record_sites(cfg, ("elementwise:all", "template_pair_stack"))
    regions = {s.region for s in sites}
    assert {"elementwise:masked_softmax", "elementwise:sigmoid_gate", "elementwise:gated_projection",
            "template_pair_stack"} <= regions  # fmt: skip
    stack = [s for s in sites if s.region == "template_pair_stack"]
    assert {s.grad for s in stack} == {False, True}  # a no-grad recycling pass and the grad pass
    softmax = [s for s in sites if s.region == "elementwise:masked_softmax"]
    assert all(isinstance(s.args[0], TensorSpec) and len(s.args[0].shape) >= 4 for s in softmax)
    assert sum(sites[s] for s in softmax) >= len(softmax)


def test_replay_counts_one_graph_per_grad_mode_and_dtype():
    """``dynamic=True``: sites differing only in sizes share a graph; a grad site and a bf16 site do not."""
    def site(shape, grad=False, dtype=torch.float32):
        spec = TensorSpec(shape, tuple(torch.empty(shape).stride()), dtype, grad)
        return Site("elementwise:sigmoid_gate", (spec, spec), (), grad, False)

    sizes_only = Counter({site((2, 3, 4, 5)): 1, site((3, 4, 5, 6)): 2})
    rows = replay_sites(sizes_only, TrainConfig.from_preset("tiny"), backend="eager")
    row = rows["elementwise:sigmoid_gate"]
    assert row["graphs"] == 1 and row["sites"] == 2 and row["calls_per_step"] == 3
    assert row["compile_s"] >= 0 and row["eager_pass_s"] >= 0
    mixed = Counter({site((2, 3, 4, 5)): 1, site((2, 3, 4, 5), grad=True): 1, site((2, 3, 4, 5), dtype=torch.bfloat16): 1})
    assert replay_sites(mixed, TrainConfig.from_preset("tiny"), backend="eager")["elementwise:sigmoid_gate"]["graphs"] == 3
    assert not elementwise.enabled()


def test_bench_step_call_sites_cli(capsys):
    rc = main(["bench", "step", "--preset", "tiny", "--call-sites", "--backend", "eager", "--threads", "1", "--json",
               "--compile-cache", "off", "--regions", "elementwise:gated_projection,template_pair_stack"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["per_region"]) == {"elementwise:gated_projection", "template_pair_stack"}
    chain = out["per_region"]["elementwise:gated_projection"]
    assert out["compile_s"] == chain["compile_s"] and out["graphs"] == chain["graphs"] >= 1
    block = out["per_region"]["template_pair_stack"]
    assert block["graphs"] == 2 and block["sites"] == 2  # one block forward per grad mode
    assert all("x template_pair_stack(" in line for line in block["site_list"])


def test_bench_step_call_sites_bad_region(capsys):
    assert main(["bench", "step", "--preset", "tiny", "--call-sites", "--regions", "loss"]) == 3
    assert "--call-sites" in capsys.readouterr().err
