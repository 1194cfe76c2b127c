"""The single dispatch point ``scalefold.kernels`` picks the backend it is asked for."""

from __future__ import annotations

import pytest
import torch

from scalefold import kernels


def _record(monkeypatch):
    """Replace both implementations of attention/layer_norm/adam_swa_ with recorders."""
    triton_ops = pytest.importorskip("scalefold.kernels.triton_ops")
    calls = []
    for module, tag in ((kernels.reference, "torch"), (triton_ops, "triton")):
        for name in ("attention", "layer_norm"):
            monkeypatch.setattr(module, name, lambda *a, _t=tag, **k: calls.append(_t))
    monkeypatch.setattr(kernels.reference, "adam_swa_", lambda *a, **k: calls.append("torch"))
    monkeypatch.setattr(triton_ops, "adam_swa_update_", lambda *a, **k: calls.append("triton"))
    return calls


def _call_all(backend):
    x = torch.zeros(1, 1, 2, 4)
    kernels.attention(x, x, x, backend=backend)
    kernels.layer_norm(x, torch.ones(4), torch.zeros(4), backend=backend)
    flat, scalar = torch.zeros(4), torch.tensor(1.0)
    kernels.adam_swa_(flat, flat, flat, flat, flat, lr=scalar, step=scalar, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_explicit_backend_is_used(backend, monkeypatch):
    """backend='torch'/'triton' force that implementation for every kernel."""
    monkeypatch.delenv("SCALEFOLD_KERNELS", raising=False)
    calls = _record(monkeypatch)
    _call_all(backend)
    assert calls == [backend] * 3


def test_auto_uses_reference_for_cpu_tensors(monkeypatch):
    """backend='auto' on CPU tensors runs the PyTorch reference."""
    monkeypatch.delenv("SCALEFOLD_KERNELS", raising=False)
    calls = _record(monkeypatch)
    _call_all("auto")
    assert calls == ["torch"] * 3


@pytest.mark.parametrize("env", ["torch", "triton"])
def test_environment_overrides_auto(env, monkeypatch):
    """SCALEFOLD_KERNELS pins what 'auto' resolves to; explicit backends still win."""
    monkeypatch.setenv("SCALEFOLD_KERNELS", env)
    calls = _record(monkeypatch)
    _call_all("auto")
    assert calls == [env] * 3
    assert kernels.resolve_backend("torch") == "torch"


def test_unknown_backend_rejected(monkeypatch):
    """Typos in the backend name or the environment variable raise instead of silently falling back."""
    with pytest.raises(ValueError):
        kernels.resolve_backend("cuda")
    monkeypatch.setenv("SCALEFOLD_KERNELS", "fast")
    with pytest.raises(ValueError):
        kernels.resolve_backend("auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter runs only on machines without CUDA (conftest)")
def test_triton_backend_runs_kernel_on_cpu(monkeypatch):
    """backend='triton' on CPU tensors really runs the kernel (interpreter) and matches the reference."""
    pytest.importorskip("triton")
    monkeypatch.delenv("SCALEFOLD_KERNELS", raising=False)
    x = torch.randn(2, 6, 64)
    w, b = torch.randn(64), torch.randn(64)
    y = kernels.layer_norm(x, w, b, backend="triton")
    assert torch.allclose(y, kernels.layer_norm(x, w, b, backend="torch"), atol=1e-5)
