"""Fixtures of the training tests: the tiny preset's synthetic store, synthesised once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalefold.config.training import TrainConfig
from scalefold.train.run_directory import ensure_store


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """The store ``scalefold train --preset tiny`` synthesises when it has none (read, never written, by the tests
    that take it; a test that corrupts a store corrupts a copy)."""
    path = tmp_path_factory.mktemp("train_store") / "store.h5"
    return ensure_store(TrainConfig.from_preset("tiny", overrides={"store": str(path)}, env={}))
