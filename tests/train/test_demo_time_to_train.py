"""The default job (``--preset demo``): MLPerf's time to train in miniature, from the shipped checkpoint.

These tests use the checkpoint that ships in the package (``scalefold/assets/demo_init.pt``) and the
demo's synthetic store, so they check the real artefact, not a stand-in:

* the shipped file matches its manifest, and the manifest's lDDT-Cα is what training measures at
  step 0 on the demo validation chains (the manifest states a measured number);
* training from it (deterministic) reaches a target a few dozen steps away and logs ``run_stop
  status=success`` with the file's sha256 as ``init_checkpoint_sha256sum``;
* the preset's own target is above the shipped checkpoint by a clear margin (0.05).
"""

from __future__ import annotations

import json

import pytest

from scalefold.checkpoint.shipped import manifest_path, shipped_demo_checkpoint, verify_shipped
from scalefold.config.training import DEMO_TARGET_LDDT, TrainConfig
from scalefold.train.trainer import train

SHIPPED = shipped_demo_checkpoint()


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    """The demo's synthetic store (synthesised by the first run, as ``scalefold train`` does)."""
    return tmp_path_factory.mktemp("demo") / "demo-store.h5"


def _demo(out, store, **kw):
    overrides = {"out": str(out), "store": str(store), "deterministic": True, "progress": False,
                 "trace_plot": False, "checkpoint_every": 0, **kw}  # fmt: skip
    return TrainConfig.from_preset("demo", overrides=overrides, env={})


def _mlperf_events(out):
    events = []
    for path in sorted(out.glob("mlperf*.log")):
        for line in path.read_text().splitlines():
            if ":::MLLOG" in line:
                events.append(json.loads(line.split(":::MLLOG", 1)[1]))
    return events


def test_the_shipped_checkpoint_and_the_demo_target():
    manifest = verify_shipped(SHIPPED)  # present, sha256 as in the manifest
    assert manifest_path(SHIPPED).is_file() and manifest.file == SHIPPED.name
    assert len(manifest.eval_chains) == TrainConfig.from_preset("demo", env={}).eval_max_chains
    assert "scalefold train --preset demo-scratch" in manifest.source_command
    assert manifest.export_command.startswith("scalefold export-init-checkpoint --from ")
    assert DEMO_TARGET_LDDT - manifest.eval_lddt_ca >= 0.05  # real work to do (the aim of >= 0.6 is not met yet)
    cfg = TrainConfig.from_preset("demo", env={})
    assert cfg.init_from == str(SHIPPED) and cfg.target_lddt == DEMO_TARGET_LDDT


def test_training_from_the_shipped_checkpoint_reaches_a_near_target(demo_store, tmp_path):
    """From the shipped checkpoint to a target 0.01 above it: a few dozen deterministic steps of real
    training (the SWA weights dip for the first steps after the restart, then climb), ``run_stop
    status=success``, the shipped file's sha256 in the MLPerf log, the starting point measured at step 0."""
    manifest = verify_shipped(SHIPPED)
    target = round(manifest.eval_lddt_ca + 0.01, 4)
    result = train(_demo(tmp_path / "run", demo_store, target_lddt=target, max_steps=160, eval_every=20))
    (step0, start), *later = result.eval_history
    assert step0 == 0 and start == pytest.approx(manifest.eval_lddt_ca, abs=2e-3)  # the manifest is measured
    assert result.status == "success", f"target {target} not reached in 160 steps: {later}"
    assert later[-1][1] >= target and all(score < target for _, score in later[:-1])  # stopped at the first
    assert 0 < result.steps < 160
    events = _mlperf_events(tmp_path / "run")
    by_key = {e["key"]: e for e in events}
    assert by_key["run_stop"]["metadata"]["status"] == "success"
    assert by_key["init_checkpoint_sha256sum"]["value"] == manifest.sha256
    assert result.time_to_train_s is not None and result.time_to_train_s > 0
