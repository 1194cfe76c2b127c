"""CUDA-graph cache logic on CPU with a fake backend (keys, capture-once, warm-up-only capture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from scalefold.compilation.cuda_graphs import (
    CudaGraphBackend,
    CudaGraphCache,
    HostSyncInCapturedRegion,
    flatten,
    make_key,
    unflatten,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeBackend:
    """Emulates graph semantics on CPU: a replay re-runs the function on the *static* inputs."""

    device_type = "cpu"

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.captured: list[tuple] = []

    def is_available(self) -> bool:
        return self.available

    def capture(self, fn, static_args):
        self.captured.append(("nograd", static_args))
        return lambda: fn(*static_args)

    def capture_with_grad(self, module, example_args):
        self.captured.append(("grad", example_args))
        return module


def _fn(batch: dict, scale: torch.Tensor) -> torch.Tensor:
    return batch["msa"].sum(-1) * scale + batch["n_recycle"]


def _batch(n: int, value: float, recycle: int = 0) -> dict:
    return {"msa": torch.full((n, 3), value), "n_recycle": recycle}


def test_capture_once_then_replay_with_copied_inputs():
    """First call for a key captures; later calls replay from the static buffers, which receive the new
    input values, so outputs equal eager outputs."""
    backend = FakeBackend()
    cache = CudaGraphCache(_fn, backend=backend)
    with torch.no_grad():
        for value in (1.0, 2.0, 3.0):
            out = cache(_batch(4, value), torch.tensor(2.0), tag=1)
            torch.testing.assert_close(out, _fn(_batch(4, value), torch.tensor(2.0)))
    assert len(backend.captured) == 1 and len(cache) == 1
    assert (cache.stats.captures, cache.stats.hits, cache.stats.misses) == (1, 2, 1)


def test_key_distinguishes_tag_shape_dtype_literals_and_grad_mode():
    """Recycling tag, input shapes, dtypes, literal values and grad mode each select their own graph."""
    backend = FakeBackend()
    module = nn.Linear(3, 2)
    cache = CudaGraphCache(module, backend=backend)
    x = torch.ones(4, 3)
    with torch.no_grad():
        cache(x, tag=0)
        cache(x, tag=0)
        cache(x, tag=1)  # other recycling count
        cache(torch.ones(5, 3), tag=0)  # other shape
    cache(x, tag=0)  # grad enabled
    assert len(cache) == 4 and cache.stats.hits == 1
    assert [kind for kind, _ in backend.captured] == ["nograd", "nograd", "nograd", "grad"]
    k1, _ = make_key(0, (_batch(2, 1.0, recycle=1),), False)
    k2, _ = make_key(0, (_batch(2, 1.0, recycle=2),), False)
    k3, _ = make_key(0, ({"msa": torch.ones(2, 3, dtype=torch.float64), "n_recycle": 1},), False)
    assert len({k1, k2, k3}) == 3


def test_capture_only_during_warmup():
    """After end_warmup() unseen keys run eagerly (no capture in the timed region); seen keys replay."""
    backend = FakeBackend()
    cache = CudaGraphCache(_fn, backend=backend)
    with torch.no_grad():
        cache(_batch(4, 1.0), torch.tensor(1.0), tag=0)
        cache.end_warmup()
        out = cache(_batch(6, 1.0), torch.tensor(1.0), tag=0)
        cache(_batch(4, 5.0), torch.tensor(1.0), tag=0)
    torch.testing.assert_close(out, _fn(_batch(6, 1.0), torch.tensor(1.0)))
    assert (cache.stats.captures, cache.stats.eager_uncaptured, cache.stats.hits) == (1, 1, 1)
    assert len(backend.captured) == 1


def test_eager_fallback_when_graphs_unavailable():
    """Without CUDA (or disabled) every call runs eagerly through the same entry point."""
    for cache in (CudaGraphCache(_fn, backend=FakeBackend(available=False)), CudaGraphCache(_fn, enabled=False)):
        out = cache(_batch(2, 1.0), torch.tensor(3.0), tag=0)
        torch.testing.assert_close(out, _fn(_batch(2, 1.0), torch.tensor(3.0)))
        assert cache.stats.eager_disabled == 1 and len(cache) == 0


def test_grad_mode_capture_needs_a_module():
    """Grad-mode graphs (forward + backward) are only captured for nn.Modules."""
    cache = CudaGraphCache(_fn, backend=FakeBackend())
    with pytest.raises(TypeError, match="nn.Module"):
        cache(_batch(2, 1.0), torch.tensor(1.0, requires_grad=True), tag=0)


def test_flatten_round_trip():
    """Nested dict/list/tuple inputs flatten to tensors + structure and rebuild identically."""
    obj = ({"a": torch.ones(1), "b": [torch.zeros(2), 3, None]}, (torch.ones(3), "x"))
    tensors, structure = flatten(obj)
    assert len(tensors) == 3
    rebuilt = unflatten(tensors, structure)
    assert rebuilt[0]["b"][1] == 3 and rebuilt[1][1] == "x" and rebuilt[0]["a"] is tensors[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graph_replay_matches_eager():
    """On a GPU the real backend captures once and replays to the eager result."""
    module = nn.Linear(8, 8).cuda()
    cache = CudaGraphCache(module, backend=CudaGraphBackend())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8, device="cuda")
            torch.testing.assert_close(cache(x, tag=0).clone(), module(x))
    assert cache.stats.captures == 1 and cache.stats.hits == 2


def test_has_and_key_report_what_a_call_would_do():
    """key() is the key a call would use in the current grad mode; has() says whether it would replay."""
    cache = CudaGraphCache(_fn, backend=FakeBackend())
    args = (_batch(4, 1.0), torch.tensor(2.0))
    with torch.no_grad():
        assert not cache.has(*args, tag=0)
        cache(*args, tag=0)
        assert cache.has(_batch(4, 9.0), torch.tensor(3.0), tag=0)  # values do not matter
        assert not cache.has(*args, tag=1) and not cache.has(_batch(5, 1.0), torch.tensor(2.0), tag=0)
        assert cache.key(*args, tag=0) in cache.keys()
    assert not cache.has(*args, tag=0)  # grad mode is part of the key
    assert not CudaGraphCache(_fn, backend=FakeBackend(available=False)).has(*args, tag=0)


@needs_cuda
def test_real_backend_refuses_a_host_sync_before_capturing():
    """A function that syncs with the host (``.item()``) is refused by the sync-checked warm-up, before any
    capture; the caller's stream and the sync debug mode are left as they were."""
    stream, mode = torch.cuda.current_stream(), torch.cuda.get_sync_debug_mode()
    x = torch.ones(4, device="cuda")
    with torch.no_grad(), pytest.raises(HostSyncInCapturedRegion, match="synchronizing"):
        CudaGraphBackend().capture(lambda t: t * t.sum().item(), (x,))
    assert torch.cuda.current_stream() == stream and torch.cuda.get_sync_debug_mode() == mode


