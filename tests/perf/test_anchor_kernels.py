"""``bench/anchor_kernels.py`` (issue 46, item 3): cuEquivariance's triangle kernels beside ScaleFold's and the
PyTorch reference -- a GPU table. Here: the CPU's one line, cuEquivariance an optional extra only, and the check
that gates the timing (each output and input gradient against the float32 reference) on tiny shapes."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _anchor():
    spec = importlib.util.spec_from_file_location("anchor_kernels", REPO / "bench" / "anchor_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_on_the_cpu_one_line_says_it_is_not_available(capsys):
    assert _anchor().main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("anchor_kernels: cuEquivariance not available here: no CUDA device")


def test_cuequivariance_is_an_optional_extra_only():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any("cuequivariance" in dep for dep in project["dependencies"])
    assert any(dep.startswith("cuequivariance-torch") for dep in project["optional-dependencies"]["cueq"])
    assert not any("cuequivariance" in dep for name, deps in project["optional-dependencies"].items()
                   if name != "cueq" for dep in deps)  # fmt: skip


@pytest.mark.parametrize("case", ["trimul", "attention"])
def test_the_check_passes_the_reference_and_catches_a_wrong_output_or_gradient(case):
    a = _anchor()
    torch.manual_seed(0)
    if case == "trimul":
        leaves, impls = a.trimul_case(6, 8, 8, torch.float32, False, None, device="cpu")
    else:
        leaves, impls = a.attention_case(6, 2, 4, torch.float32, False, None, device="cpu")
    ref = impls["reference"]
    want = a.reference_fp32(ref, leaves)
    assert a.check(ref, leaves, want) < 1e-6
    assert a.check(lambda *xs: ref(*xs) * 1.1, leaves, want) > a.TOLERANCE  # a wrong output (and gradients)
    def wrong_gradient(*xs):  # the right output, but no gradient reaches the first input
        return ref(xs[0].detach(), *xs[1:]) + 0 * xs[0].sum()

    assert a.check(wrong_gradient, leaves, want) > a.TOLERANCE
