"""Fixtures of the weight-import tests: AlphaFold2-layout files of the tiny preset, written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the tests here import af2_checks (pytest's importlib mode)


@pytest.fixture(scope="session")
def tiny_config():
    from scalefold.model import AlphaFoldConfig

    return AlphaFoldConfig.from_preset("tiny")


@pytest.fixture(scope="session")
def unique_af2_file(tmp_path_factory, tiny_config):
    """(path, arrays) of a tiny-size AlphaFold2 model_1 file whose values are all distinct (traceable)."""
    from scalefold.checkpoint.af2_synthetic import write_af2_params

    path = tmp_path_factory.mktemp("af2") / "params_model_1.npz"
    return path, write_af2_params(path, tiny_config, seed=0, values="unique")


@pytest.fixture(scope="session")
def random_af2_file(tmp_path_factory, tiny_config):
    """(path, arrays) of a tiny-size AlphaFold2 model_1_ptm file with fixed-seed Gaussian values."""
    from scalefold.checkpoint.af2_synthetic import write_af2_params

    path = tmp_path_factory.mktemp("af2") / "params_model_1_ptm.npz"
    return path, write_af2_params(path, tiny_config, ptm=True, seed=1, values="random")
