"""``--deterministic`` without inductor's import (issue 45: the start of every process of a deterministic run):
:func:`scalefold.model.precision.set_deterministic_algorithms` has ``torch.use_deterministic_algorithms``'s
effect -- torch's flag, and inductor's ``deterministic`` whether inductor loads before or after -- but leaves
``torch._inductor`` unimported."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from scalefold.model.precision import INDUCTOR_DETERMINISTIC_ENV, set_deterministic_algorithms

_FRESH = """
import sys
import torch
from scalefold.model.precision import setup_precision
setup_precision("fp32", deterministic=True)
assert torch.are_deterministic_algorithms_enabled()
assert "torch._inductor" not in sys.modules, "setup_precision imported inductor"
import torch._inductor.config as config  # loaded after the switch: its deterministic mode follows
assert getattr(config, "deterministic", True) is True  # torch < 2.7 (the floor): inductor has no such mode
print("ok")
"""


def test_the_switch_leaves_inductor_unimported_and_inductor_follows_when_it_loads():
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_DETERMINISTIC_ENV}
    proc = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_the_switch_sets_torchs_flag_and_a_loaded_inductors_both_ways(monkeypatch):
    import torch._inductor.config as config

    monkeypatch.delenv(INDUCTOR_DETERMINISTIC_ENV, raising=False)
    has_mode = hasattr(config, "deterministic")  # torch < 2.7 (the floor): inductor has no such mode
    was, was_inductor = torch.are_deterministic_algorithms_enabled(), getattr(config, "deterministic", None)
    try:
        set_deterministic_algorithms(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert not has_mode or config.deterministic is True
        assert os.environ[INDUCTOR_DETERMINISTIC_ENV] == "1"
        set_deterministic_algorithms(False)
        assert not torch.are_deterministic_algorithms_enabled()
        assert not has_mode or config.deterministic is False
        assert INDUCTOR_DETERMINISTIC_ENV not in os.environ
    finally:
        torch.use_deterministic_algorithms(was)
        if has_mode:
            config.deterministic = was_inductor
