"""Fixtures of the submission tests: ten real, short CPU training runs, and NVIDIA's public v3.0 results.

``ten_runs``: ten ``scalefold train --preset tiny`` runs, one step each, seeds 1001..1010, trained one after
the other in this process (one torch import, one synthetic store: ~5 s a run on a 2-core box), in run
directories named as ``run.sub`` names a job's runs (``run_t_1`` .. ``run_t_10``: natural order, not
lexical, puts ``run_t_10`` last). Each is a real finished run with its own MLPerf log and provenance.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests here import submission_helpers (importlib mode)

RUNS, FIRST_SEED = 10, 1001


@pytest.fixture(scope="session")
def ten_runs(tmp_path_factory) -> list[Path]:
    from scalefold.config.training import TrainConfig
    from scalefold.train.trainer import train

    root = tmp_path_factory.mktemp("ten_runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = []
    try:
        for index in range(RUNS):
            out = root / f"run_t_{index + 1}"
            overrides = {"out": str(out), "store": str(root / "store.h5"), "max_steps": 1, "seed": FIRST_SEED + index,
                         "checkpoint_every": 0, "progress": False, "trace_plot": False}  # fmt: skip
            train(TrainConfig.from_preset("tiny", overrides=overrides, env={}))
            runs.append(out)
    finally:
        torch.set_num_threads(threads)
    return runs
