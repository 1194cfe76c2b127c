"""Synthetic protein data (``scalefold synth``): determinism, geometry, MSAs, store round trip."""

from __future__ import annotations

import numpy as np
import pytest

from scalefold import residue_constants as rc
from scalefold.data import synthetic as synth

N, CA, C, O = (rc.atom_order[a] for a in ("N", "CA", "C", "O"))


@pytest.fixture(scope="module")
def family():
    return synth.generate_family(0, num_members=3, length=60, seed=123, num_validation=1)


def test_family_is_deterministic(family):
    """Same seed -> identical chains (coordinates, sequences, MSAs)."""
    again = synth.generate_family(0, num_members=3, length=60, seed=123, num_validation=1)
    for a, b in zip(family, again):
        assert a.sequence == b.sequence
        np.testing.assert_array_equal(a.all_atom_positions, b.all_atom_positions)
        np.testing.assert_array_equal(a.msa, b.msa)
        np.testing.assert_array_equal(a.deletion_matrix, b.deletion_matrix)
    other = synth.generate_family(0, num_members=3, length=60, seed=124)
    assert other[0].sequence != family[0].sequence


def test_backbone_geometry_is_ideal(family):
    """Bond lengths N-CA, CA-C, C-N(+1) and consecutive CA-CA are ideal; peptides are trans/planar."""
    for chain in family:
        x, m = chain.all_atom_positions.astype(np.float64), chain.all_atom_mask
        ok = m[:, N] * m[:, CA] * m[:, C] > 0
        pair = ok[:-1] & ok[1:]
        n_ca = np.linalg.norm(x[ok, CA] - x[ok, N], axis=-1)
        ca_c = np.linalg.norm(x[ok, C] - x[ok, CA], axis=-1)
        c_n = np.linalg.norm(x[1:, N] - x[:-1, C], axis=-1)[pair]
        ca_ca = np.linalg.norm(x[1:, CA] - x[:-1, CA], axis=-1)[pair]
        np.testing.assert_allclose(n_ca, 1.46, atol=0.02)
        np.testing.assert_allclose(ca_c, 1.525, atol=0.02)
        np.testing.assert_allclose(c_n, rc.between_res_bond_length_c_n[0], atol=0.01)
        np.testing.assert_allclose(ca_ca, rc.ca_ca, atol=0.05)
        omega = synth.dihedral(x[:-1, CA], x[:-1, C], x[1:, N], x[1:, CA])[pair]
        assert np.all(np.abs(np.abs(omega) - 180.0) < 15.0)
        # Carbonyl O in the peptide plane: O-C-N-CA = omega - 180.
        has_o = (m[:-1, O] > 0)[pair]
        planar = synth.dihedral(x[:-1, O], x[:-1, C], x[1:, N], x[1:, CA])[pair][has_o]
        np.testing.assert_allclose((planar - omega[has_o]) % 360.0, 180.0, atol=0.5)


def test_no_severe_clashes_and_compact(family):
    """No two heavy atoms of different residues closer than 2.0 A (bonded peptide pairs aside);
    the chain is folded (radius of gyration well below an extended chain's)."""
    for chain in family:
        assert synth.min_interresidue_distance(chain.all_atom_positions, chain.all_atom_mask) > 2.0
        ca = chain.all_atom_positions[chain.all_atom_mask[:, CA] > 0, CA]
        rg = synth.radius_of_gyration(ca)
        assert rg < 1.5 * 2.2 * len(ca) ** 0.38  # globular: real chains are ~1.0-1.2x 2.2 N^0.38 A


def test_folds_are_globular():
    """Fold templates over a range of lengths are about as compact as real small proteins:
    radius of gyration within 1.5x of 2.2 N^0.38 A (an extended chain would be ~3x)."""
    ratios = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        length = int(rng.integers(40, 81))
        fold = synth.make_fold_template(length, rng)
        ratios.append(synth.radius_of_gyration(fold.backbone[:, 1]) / (2.2 * length**0.38))
    assert max(ratios) < 1.5, ratios
    assert np.mean(ratios) < 1.35, ratios


def test_atoms_follow_residue_types(family):
    """The atom mask is the residue type's heavy atoms (except unresolved terminal residues)."""
    for chain in family:
        expected = rc.STANDARD_ATOM_MASK[chain.aatype]
        resolved = chain.all_atom_mask.sum(-1) > 0
        np.testing.assert_array_equal(chain.all_atom_mask[resolved], expected[resolved])
        assert resolved.sum() >= len(chain.sequence) - 2 * synth.SynthConfig().max_disordered_terminus


