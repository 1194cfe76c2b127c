"""The model validates its input batch: a missing feature, a wrong rank/shape or dtype raises a
``ValueError`` that names the feature (``scalefold.model.features.validate_batch``)."""

from __future__ import annotations

import pytest
import torch

from scalefold.model.features import FEATURES, make_synthetic_batch, required_features, validate_batch

MODEL_FEATURES = required_features("model")


@pytest.fixture()
def batch():
    return make_synthetic_batch(n_res=6, n_clust=3, n_extra_seq=4, n_templ=2, num_recycling_iters=1)


def test_valid_batch_binds_all_sizes(batch):
    """A well-formed batch passes and the symbolic sizes are bound from it."""
    sizes = validate_batch(batch, FEATURES)
    assert sizes == {
        "B": 1,
        "R": 2,
        "N_res": 6,
        "N_clust": 3,
        "N_extra_seq": 4,
        "N_templ": 2,
        "msa_dim": 49,
        "tf_dim": 22,
    }


def test_model_features_cover_what_the_model_reads():
    """The model-consumed set matches the reference's feature interface."""
    assert set(MODEL_FEATURES) == {
        "aatype",
        "residue_index",
        "target_feat",
        "msa_feat",
        "seq_mask",
        "msa_mask",
        "extra_msa",
        "extra_has_deletion",
        "extra_deletion_value",
        "extra_msa_mask",
        "atom37_atom_exists",
        "residx_atom37_to_atom14",
        "template_aatype",
        "template_all_atom_mask",
        "template_all_atom_positions",
        "template_alt_torsion_angles_sin_cos",
        "template_mask",
        "template_pseudo_beta",
        "template_pseudo_beta_mask",
        "template_torsion_angles_mask",
        "template_torsion_angles_sin_cos",
    }
    assert not any(n.startswith("template_") for n in required_features("model", templates_enabled=False))


def test_missing_feature_is_named(batch):
    """A missing key raises and names the key."""
    del batch["extra_msa"]
    with pytest.raises(ValueError, match="extra_msa"):
        validate_batch(batch, MODEL_FEATURES)


def test_wrong_rank_is_named(batch):
    """Dropping the recycling dimension of one feature is a rank error naming that feature."""
    batch["msa_feat"] = batch["msa_feat"][..., 0]
    with pytest.raises(ValueError, match="'msa_feat' has rank"):
        validate_batch(batch, MODEL_FEATURES)


def test_inconsistent_size_is_named(batch):
    """N_res disagreeing with the first feature that bound it is reported for the offender."""
    batch["seq_mask"] = torch.ones(1, 7, 2)
    with pytest.raises(ValueError, match="'seq_mask'.*N_res=6"):
        validate_batch(batch, MODEL_FEATURES)


def test_wrong_fixed_dim_is_named(batch):
    """A fixed channel count (msa_feat's 49) is checked."""
    batch["msa_feat"] = batch["msa_feat"][..., :48, :]
    with pytest.raises(ValueError, match="'msa_feat'.*expected msa_dim=49"):
        validate_batch(batch, MODEL_FEATURES, symbols={"msa_dim": 49, "tf_dim": 22})


def test_wrong_dtype_is_named(batch):
    """Index features must be int64, the others floating point."""
    bad = dict(batch, aatype=batch["aatype"].float())
    with pytest.raises(ValueError, match="'aatype' has dtype"):
        validate_batch(bad, MODEL_FEATURES)
    bad = dict(batch, seq_mask=batch["seq_mask"].long())
    with pytest.raises(ValueError, match="'seq_mask' has dtype"):
        validate_batch(bad, MODEL_FEATURES)


def test_alphafold_forward_validates_first(batch):
    """``AlphaFold.forward`` rejects a bad batch before computing anything."""
    from scalefold.model.alphafold import AlphaFold
    from scalefold.model.config import AlphaFoldConfig

    model = AlphaFold(AlphaFoldConfig.from_preset("tiny"))
    del batch["template_mask"]
    with pytest.raises(ValueError, match="template_mask"):
        model(batch)
    batch = make_synthetic_batch(n_res=6, n_clust=3, n_extra_seq=4, n_templ=2, tf_dim=21)
    with pytest.raises(ValueError, match="'target_feat'.*tf_dim=22"):
        model(batch)
