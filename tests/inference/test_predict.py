"""``scalefold predict``: FASTA/a3m input checks, checkpoint layouts, the written structure."""

from __future__ import annotations

import gemmi
import numpy as np
import pytest
import torch

from scalefold.cli import main
from scalefold.data.parsers.mmcif import parse_mmcif
from scalefold.inference.predict import build_features, predict, read_alignment, read_fasta
from scalefold.inference.weights import InferenceError, load_model

SEQUENCE = "MKTAYIAKQRQISFVKSHFSRQ"  # 22 residues


def write_fasta(path, sequence=SEQUENCE, name="target1 a test protein"):
    path.write_text(f">{name}\n{sequence[:10]}\n{sequence[10:]}\n")
    return path


def write_a3m(path, query=SEQUENCE):
    rows = [query, "MKTAYLAKQRQIsgSFVKSHFSRQ", "-KTAYIAKQRQISFVKSHF---", "MRTAYIAKQRQISFaVKSHFSRE"]
    path.write_text("".join(f">seq{i}\n{row}\n" for i, row in enumerate(rows)))
    return path


# ----------------------------------------------------------------------------------------------
# input files


def test_fasta_unknown_letters_become_x_and_lowercase_is_accepted(tmp_path):
    record = read_fasta(write_fasta(tmp_path / "t.fasta", sequence="mktaBZUOJyiakqrqisfv"))
    assert record.sequence == "MKTAXXXXXYIAKQRQISFV" and record.num_unknown == 5 and record.name == "target1"


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "not a text FASTA"),
        (b"MKTAYIAKQR\n", "not a FASTA file"),
        (b"", "no FASTA record"),
        (b">empty\n\n", "empty sequence"),
        (b">a\nMKTA\n>b\nMKTA\n", "2 records"),
        (b">a\nMKTA*1YI\n", "not amino-acid letters"),
    ],
)
def test_bad_fasta_is_refused_with_a_clear_message(tmp_path, content, message):
    path = tmp_path / "bad.fasta"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InferenceError, match=message):
        read_fasta(path)


def test_alignment_of_another_sequence_is_refused(tmp_path):
    assert len(read_alignment(write_a3m(tmp_path / "ok.a3m"), SEQUENCE)) == 4
    other = SEQUENCE[:5] + "W" + SEQUENCE[6:]
    with pytest.raises(InferenceError, match="differs from the FASTA sequence at 1 positions .*residue 6"):
        read_alignment(write_a3m(tmp_path / "other.a3m", query=other), SEQUENCE)
    with pytest.raises(InferenceError, match="has 22 residues, the FASTA sequence 23"):
        read_alignment(tmp_path / "ok.a3m", SEQUENCE + "A")
    gapped = tmp_path / "gapped.a3m"
    gapped.write_text(f">q\n{SEQUENCE[:-1]}-\n")
    with pytest.raises(InferenceError, match="query.* has gaps"):
        read_alignment(gapped, SEQUENCE)
    # An unknown residue may be spelled X in the alignment and as another letter in the FASTA.
    read_alignment(write_a3m(tmp_path / "x.a3m", query="X" + SEQUENCE[1:]), "X" + SEQUENCE[1:])


# ----------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoint_layouts_and_weight_choice(checkpoints, tiny_models):
    """Own checkpoints give SWA weights by default (model weights on request); the reference
    resumable layout, the reference SWA file and a bare DDP state dict load too; the preset is detected."""
    model, swa = tiny_models
    name = "evoformer_stack.blocks.0.msa_att_row.mha.linear_q.weight"
    cases = [("own", "auto", swa, "swa"), ("own", "model", model, "model"), ("no_swa", "auto", model, "model"),
             ("reference", "auto", model, "model"), ("swa_file", "auto", swa, "swa"), ("bare", "auto", model, "model")]  # fmt: skip
    for key, weights, source, used in cases:
        loaded = load_model(checkpoints[key], weights=weights)
        assert (loaded.preset, loaded.weights) == ("tiny", used), key
        assert torch.equal(loaded.model.state_dict()[name], source.state_dict()[name]), key
        assert not loaded.model.training
    assert load_model(checkpoints["reference"]).iteration == 11
    with pytest.raises(InferenceError, match="no SWA weights"):
        load_model(checkpoints["no_swa"], weights="swa")
    with pytest.raises(InferenceError, match="only SWA weights"):
        load_model(checkpoints["swa_file"], weights="model")


def test_mismatched_or_damaged_checkpoints_are_refused(checkpoints, tmp_path):
    from scalefold.checkpoint.files import CheckpointError

    with pytest.raises(InferenceError, match=r"(?s)does not fit the 'demo' preset.*29 mis-shaped.*structure_module"):
        load_model(checkpoints["own"], preset="demo")
    sd = torch.load(checkpoints["bare"], weights_only=True)
    del sd["module.structure_module.ipa.linear_b.weight"]
    sd["module.extra.weight"] = torch.zeros(3)
    torch.save(sd, tmp_path / "edited.pt")
    with pytest.raises(
        InferenceError, match=r"(?s)matches no model preset.*'tiny'.*1 missing.*linear_b.*1 unexpected.*extra"
    ):
        load_model(tmp_path / "edited.pt")
    data = checkpoints["own"].read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(tmp_path / "truncated.pt")
    torch.save({"epoch": 3}, tmp_path / "notamodel.pt")
    with pytest.raises(InferenceError, match="not a model checkpoint"):
        load_model(tmp_path / "notamodel.pt")


