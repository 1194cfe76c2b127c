"""Feature parity with the MLPerf reference's data pipeline on real structures (standing test).

``../shared/reference/golden_features_shared.pt`` holds what the reference (mlcommons/hpc 2c627d4,
``openfold/``) computes from ``../shared/data/mmcif``: every protein chain parsed, and for three
query chains (X-ray with one template, NMR with arginines and resolution NaN, X-ray with four
templates and unresolved residues) the raw features and the processed training (two seeds) and
evaluation (one seed) features, with real template structures. Its checker,
``../shared/reference/check_features.py``, writes those inputs to disk, runs ScaleFold's
preprocess -> Store -> raw features -> process_features on them and compares every key (integers
exactly, floats to 1e-5, atom positions to 1e-3 Å, NaN only against NaN).

These tests run the checker's comparison once per session and report it per structure set, per
case and per stage (``raw[seed]``, ``train[seed]``, ``eval[seed]``), so a failure names what
diverged. They skip when ``../shared`` (or ``$SCALEFOLD_SHARED``) is absent. The golden's cases
all have templates; :func:`test_zero_templates_match_the_reference_layout` covers a chain without.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from scalefold.data.parsers.hhr import TemplateHit
from scalefold.data.pipeline import FeatureConfig, process_features
from scalefold.data.raw_features import build_raw_features
from scalefold.data.templates import TemplateHitFeaturizer, empty_template_features

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_NAME = "golden_features_shared.pt"
CHECKER_NAME = "check_features.py"


def _reference_dir() -> Path:
    env = os.environ.get("SCALEFOLD_SHARED")
    return (Path(env) if env else REPO_ROOT.parent / "shared") / "reference"


def _golden_stages() -> list:
    """``(case, stage)`` of every feature comparison group in the golden (collection time)."""
    path = _reference_dir() / GOLDEN_NAME
    if not path.is_file():
        return [pytest.param(None, None, marks=pytest.mark.skip(reason=f"feature golden not found at {path}"))]
    cases = torch.load(path, weights_only=True)["features"]["cases"]
    out = []
    for case, c in cases.items():
        out += [(case, f"raw[{s}]") for s in c["raw"]]
        out += [(case, f"train[{s}]") for s in c["train"]]
        out.append((case, f"eval[{c['eval_seed']}]"))
    return out


@pytest.fixture(scope="module")
def checker(reference_dir: Path):
    path = reference_dir / CHECKER_NAME
    if not path.is_file() or not (reference_dir / GOLDEN_NAME).is_file():
        pytest.skip(f"{CHECKER_NAME} or {GOLDEN_NAME} not found in {reference_dir}")
    spec = importlib.util.spec_from_file_location("scalefold_shared_check_features", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def golden(checker) -> dict:
    return torch.load(checker.GOLDEN, weights_only=True)


@pytest.fixture(scope="module")
def parity(checker, golden, data_dir: Path, tmp_path_factory) -> dict:
    """The checker's candidate (ScaleFold on the golden's inputs) and every comparison row."""
    work = tmp_path_factory.mktemp("feature_parity")
    candidate = checker.build_candidate(golden, (data_dir / "mmcif").resolve(), work)
    rows = checker.compare(golden, candidate)
    return {"candidate": candidate, "rows": rows}


def _differences(rows, keep) -> list[str]:
    return [f"{stage} {key} {chain}: {detail}" for stage, key, chain, diff, detail, differs in rows
            if differs and keep(stage, key, chain)]  # fmt: skip


def test_checker_catches_planted_errors(checker, golden, capsys):
    """The comparison is not vacuous: golden vs itself gives 0 differences, and every planted error
    (a float beyond tolerance, an integer off by one, a missing key, NMR NaN -> 0.0, an atom moved
    2e-3 Å) is reported."""
    assert checker.selftest(golden), capsys.readouterr().out


def test_inputs_and_stored_hits_match(parity):
    """Input files are the golden's (sha256), and the hits read back from the store are its hits."""
    rows = [r for r in parity["rows"] if r[0] == "input"]
    assert rows and not _differences(rows, lambda *_: True)


