"""``scalefold export-chain`` and the shipped example ``examples/demo_target/``; ``predict --reference``.

The example is the export of the demo store's first held-out validation chain; the demo store is
synthesised deterministically, so a fresh synthesis + export must reproduce the shipped files byte
for byte (the README's "After the demo" commands use them).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from scalefold.cli import main
from scalefold.data.store import Store
from scalefold.data.synthetic import synthesize
from scalefold.inference.compare import RG_EXPONENT, RG_PREFACTOR, ca_geometry, lddt_ca_against, read_reference_ca
from scalefold.inference.export import FILE_NAMES, export_chain

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "demo_target"


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / "small.h5"
    synthesize(path, num_chains=8, num_families=1, length_range=(24, 28), seed=3, workers=1)
    return path


@pytest.mark.slow  # synthesises the 320-chain demo store: ~20 s of CPU
def test_shipped_example_equals_a_fresh_export_of_the_demo_store(tmp_path):
    """Synthesise the demo store as `scalefold train` does (the demo preset's synth_* options), export
    its default chain: the files equal examples/demo_target/ (regenerate them with the README's command)."""
    from scalefold.config.training import TrainConfig

    cfg = TrainConfig.from_preset("demo", env={})
    store = tmp_path / Path(cfg.store).name  # the file name appears in the FASTA header
    synthesize(store, num_chains=cfg.synth_num_chains, num_families=cfg.synth_num_families,
               length_range=tuple(cfg.synth_length_range), seed=cfg.synth_seed, workers=2)  # fmt: skip
    assert main(["export-chain", "--store", str(store), "--out-dir", str(tmp_path / "fresh")]) == 0
    for name in FILE_NAMES.values():
        assert (tmp_path / "fresh" / name).read_text() == (EXAMPLE / name).read_text(), name
    with Store.open(store) as s:  # the default chain is held out of training by the demo's split
        from scalefold.train.training_data import validation_chain_ids

        chain = (EXAMPLE / "target.fasta").read_text().split()[0][1:]
        assert chain in validation_chain_ids(s, cfg)


def test_a3m_gives_back_the_stored_msa_and_the_pdb_the_stored_structure(small_store, tmp_path):
    from scalefold.data.parsers.msa import parse_msa_file
    from scalefold.residue_constants import HHBLITS_AA_TO_ID

    with Store.open(small_store) as s:
        chain_id = s.chain_ids[5]
        stored = s.get(chain_id)
    paths = export_chain(small_store, tmp_path, chain_id)
    msa = parse_msa_file(paths["a3m"])
    ids = np.array([[HHBLITS_AA_TO_ID[c] for c in row] for row in msa.sequences])
    np.testing.assert_array_equal(ids, stored["msa"])
    np.testing.assert_array_equal(np.array(msa.deletion_matrix), stored["deletion_matrix"])
    assert paths["fasta"].read_text().splitlines()[1] == stored["sequence"]
    ca, mask = read_reference_ca(paths["structure"], stored["sequence"])
    true_mask = stored["all_atom_mask"][:, 1] > 0
    np.testing.assert_array_equal(mask, true_mask)
    np.testing.assert_allclose(ca[mask], stored["all_atom_positions"][true_mask, 1], atol=1e-3)


def test_ca_geometry_and_lddt():
    n = 30
    t = np.arange(n)
    helix = np.stack([2.3 * np.cos(t * 100 / 180 * math.pi), 2.3 * np.sin(t * 100 / 180 * math.pi), 1.5 * t], -1)
    g = ca_geometry(helix)
    assert g.ca_ca_min == pytest.approx(g.ca_ca_max) and 3.7 < g.ca_ca_mean < 3.9  # an alpha helix: 3.8 Å steps
    assert g.expected_radius_of_gyration == pytest.approx(RG_PREFACTOR * n**RG_EXPONENT)
    collapsed = ca_geometry(np.zeros((n, 3)))
    assert collapsed.ca_ca_max == 0 and collapsed.radius_of_gyration == 0
    mask = np.ones(n, bool)
    assert lddt_ca_against(helix, helix, mask) == pytest.approx(1.0)
    assert lddt_ca_against(np.zeros((n, 3)), helix, mask) < 0.3
    mask[:5] = False  # residues without a true Cα do not count
    assert lddt_ca_against(helix, helix, mask) == pytest.approx(1.0)


def test_predict_with_reference_prints_lddt_and_geometry(small_store, tmp_path, capsys):
    """The CLI path: an exported chain, a tiny checkpoint (what a tiny run writes), PDB and mmCIF references."""
    import torch

    from scalefold.checkpoint.files import build_checkpoint, save_atomic
    from scalefold.model import AlphaFold, AlphaFoldConfig

    torch.manual_seed(0)
    ckpt = save_atomic(build_checkpoint(AlphaFold(AlphaFoldConfig.from_preset("tiny")).state_dict(), {}, 0),
                       tmp_path / "tiny.pt")  # fmt: skip
    paths = export_chain(small_store, tmp_path / "ex")
    args = ["predict", "--fasta", str(paths["fasta"]), "--a3m", str(paths["a3m"]), "--checkpoint", str(ckpt),
            "--num-recycling", "0"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "p.cif"), "--reference", str(paths["structure"])]) == 0
    out = capsys.readouterr().out
    assert "consecutive Cα distance: mean" in out and "radius of gyration:" in out
    line = next(x for x in out.splitlines() if x.startswith("lDDT-Cα against"))
    assert 0.0 <= float(line.split(": ")[1].split()[0]) <= 1.0
    # the prediction against itself as the reference (mmCIF this time): 1.0
    assert main([*args, "--out", str(tmp_path / "q.pdb"), "--reference", str(tmp_path / "p.cif")]) == 0
    assert "against" in (out := capsys.readouterr().out) and ": 1.0000 (" in out