# ----------------------------------------------------------------------------------------------
# predictions


def test_predict_writes_the_model_outputs_with_plddt_as_bfactor(checkpoints, tmp_path):
    """The mmCIF holds exactly the model's final_atom_positions where final_atom_mask is set (to file
    precision), the full sequence, and per-residue pLDDT (from the lDDT head) as B-factors; the PDB
    agrees with it. Features run the same pipeline (same seed) as a direct model call."""
    fasta = write_fasta(tmp_path / "t.fasta", sequence=SEQUENCE[:8] + "B" + SEQUENCE[9:])
    a3m = tmp_path / "t.a3m"
    write_a3m(a3m, query=SEQUENCE[:8] + "X" + SEQUENCE[9:])
    cif = predict(fasta, checkpoints["own"], a3m=[a3m], out=tmp_path / "p.cif", num_recycling=2)
    pdb = predict(fasta, checkpoints["own"], a3m=[a3m], out=tmp_path / "p.pdb", num_recycling=2)
    assert cif.structure.sequence[8] == "X" and cif.loaded.config.num_recycling_iters == 2

    loaded = load_model(checkpoints["own"], num_recycling=2)
    batch = build_features(cif.record, [read_alignment(a3m, cif.record.sequence)], loaded.config)
    assert batch["aatype"].shape == (1, len(SEQUENCE), 3)
    with torch.no_grad():
        out = loaded.model(batch)
    positions, mask = out["final_atom_positions"][0].numpy(), out["final_atom_mask"][0].numpy()
    plddt = out["plddt"][0].numpy()
    assert plddt.std() > 0.01  # the test can tell residues apart

    chain = parse_mmcif(cif.out).chains["A"]
    assert chain.sequence == cif.structure.sequence
    np.testing.assert_array_equal(chain.all_atom_mask, mask)
    np.testing.assert_allclose(chain.all_atom_positions, positions * mask[..., None], atol=6e-4)
    for path in (cif.out, pdb.out):
        st = gemmi.read_structure(str(path))
        b = {r.seqid.num: {a.b_iso for a in r} for r in st[0]["A"]}
        np.testing.assert_allclose([next(iter(v)) for v in b.values()], plddt[[k - 1 for k in b]], atol=5e-3)
        assert all(len(v) == 1 for v in b.values())
    assert abs(cif.mean_plddt - float(plddt.mean())) < 1e-4


def test_predict_on_real_alignments(data_dir, checkpoints, tmp_path):
    """The 73-residue query of the shared data with its UniRef90 (Stockholm), BFD (a3m, 1,024 rows)
    and MGnify (Stockholm) alignments, deduplicated across files, written as PDB."""
    from scalefold.data.parsers.msa import merge_msas, parse_msa_file

    query = data_dir / "alignments" / "query"
    files = [query / "uniref90_hits.sto", query / "bfd_uniclust_hits.a3m", query / "mgnify_hits.sto"]
    result = predict(query / "query.fasta", checkpoints["swa_file"], a3m=files, out=tmp_path / "query.pdb",
                     num_recycling=1)  # fmt: skip
    assert result.num_alignment_rows == len(merge_msas([parse_msa_file(f) for f in files])) > 1024
    assert len(result.structure.sequence) == 73
    st = gemmi.read_structure(str(result.out))
    st.setup_entities()
    assert gemmi.one_letter_code(list(st.entities[0].full_sequence)) == result.record.sequence
    assert 0.0 <= result.mean_plddt <= 100.0
    with pytest.raises(InferenceError, match="recycling iterations must be >= 0"):
        predict(query / "query.fasta", checkpoints["swa_file"], num_recycling=-1)


def test_cli_predict_prints_mean_plddt_and_rejects_bad_input(checkpoints, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fasta = write_fasta(tmp_path / "t.fasta")
    assert (
        main(["predict", "--fasta", str(fasta), "--checkpoint", str(checkpoints["own"]), "--num-recycling", "0"]) == 0
    )
    out = capsys.readouterr().out
    assert "mean pLDDT:" in out and "swa weights" in out and (tmp_path / "target1.cif").is_file()
    other = write_a3m(tmp_path / "o.a3m", query="W" + SEQUENCE[1:])
    rc = main(["predict", "--fasta", str(fasta), "--a3m", str(other), "--checkpoint", str(checkpoints["own"])])
    err = capsys.readouterr().err
    assert rc == 3 and err.startswith("scalefold predict: error: ") and "differs from the FASTA sequence" in err
    rc = main(["predict", "--fasta", str(fasta), "--checkpoint", str(checkpoints["own"]), "--preset", "mlperf"])
    assert rc == 3 and "does not fit the 'mlperf' preset" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--checkpoint" in capsys.readouterr().out


def test_cli_choices_match_the_loader():
    """The parser's preset/weight choices (kept import-light) are the loader's."""
    from scalefold.commands import inference as cli
    from scalefold.inference import weights

    assert set(cli.MODEL_PRESETS) == set(weights.MODEL_PRESETS) and cli.WEIGHT_CHOICES == weights.WEIGHT_CHOICES