def test_parsed_structures_match(parity, golden):
    """Every protein chain of every file: chain set, release date, resolution (NaN for NMR), sequence,
    atom mask exactly, positions to 1e-3 Å (arginine NH1/NH2 as deposited)."""
    rows = [r for r in parity["rows"] if r[0] == "structure"]
    assert not _differences(rows, lambda *_: True)
    chains = {r[2] for r in rows if r[1] == "all_atom_positions"}
    assert len(chains) == sum(len(e["chains"]) for e in golden["structures"].values())
    worst = max(r[3] for r in rows if r[1] == "all_atom_positions")
    assert worst == 0.0  # same float32 rounding of the deposited coordinates


@pytest.mark.parametrize("case, stage", _golden_stages())
def test_features_match(parity, golden, case, stage):
    """Every raw / training / evaluation feature of one case and seed: same keys, values (integers
    exact, floats to 1e-5, NaN resolution of NMR entries kept), processed dtype kinds."""
    rows = [r for r in parity["rows"] if r[2] == case and r[0] == stage]
    kind = stage.split("[")[0]
    gc = golden["features"]["cases"][case]
    seed = int(stage[len(kind) + 1 : -1])
    expected = gc["eval"] if kind == "eval" else gc[kind][seed]
    compared = {r[1] for r in rows}
    skipped = set() if kind != "raw" else {"domain_name", "release_date"}  # labels, see the checker
    assert compared == set(expected) - skipped
    assert not _differences(rows, lambda *_: True)


def test_every_comparison_agrees(checker, parity, capsys):
    """The checker's own verdict over all rows (what ``check_features.py`` prints as its last line)."""
    assert checker.report(parity["rows"]) == 0, capsys.readouterr().out
    assert len(parity["rows"]) > 700


# ---------------------------------------------------------------------------------------------
# zero templates (not in the golden: all its cases have templates)


def _reference_empty_template_feats(num_res: int) -> dict:
    """The reference's ``_create_empty_template_feats`` layout (shape, dtype) for comparison."""
    return {
        "template_aatype": ((0, num_res), np.int32),
        "template_all_atom_positions": ((0, num_res, 37, 3), np.float32),
        "template_all_atom_masks": ((0, num_res, 37), np.float32),
        "template_sum_probs": ((0, 1), np.float32),
    }


def _unusable_hit(query: str) -> TemplateHit:
    """A hit whose structure file does not exist: featurised to nothing."""
    n = len(query)
    return TemplateHit(
        index=1, name="9zzz_A missing", aligned_cols=n, sum_probs=50.0, query=query,
        hit_sequence=query[:-1] + "W", indices_query=list(range(n)), indices_hit=list(range(n)),
    )  # fmt: skip


def test_zero_templates_match_the_reference_layout(tmp_path):
    """A chain without a usable template: raw ``template_aatype`` is int32 ``[0, N]`` (no one-hot axis),
    the coordinate arrays float32 ``[0, N, 37(, 3)]``, as the reference -- whether there are no hits
    or every hit fails; processing then gives all-zero template features padded to ``max_templates``
    with ``template_mask`` 0, and the sequence/MSA features do not depend on how "no template" arose."""
    query = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
    n = len(query)
    featurizer = TemplateHitFeaturizer(tmp_path, "2020-01-01")  # empty mmCIF directory
    result = featurizer.get_templates(query, [_unusable_hit(query)])
    assert [s.reason for s in result.skipped] == ["mmcif_missing"]
    for raw in (empty_template_features(n), result.features, build_raw_features(query, "q", [])):
        for key, (shape, dtype) in _reference_empty_template_feats(n).items():
            assert raw[key].shape == shape and raw[key].dtype == dtype, key

    raw = build_raw_features(query, "q", [])
    raw.update(
        all_atom_positions=np.zeros((n, 37, 3), np.float32),
        all_atom_mask=np.ones((n, 37), np.float32),
        resolution=np.array([math.nan], np.float32),
        is_distillation=np.array(0.0, np.float32),
    )
    cfg = FeatureConfig.tiny()
    for mode, seed in (("train", 7), ("eval", 99)):
        sample = process_features(raw, cfg, mode, seed)
        again = process_features({**raw, **result.features}, cfg, mode, seed)
        assert set(sample) == set(again)
        for key in sample:
            torch.testing.assert_close(sample[key], again[key], rtol=0, atol=0, equal_nan=True, msg=key)
        assert sample["template_aatype"].dtype == torch.int64
        assert sample["template_aatype"].shape[0] == cfg.max_templates
        for key in sample:
            if key.startswith("template_"):
                assert not sample[key].any(), key
        assert torch.isnan(sample["resolution"]).all()
