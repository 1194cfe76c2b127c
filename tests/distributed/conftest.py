"""Fixtures of the multi-process tests (tests/distributed)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store a ``--preset tiny`` run synthesises when its store is missing (the preset's chains, families,
    lengths and seed), synthesised once for the session: the training runs here only read it."""
    from scalefold.config.training import TrainConfig
    from scalefold.data.synthetic import synthesize

    cfg = TrainConfig.from_preset("tiny", env={})
    path = tmp_path_factory.mktemp("tiny_store") / "store.h5"
    synthesize(path, num_chains=cfg.synth_num_chains, num_families=cfg.synth_num_families,
               length_range=tuple(cfg.synth_length_range), seed=cfg.synth_seed)  # fmt: skip
    return path