_FAILED_CAPTURE_SCRIPT = """
import torch
from scalefold.compilation.cuda_graphs import CudaGraphBackend

stream = torch.cuda.current_stream()
calls = []

def fn(t):
    calls.append(1)
    return t * (t.sum().item() if len(calls) > 3 else 1.0)  # syncs only in the capture (4th call)

try:
    with torch.no_grad():
        CudaGraphBackend(warmup_iters=3).capture(fn, (torch.ones(4, device="cuda"),))
except Exception as exc:  # noqa: BLE001
    print("capture raised:", type(exc).__name__)
else:
    raise SystemExit("the capture did not raise")
assert torch.cuda.current_stream() == stream, "the capture stream is still current"
torch.cuda.synchronize()
assert float((torch.ones(3, device="cuda") * 2).sum()) == 6.0
print("ok")
"""


@needs_cuda
def test_real_backend_restores_the_stream_after_a_failed_capture():
    """A capture that breaks inside torch.cuda.graph (a sync the warm-up did not see) raises, and later work
    runs on the caller's stream again (torch.cuda.graph leaves its capture stream current otherwise).

    In a process of its own: on the first GPU run (H200, torch 2.11) every real capture test that ran
    after this one in the same process failed, and passed when run alone: the broken capture leaves some
    process-wide CUDA state behind (which -- the RNG generator's capture registration, the invalidated
    capture -- is not established yet; the failures' tracebacks were lost with that run).
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _FAILED_CAPTURE_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


@needs_cuda
def test_real_replay_advances_the_cuda_rng_as_eager():
    """Dropout in a captured region: from the same seed, a replay draws the eager masks and leaves the CUDA
    generator where the eager call leaves it (the next eager op draws the same numbers)."""
    x = torch.ones(64, 64, device="cuda")
    fn = lambda t: torch.nn.functional.dropout(t, p=0.5, training=True)  # noqa: E731
    with torch.no_grad():
        replay = CudaGraphBackend().capture(fn, (x,))
        torch.manual_seed(7)
        graphed, state_graphed = replay().clone(), torch.cuda.get_rng_state()
        torch.manual_seed(7)
        eager, state_eager = fn(x), torch.cuda.get_rng_state()
    assert torch.equal(graphed, eager) and torch.equal(state_graphed, state_eager)


@needs_cuda
def test_real_capture_under_autocast_reads_current_weights():
    """Under autocast a captured linear layer reads the fp32 weights at replay time (the weight-cast cache is
    off during capture), so in-place weight updates after capture reach the replay."""
    module = nn.Linear(8, 8).cuda()
    x = torch.randn(4, 8, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        module(x)  # a cached bf16 cast of the weight, if the cache were on
        cache = CudaGraphCache(module, backend=CudaGraphBackend())
        cache(x, tag=0)
        module.weight.mul_(2.0)  # in place, as the optimizer updates it
        graphed = cache(x, tag=0).clone()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(graphed, module(x))  # a fresh autocast region: the current weights
