"""Evaluation data: LPT assignment of targets to ranks, features cached in host memory."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from scalefold.evaluation.cache import EvalCache, assign_lpt, rank_costs


def test_lpt_assigns_every_target_once_and_balances():
    """Every target lands on exactly one rank; the L^2 loads are within LPT's 4/3 bound of optimal
    and much better balanced than round robin on a skewed length distribution."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 700, size=180).tolist()
    assignment = assign_lpt(lengths, 8)
    assert sorted(itertools.chain.from_iterable(assignment)) == list(range(180))
    loads = rank_costs(lengths, assignment)
    lower_bound = max(sum(l * l for l in lengths) / 8, max(l * l for l in lengths))
    assert max(loads) <= 4 / 3 * lower_bound
    round_robin = rank_costs(lengths, [list(range(r, 180, 8)) for r in range(8)])
    assert max(loads) - min(loads) < 0.25 * (max(round_robin) - min(round_robin))


def test_lpt_small_exact_case():
    """Known LPT schedule: costs 49, 36, 25, 16, 9 over 2 ranks -> {0, 3} (65) and {1, 2, 4} (70)."""
    assert assign_lpt([7, 6, 5, 4, 3], 2) == [[0, 3], [1, 2, 4]]
    assert assign_lpt([3, 3], 3) == [[0], [1], []]


class _CountingFeatures:
    """Picklable sample_fn returning a tensor; counts calls through a file so workers count too."""

    def __init__(self, path):
        self.path = str(path)

    def __call__(self, index, seed):
        with open(self.path, "a") as f:
            f.write(f"{index}\n")
        return {"index": index, "seed": seed, "x": torch.full((3,), float(index))}


def test_eval_cache_builds_once_and_replays_copies(tmp_path):
    """Features are built once (first pass); later passes replay copies that the caller may modify."""
    calls = tmp_path / "calls.txt"
    targets = [(i, 100 + i) for i in range(6)]
    lengths = [10, 60, 30, 50, 20, 40]
    cache = EvalCache(_CountingFeatures(calls), targets, lengths, rank=1, num_ranks=2, num_workers=2)
    first = list(cache)
    assert [b["index"] for b in first] == [t[0] for t in cache.targets]
    assert sorted(cache.assigned + assign_lpt(lengths, 2)[0]) == list(range(6))
    first[0]["x"].add_(100.0)  # an in-place change by the model must not reach the cache
    second = list(cache)
    assert len(calls.read_text().split()) == len(cache)
    assert torch.equal(second[0]["x"], torch.full((3,), float(second[0]["index"])))