def test_torsions_round_trip():
    """Sampled chi angles and psi are what the structure shows (Alg. 24 placement is consistent)."""
    rng = np.random.default_rng(0)
    aatype = np.arange(20)
    phi = np.full(20, -63.0)
    psi = np.full(20, -42.0)
    backbone = synth.build_backbone(aatype, phi, psi, np.full(20, 180.0))
    chis = synth.sample_chis(aatype, 1, rng)
    atom37, mask = synth.atom14_to_atom37_numpy(synth.backbone_to_atom14(backbone, aatype, psi, chis)[0], aatype)
    o_dihedral = synth.dihedral(atom37[:, N], atom37[:, CA], atom37[:, C], atom37[:, O])
    np.testing.assert_allclose((o_dihedral - psi) % 360.0, 180.0, atol=1e-6)
    for i, a in enumerate(aatype):
        for k, atoms in enumerate(rc.chi_angles_atoms[rc.resnames[a]]):
            got = synth.dihedral(*[atom37[i, rc.atom_order[name]] for name in atoms])
            assert abs((got - chis[0, i, k] + 180.0) % 360.0 - 180.0) < 1e-5


def test_family_members_share_the_fold(family):
    """Members of a family superimpose closely (CA RMSD < 3 A) while their sequences differ."""
    ca = [c.all_atom_positions[:, CA].astype(np.float64) for c in family]
    mask = np.all([c.all_atom_mask[:, CA] > 0 for c in family], axis=0)
    a = ca[0][mask] - ca[0][mask].mean(0)
    for other in ca[1:]:
        b = other[mask] - other[mask].mean(0)
        s = np.linalg.svd(a.T @ b, compute_uv=False)
        sign = np.sign(np.linalg.det(a.T @ b))
        rmsd = np.sqrt(max((a**2).sum() + (b**2).sum() - 2 * (s[0] + s[1] + sign * s[2]), 0.0) / mask.sum())
        assert rmsd < 3.0
    assert len({c.sequence for c in family}) == len(family)


def test_family_fold_is_the_learnable_signal(family):
    """The demo's signal: held-out members of a family share its fold (lDDT-Ca >= 0.85 against every
    other member, the ceiling for a model that recognises the family from sequence and MSA), while an
    unrelated fold of the same length scores clearly lower (only the local secondary structure agrees)."""
    import torch

    from scalefold.lddt import validation_lddt_ca

    def score(a, b) -> float:
        mask = torch.tensor(a.all_atom_mask * b.all_atom_mask, dtype=torch.float32)[None]
        return float(
            validation_lddt_ca(torch.tensor(a.all_atom_positions)[None], torch.tensor(b.all_atom_positions)[None], mask)
        )

    within = [score(a, b) for a in family for b in family if a is not b]
    unrelated = synth.generate_family(1, num_members=1, length=60, seed=321)[0]
    across = [score(unrelated, member) for member in family]
    assert min(within) >= 0.85
    assert max(across) < min(within) - 0.2


def test_msa_shape_query_gaps_and_deletions(family):
    """Row 0 is the query (HHblits ids); depth within the configured range; gaps carry no deletions."""
    cfg = synth.SynthConfig()
    for chain in family:
        depth, length = chain.msa.shape
        assert cfg.msa_depth[0] <= depth <= cfg.msa_depth[1] and length == len(chain.sequence)
        assert "".join(rc.ID_TO_HHBLITS_AA[int(i)] for i in chain.msa[0]) == chain.sequence
        assert chain.deletion_matrix.shape == chain.msa.shape
        assert np.all(chain.deletion_matrix[chain.msa == synth.HHBLITS_GAP] == 0)
        assert chain.msa.min() >= 0 and chain.msa.max() <= synth.HHBLITS_GAP


def test_msa_has_coevolving_contacts():
    """Coupled residue pairs (in contact in the fold) only take the family's allowed pair states,
    while independent positions vary freely: co-variation is visible in the MSA."""
    rng = np.random.default_rng(5)
    cfg = synth.SynthConfig()
    template = synth.make_fold_template(70, rng, cfg)
    model = synth.SequenceModel.sample(template, rng, cfg)
    assert len(model.pairs) > 0
    query = model.ancestor(rng)
    msa, _ = synth.make_msa(query, template.ss, model, 150, rng, cfg)
    allowed = {(p, tuple(s)) for p in range(len(model.pairs)) for s in model.pair_states[p]}
    for p, (i, j) in enumerate(model.pairs):
        both = (msa[:, i] != synth.HHBLITS_GAP) & (msa[:, j] != synth.HHBLITS_GAP)
        to_ours = {int(h): k for k, h in enumerate(synth.OURS_TO_HHBLITS)}
        states = {(to_ours[int(a)], to_ours[int(b)]) for a, b in zip(msa[both, i], msa[both, j])}
        assert all((p, s) in allowed for s in states)
        assert len(states) > 1  # they do mutate


