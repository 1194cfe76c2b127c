"""A Triton that is installed but unusable never stops a run: ``backend="auto"`` falls back to the
PyTorch reference and says why in one line; fp64 attention on a Triton without fp64 ``tl.dot``
runs the reference. (The real failures this stands for: torch 2.4's ``custom_op`` raising
``ValueError`` on the kernels' module, Triton < 3.5 rejecting fp64 dots.)"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

import pytest
import torch

from scalefold import kernels


class _FailingKernelsModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Importing ``scalefold.kernels.triton_ops`` raises ``ValueError`` while the module runs, as torch
    2.4's schema inference did on it."""

    NAME = "scalefold.kernels.triton_ops"

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.NAME else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ValueError("infer_schema(func): Parameter q has unsupported type torch.Tensor.\nsecond line")


@pytest.fixture
def broken_triton(monkeypatch):
    """CUDA "present" and the kernels' module failing to import; the availability verdict found afresh."""
    monkeypatch.delitem(sys.modules, _FailingKernelsModule.NAME, raising=False)
    monkeypatch.delattr(kernels, "triton_ops", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingKernelsModule()] + sys.meta_path)
    monkeypatch.setattr(kernels, "_cuda_present", lambda: True)  # not torch.cuda.is_available: dynamo asks it too
    monkeypatch.setattr(kernels, "_triton_status", None)
    monkeypatch.delenv("SCALEFOLD_KERNELS", raising=False)


def test_unusable_triton_falls_back_with_one_line(broken_triton, capsys):
    """'auto' resolves to the reference, with one stderr line naming the cause -- once per process,
    not once per kernel call -- and the kernels then run (here: LayerNorm equals the reference)."""
    assert kernels.resolve_backend("auto") == "torch"
    assert kernels.resolve_backend("auto") == "torch"
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Triton kernels unavailable (ValueError: infer_schema(func)" in err
    assert "using the PyTorch reference" in err and "second line" not in err
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    assert torch.equal(kernels.layer_norm(x, w, b), kernels.reference.layer_norm(x, w, b))
    assert capsys.readouterr().err == ""


def test_triton_named_explicitly_reports_the_cause(broken_triton):
    """backend='triton' asked for by name cannot fall back: the error carries the import's cause."""
    with pytest.raises(RuntimeError, match=r"Triton kernels are unavailable: ValueError: infer_schema"):
        kernels.layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(8), backend="triton")


def test_availability_is_a_constant_under_torch_compile(broken_triton, capsys):
    """The first verdict may be reached inside a compiled region: it is computed eagerly
    (``assume_constant_result``), so the import and the message do not break a fullgraph trace."""

    def fn(x):
        return x + 1 if kernels.resolve_backend("auto") == "torch" else x - 1

    out = torch.compile(fn, backend="eager", fullgraph=True)(torch.zeros(3))
    assert torch.equal(out, torch.ones(3))
    assert "Triton kernels unavailable (ValueError" in capsys.readouterr().err


def test_triton_version_ignores_local_suffixes(monkeypatch):
    """NGC and nightly builds carry suffixes (``3.2.0+git4b3bb1f8``, ``3.6.0.post1``)."""
    for text, expected in (("3.2.0+git4b3bb1f8", (3, 2)), ("3.6.0.post1", (3, 6)), ("nonsense", None), (None, None)):
        monkeypatch.setattr(kernels, "installed_triton", lambda text=text: text)
        assert kernels.triton_version() == expected


@pytest.mark.parametrize("version, falls_back", [((3, 2), True), ((3, 4), True), ((3, 5), False), (None, False)])
def test_fp64_attention_uses_reference_without_fp64_dot(version, falls_back, monkeypatch):
    """fp64 attention with the kernel chosen automatically (here pinned by SCALEFOLD_KERNELS) runs the
    reference when Triton has no fp64 ``tl.dot``; fp32 and an explicit backend='triton' are unchanged."""
    monkeypatch.setattr(kernels, "triton_version", lambda: version)
    monkeypatch.setenv("SCALEFOLD_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(kernels.reference, "attention", lambda *a, **k: calls.append("torch"))
    kernel_module = types.SimpleNamespace(attention=lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(kernels, "_triton_module", lambda: kernel_module)
    x64 = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    kernels.attention(x64, x64, x64)
    kernels.attention(x64.float(), x64.float(), x64.float())
    kernels.attention(x64, x64, x64, backend="triton")
    assert calls == ["torch" if falls_back else "triton", "triton", "triton"]