def test_store_round_trip(tmp_path):
    """synthesize() writes a store the reader returns unchanged; training filters keep the
    training chains; the chain table marks held-out members with validation-window dates."""
    from scalefold.data.pipeline import TrainingChainFilter
    from scalefold.data.store import Store

    path = tmp_path / "synth.h5"
    cfg = synth.SynthConfig(validation_fraction=0.34)  # one of three members per family
    summary = synth.synthesize(path, num_chains=6, num_families=2, length_range=(40, 48), seed=3, config=cfg)
    assert summary["chains"] == 6 and summary["validation"] == 2
    again = synth.synthesize(
        tmp_path / "again.h5", num_chains=6, num_families=2, length_range=(40, 48), seed=3, config=cfg
    )
    assert again["residues"] == summary["residues"]
    with Store.open(path) as store, Store.open(tmp_path / "again.h5") as other:
        assert store.chain_ids == other.chain_ids == [f"s{k:04d}_A" for k in range(6)]
        table = store.chain_table(with_sequence=True)
        keep = TrainingChainFilter().mask(
            table["release_date"], table["resolution"], table["sequence"], table["cluster_id"]
        )
        assert keep.sum() == 4
        assert all(d > "2021-09-16" for d in table["release_date"][~keep])
        for chain_id in store.chain_ids:
            a, b = store.get(chain_id), other.get(chain_id)
            assert a["sequence"] == b["sequence"] and len(a["sequence"]) >= 40
            np.testing.assert_array_equal(a["all_atom_positions"], b["all_atom_positions"])
            np.testing.assert_array_equal(a["msa"], b["msa"])
            assert a["all_atom_positions"].shape == (len(a["sequence"]), 37, 3)
            assert a["msa"][0].tolist() == [rc.HHBLITS_AA_TO_ID[c] for c in a["sequence"]]
            assert a["cluster_id"] in (0, 1) and 1.0 < a["resolution"] < 3.5


def test_templates_are_earlier_family_members(tmp_path):
    """Each chain's template hits are members of its own family released >= 60 days earlier,
    carrying that member's structure; training batches built from the store contain them."""
    import datetime

    from scalefold.data.dataset import StoreSample
    from scalefold.data.pipeline import FeatureConfig
    from scalefold.data.store import Store

    path = tmp_path / "synth.h5"
    summary = synth.synthesize(path, num_chains=12, num_families=2, length_range=(40, 44), seed=5)
    assert summary["template_hits"] > 0
    with Store.open(path) as store:
        table = store.chain_table()
        info = {str(c): (int(f), str(d)) for c, f, d in zip(table["chain_id"], table["cluster_id"], table["release_date"])}
        with_templates = 0
        for chain_id in store.chain_ids:
            chain = store.get(chain_id)
            outcomes = chain.get("template_outcomes") or []
            assert len(outcomes) <= synth.SynthConfig().max_template_hits
            with_templates += bool(outcomes)
            family, date = info[chain_id]
            for outcome in outcomes:
                hit = store.get(outcome.template.domain_name)
                hit_family, hit_date = info[outcome.template.domain_name]
                assert hit_family == family and outcome.template.domain_name != chain_id
                age = datetime.date.fromisoformat(date) - datetime.date.fromisoformat(hit_date)
                assert age.days >= 60
                index = outcome.template.query_index
                np.testing.assert_array_equal(outcome.template.all_atom_positions, hit["all_atom_positions"][index])
        assert with_templates >= len(store.chain_ids) // 2
        ids = store.chain_ids
    features = FeatureConfig(max_templates=2, train_sequence_crop_size=32)
    sample = StoreSample(str(path), ids, features, mode="eval")
    last = max(range(len(ids)), key=lambda i: info[ids[i]][1])  # the newest chain has earlier members
    batch = sample(last, 0)
    assert batch["template_mask"].sum() > 0
    assert batch["template_all_atom_positions"].abs().sum() > 0
