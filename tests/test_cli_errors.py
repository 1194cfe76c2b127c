"""Every ordinary mistake with every subcommand's inputs ends the same way: exit status 3 and a short
message on stderr that names the offending path or option -- never a traceback (``--debug`` or
``SCALEFOLD_DEBUG=1`` shows one). Usage errors argparse catches keep status 2.

One parametrised case per subcommand and input kind: missing, a directory instead of a file (and vice
versa), empty, truncated, another format (a FASTA given as a store or checkpoint), an output location
that cannot be written, a value out of range. The cases run ``main()`` in-process (fast); a few run the
real ``scalefold`` process, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scalefold.cli import main

REPO = Path(__file__).resolve().parents[1]
SEQUENCE = "MKTAYIAKQRQISFVKSHFSRQ"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Good inputs (a tiny store and checkpoint, a FASTA, an a3m) and every kind of bad one."""
    import h5py
    import torch

    from scalefold.checkpoint.files import build_checkpoint, save_atomic
    from scalefold.data.synthetic import synthesize
    from scalefold.model import AlphaFold, AlphaFoldConfig

    root = tmp_path_factory.mktemp("cli_errors")
    store = root / "store.h5"
    synthesize(store, num_chains=8, num_families=1, length_range=(20, 24), seed=0, workers=1)
    ckpt = root / "tiny.pt"
    torch.manual_seed(0)
    save_atomic(build_checkpoint(AlphaFold(AlphaFoldConfig.from_preset("tiny")).state_dict(), {}, 0), ckpt)
    fasta = root / "target.fasta"
    fasta.write_text(f">target\n{SEQUENCE}\n")
    a3m = root / "target.a3m"
    a3m.write_text(f">target\n{SEQUENCE}\n>hit\n{SEQUENCE[:-3]}---\n")
    other_a3m = root / "other.a3m"
    other_a3m.write_text(f">other\n{'W' + SEQUENCE[1:]}\n")
    (root / "empty").write_bytes(b"")
    (root / "truncated.h5").write_bytes(store.read_bytes()[:3000])
    (root / "truncated.pt").write_bytes(ckpt.read_bytes()[:200])
    with h5py.File(root / "plain.h5", "w") as f:
        f["x"] = [1, 2, 3]  # an HDF5 file, not a store
    (root / "adir").mkdir()
    (root / "no_cif").mkdir()
    (root / "cifs").mkdir()
    (root / "cifs" / "1abc.cif").write_text("data_1ABC\n")  # a directory with an mmCIF file (not read)
    (root / "unknown_key.toml").write_text("max_steps = 2\nnot_an_option = 1\n")
    (root / "broken.toml").write_text("max_steps = = 2\n")
    (root / "broken.yaml").write_text("max_steps: [1, 2\n")
    (root / "config.txt").write_text("max_steps = 2\n")
    (root / "wrong_type.toml").write_text('max_steps = "two"\n')
    (root / "binary.fasta").write_bytes(bytes(range(256)))
    resume = root / "resume_run" / "checkpoints"
    resume.mkdir(parents=True)
    (resume / "checkpoint_00000002.pt").write_text(f">target\n{SEQUENCE}\n")  # not a checkpoint
    paths = {p.name.replace(".", "_"): str(p) for p in root.iterdir()}  # e.g. broken_toml, no_cif
    paths.update(
        root=str(root), store=str(store), ckpt=str(ckpt), fasta=str(fasta), a3m=str(a3m), other_a3m=str(other_a3m),
        missing=str(root / "missing"), empty=str(root / "empty"), dir=str(root / "adir"),
        truncated_store=str(root / "truncated.h5"), truncated_ckpt=str(root / "truncated.pt"),
        plain_h5=str(root / "plain.h5"), under_file=str(fasta / "out"), resume_run=str(root / "resume_run"),
    )  # fmt: skip
    return paths


TRAIN = ["train", "--preset", "tiny", "--no-progress", "--overwrite", "--max-steps", "1", "--out", "{root}/run"]
PREDICT = ["predict", "--fasta", "{fasta}", "--checkpoint", "{ckpt}", "--out", "{root}/p.pdb"]
EVALUATE = ["evaluate", "--store", "{store}", "--checkpoint", "{ckpt}", "--no-progress"]
PREPROCESS = ["preprocess", "--out", "{root}/pre.h5", "--no-progress"]

# (case id, argv, substrings the message must contain: the offending input and what was wrong)
CASES = [
    # data-stats STORE
    ("data-stats/missing", ["data-stats", "{missing}.h5"], ["missing.h5", "does not exist"]),
    ("data-stats/directory", ["data-stats", "{dir}"], ["adir", "is a directory"]),
    ("data-stats/empty", ["data-stats", "{empty}"], ["empty", "is empty"]),
    ("data-stats/fasta", ["data-stats", "{fasta}"], ["target.fasta", "not an HDF5 file"]),
    ("data-stats/truncated", ["data-stats", "{truncated_store}"], ["truncated.h5", "truncated or corrupt"]),
    ("data-stats/hdf5-not-a-store", ["data-stats", "{plain_h5}"], ["plain.h5", "schema_version"]),
    # preprocess
    ("preprocess/mmcif-missing", [*PREPROCESS, "--mmcif-dir", "{missing}"], ["--mmcif-dir", "missing", "does not exist"]),
    ("preprocess/mmcif-file", [*PREPROCESS, "--mmcif-dir", "{fasta}"], ["--mmcif-dir", "target.fasta", "not a directory"]),
    ("preprocess/mmcif-empty-dir", [*PREPROCESS, "--mmcif-dir", "{no_cif}"], ["--mmcif-dir", "no_cif", "no *.cif"]),
    ("preprocess/alignments-file", [*PREPROCESS, "--mmcif-dir", "{cifs}", "--alignments-dir", "{fasta}"],
     ["--alignments-dir", "target.fasta", "not a directory"]),
    ("preprocess/cluster-file-missing", [*PREPROCESS, "--mmcif-dir", "{cifs}", "--cluster-file", "{missing}"],
     ["--cluster-file", "missing", "does not exist"]),
    ("preprocess/cluster-file-dir", [*PREPROCESS, "--mmcif-dir", "{cifs}", "--cluster-file", "{dir}"],
     ["--cluster-file", "adir", "is a directory"]),
    ("preprocess/kalign-missing", [*PREPROCESS, "--mmcif-dir", "{cifs}", "--kalign", "{missing}"],
     ["--kalign", "missing", "not an executable"]),
    ("preprocess/workers-negative", [*PREPROCESS, "--mmcif-dir", "{cifs}", "--workers", "-1"], ["--workers -1", ">= 0"]),
    ("preprocess/out-directory", ["preprocess", "--mmcif-dir", "{cifs}", "--out", "{dir}"], ["--out", "adir", "directory"]),
    ("preprocess/out-under-a-file", ["preprocess", "--mmcif-dir", "{cifs}", "--out", "{under_file}/s.h5"],
     ["--out", "target.fasta", "not a directory"]),
    ("preprocess/mlperf-dir-missing", ["preprocess", "--mlperf-dir", "{missing}", "--allow-pickle", "--out", "{root}/m.h5"],
     ["--mlperf-dir", "missing", "does not exist"]),
    # synth
    ("synth/out-directory", ["synth", "--out", "{dir}"], ["--out", "adir", "directory"]),
    ("synth/out-under-a-file", ["synth", "--out", "{under_file}/s.h5"], ["--out", "target.fasta", "not a directory"]),
    ("synth/num-chains", ["synth", "--out", "{root}/s.h5", "--num-chains", "0"], ["--num-chains 0", ">= 1"]),
    ("synth/lengths", ["synth", "--out", "{root}/s.h5", "--min-length", "60", "--max-length", "30"],
     ["--max-length 30", ">= 60"]),
    ("synth/workers", ["synth", "--out", "{root}/s.h5", "--workers", "0"], ["--workers 0", ">= 1"]),
    ("synth/template-hits", ["synth", "--out", "{root}/s.h5", "--max-template-hits", "-2"], ["--max-template-hits -2"]),
    # export-chain
    ("export-chain/store-fasta", ["export-chain", "--store", "{fasta}", "--out-dir", "{root}/ex"], ["target.fasta", "not an HDF5"]),
    ("export-chain/unknown-chain", ["export-chain", "--store", "{store}", "--chain", "nope_Z", "--out-dir", "{root}/ex"],
     ["--chain nope_Z", "not in store"]),
    ("export-chain/out-dir-file", ["export-chain", "--store", "{store}", "--out-dir", "{fasta}"], ["--out-dir", "target.fasta", "is a file"]),
    # bench loader
    ("bench/steps", ["bench", "loader", "--steps", "0"], ["--steps 0", ">= 1"]),
    ("bench/slow-fraction", ["bench", "loader", "--slow-fraction", "1.5"], ["--slow-fraction 1.5", "[0, 1]"]),
    ("bench/plot-directory", ["bench", "loader", "--plot", "{dir}"], ["--plot", "adir"]),
    ("bench/plot-under-a-file", ["bench", "loader", "--plot", "{under_file}/p.png"], ["--plot", "target.fasta", "not a directory"]),
    ("bench/plot-suffix", ["bench", "loader", "--plot", "{root}/p.jpg"], ["--plot", "p.jpg", ".png"]),
    # predict
    ("predict/fasta-missing", ["predict", "--fasta", "{missing}", "--checkpoint", "{ckpt}"], ["--fasta", "missing", "does not exist"]),
    ("predict/fasta-directory", ["predict", "--fasta", "{dir}", "--checkpoint", "{ckpt}"], ["--fasta", "adir", "is a directory"]),
    ("predict/fasta-empty", ["predict", "--fasta", "{empty}", "--checkpoint", "{ckpt}"], ["--fasta", "empty", "is empty"]),
    ("predict/fasta-binary", ["predict", "--fasta", "{binary_fasta}", "--checkpoint", "{ckpt}"], ["binary.fasta"]),
    ("predict/fasta-is-a-store", ["predict", "--fasta", "{store}", "--checkpoint", "{ckpt}"], ["store.h5"]),
    ("predict/a3m-directory", [*PREDICT, "--a3m", "{dir}"], ["--a3m", "adir", "is a directory"]),
    ("predict/a3m-missing", [*PREDICT, "--a3m", "{missing}"], ["--a3m", "missing", "does not exist"]),
    ("predict/a3m-other-sequence", [*PREDICT, "--a3m", "{other_a3m}"], ["other.a3m", "FASTA sequence"]),
    ("predict/checkpoint-missing", ["predict", "--fasta", "{fasta}", "--checkpoint", "{missing}"], ["missing", "not found"]),
    ("predict/checkpoint-directory", ["predict", "--fasta", "{fasta}", "--checkpoint", "{dir}"], ["adir", "is a directory"]),
    ("predict/checkpoint-empty", ["predict", "--fasta", "{fasta}", "--checkpoint", "{empty}"], ["empty", "is empty"]),
    ("predict/checkpoint-fasta", ["predict", "--fasta", "{fasta}", "--checkpoint", "{fasta}"],
     ["target.fasta", "not a PyTorch checkpoint"]),
    ("predict/checkpoint-truncated", ["predict", "--fasta", "{fasta}", "--checkpoint", "{truncated_ckpt}"],
     ["truncated.pt", "truncated"]),
    ("predict/checkpoint-is-a-store", ["predict", "--fasta", "{fasta}", "--checkpoint", "{store}"],
     ["store.h5", "not a PyTorch checkpoint"]),
    ("predict/out-suffix", ["predict", "--fasta", "{fasta}", "--checkpoint", "{ckpt}", "--out", "{root}/p.txt"],
     ["--out", "p.txt", ".pdb"]),
    ("predict/out-under-a-file", ["predict", "--fasta", "{fasta}", "--checkpoint", "{ckpt}", "--out", "{under_file}/p.pdb"],
     ["--out", "target.fasta", "not a directory"]),
    ("predict/out-directory", ["predict", "--fasta", "{fasta}", "--checkpoint", "{ckpt}", "--out", "{dir}"], ["--out", "adir"]),
    ("predict/num-recycling", [*PREDICT, "--num-recycling", "-1"], ["--num-recycling -1", ">= 0"]),
    ("predict/device-unknown", [*PREDICT, "--device", "gpu7"], ["--device gpu7", "not a torch device"]),
    ("evaluate/device-unknown", [*EVALUATE, "--device", "tpu"], ["--device tpu", "not a torch device"]),
    ("predict/reference-missing", [*PREDICT, "--reference", "{missing}"], ["--reference", "missing", "does not exist"]),
    ("predict/reference-fasta", [*PREDICT, "--reference", "{fasta}"], ["--reference", "target.fasta"]),
    # evaluate
    ("evaluate/store-missing", ["evaluate", "--store", "{missing}", "--checkpoint", "{ckpt}"], ["missing", "does not exist"]),
    ("evaluate/store-directory", ["evaluate", "--store", "{dir}", "--checkpoint", "{ckpt}"], ["adir", "is a directory"]),
    ("evaluate/store-fasta", ["evaluate", "--store", "{fasta}", "--checkpoint", "{ckpt}"], ["target.fasta", "not an HDF5"]),
    ("evaluate/checkpoint-fasta", ["evaluate", "--store", "{store}", "--checkpoint", "{fasta}"],
     ["target.fasta", "not a PyTorch checkpoint"]),
    ("evaluate/checkpoint-directory", ["evaluate", "--store", "{store}", "--checkpoint", "{dir}"], ["adir", "is a directory"]),
    ("evaluate/out-suffix", [*EVALUATE, "--out", "{root}/r.txt"], ["--out", "r.txt", ".json or .csv"]),
    ("evaluate/out-directory", [*EVALUATE, "--out", "{dir}"], ["--out", "adir"]),
    ("evaluate/max-chains", [*EVALUATE, "--max-chains", "-1"], ["--max-chains -1"]),
    ("evaluate/unknown-chain", [*EVALUATE, "--chains", "nope_Z"], ["nope_Z", "unknown chain"]),
    ("evaluate/wrong-preset", [*EVALUATE, "--preset", "demo"], ["tiny.pt", "does not fit the 'demo' preset"]),
    # train
    ("train/store-directory", [*TRAIN, "--store", "{dir}"], ["adir", "is a directory"]),
    ("train/store-fasta", [*TRAIN, "--store", "{fasta}"], ["target.fasta", "not an HDF5"]),
    ("train/store-empty", [*TRAIN, "--store", "{empty}"], ["empty", "is empty"]),
    ("train/config-unknown-key", [*TRAIN, "--store", "{store}", "--config", "{unknown_key_toml}"],
     ["unknown_key.toml", "unknown training options", "not_an_option"]),
    ("train/config-missing", [*TRAIN, "--store", "{store}", "--config", "{missing}.toml"], ["missing.toml"]),
    ("train/config-directory", [*TRAIN, "--store", "{store}", "--config", "{dir}"], ["adir", "is a directory"]),
    ("train/config-broken-toml", [*TRAIN, "--store", "{store}", "--config", "{broken_toml}"], ["broken.toml", "not valid TOML"]),
    ("train/config-broken-yaml", [*TRAIN, "--store", "{store}", "--config", "{broken_yaml}"], ["broken.yaml", "not valid YAML"]),
    ("train/config-wrong-type", [*TRAIN, "--store", "{store}", "--config", "{wrong_type_toml}"],
     ["wrong_type.toml", "max_steps", "expected an integer"]),
    ("train/config-suffix", [*TRAIN, "--store", "{store}", "--config", "{config_txt}"], ["config.txt", ".toml"]),
    ("train/max-steps", [*TRAIN[:-4], "--max-steps", "-1", "--store", "{store}"], ["max_steps", ">= 0"]),
    ("train/out-under-a-file", ["train", "--preset", "tiny", "--no-progress", "--max-steps", "1", "--store", "{store}",
                                "--out", "{under_file}/run"], ["target.fasta", "not a directory"]),
    ("train/init-from-fasta", [*TRAIN, "--store", "{store}", "--init-from", "{fasta}"], ["target.fasta", "not a PyTorch checkpoint"]),
    ("train/init-from-directory", [*TRAIN, "--store", "{store}", "--init-from", "{dir}"], ["adir", "is a directory"]),
    ("train/init-from-missing", [*TRAIN, "--store", "{store}", "--init-from", "{missing}"], ["missing", "not found"]),
    ("train/init-from-truncated", [*TRAIN, "--store", "{store}", "--init-from", "{truncated_ckpt}"], ["truncated.pt"]),
    ("train/resume-not-a-checkpoint", ["train", "--preset", "tiny", "--no-progress", "--max-steps", "1", "--store", "{store}",
                                       "--out", "{resume_run}", "--resume"], ["checkpoint_00000002.pt"]),
]  # fmt: skip


def _argv(template: list[str], files: dict[str, str]) -> list[str]:
    return [arg.format(**files) for arg in template]


def _error_lines(err: str) -> list[str]:
    """The message: stderr from the ``error`` line on (training prints its set-up lines before)."""
    lines = [line for line in err.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if "error" in line]
    return lines[starts[0] :] if starts else lines


@pytest.mark.parametrize("argv, expected", [pytest.param(a, e, id=i) for i, a, e in CASES])
def test_user_error_exits_3_with_a_short_message_naming_the_input(files, argv, expected, capsys, monkeypatch):
    monkeypatch.chdir(files["root"])
    monkeypatch.delenv("SCALEFOLD_DEBUG", raising=False)
    rc = main(_argv(argv, files))
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "Traceback" not in err
    message = _error_lines(err)
    per_file = 1 if "--resume" in argv else 0  # --resume names every checkpoint it could not load, a line each
    assert 1 <= len(message) <= 2 + per_file, err
    text = " ".join(message)
    assert text.startswith(f"scalefold {argv[0]}"), err
    for part in expected:
        assert part in text, (part, err)
    assert "weights_only" not in text and "'config file" not in text  # no PyTorch advice, no stray quotes


def test_usage_errors_keep_status_2(files, capsys):
    with pytest.raises(SystemExit) as info:
        main(["model-info", "--preset", "nope"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["predict", "--fasta", files["fasta"]])  # --checkpoint is required
    assert info.value.code == 2
    assert main(["preprocess", "--mlperf-dir", files["root"], "--out", files["root"] + "/m.h5"]) == 2  # no --allow-pickle
    assert "--allow-pickle" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "environment"])
def test_debug_shows_the_traceback_and_still_exits_3(files, how, capsys, monkeypatch):
    argv = ["data-stats", files["fasta"]]
    monkeypatch.delenv("SCALEFOLD_DEBUG", raising=False)
    if how == "flag-before":
        argv = ["--debug", *argv]
    elif how == "flag-after":
        argv = [*argv, "--debug"]
    else:
        monkeypatch.setenv("SCALEFOLD_DEBUG", "1")
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "StoreSchemaError" in err
    assert err.rstrip().splitlines()[-1].startswith("scalefold data-stats: error: store")


def test_a_bug_is_not_hidden(monkeypatch):
    """Errors that are not the user's (here: a TypeError inside a handler) keep their traceback."""
    import scalefold.commands.data as data_cli

    def broken(path):
        raise TypeError("a bug")

    monkeypatch.setattr(data_cli, "store_stats", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["data-stats", "anything.h5"])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["data-stats", "{missing}.h5"], "missing.h5 does not exist"),
        (["evaluate", "--store", "{store}", "--checkpoint", "{fasta}"], "not a PyTorch checkpoint"),
        (["train", "--preset", "tiny", "--store", "{dir}", "--out", "{root}/run2", "--no-progress"], "is a directory"),
    ],
    ids=["data-stats", "evaluate", "train"],
)
def test_the_real_command_exits_3_without_a_traceback(files, argv, expected):
    """As a user runs it: a separate ``python -m scalefold`` process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SCALEFOLD_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "scalefold", *_argv(argv, files)], capture_output=True, text=True,
                          env=env, cwd=files["root"], timeout=300)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and expected in proc.stderr
    assert len(_error_lines(proc.stderr)) <= 2


def test_one_handler_prints_a_user_errors_label_lines_and_hint(monkeypatch, capsys):
    """The CLI's one ``except UserError``: the error's label introduces it, at most its ``max_lines`` lines
    are shown (None: all), its hint follows on a line of its own; exit 3, no traceback."""
    import scalefold.commands.data as data_cli
    from scalefold.errors import UserError

    def refuse(path):
        raise UserError("first\nsecond\nthird", label="checkpoint error", hint="try the other preset")

    monkeypatch.delenv("SCALEFOLD_DEBUG", raising=False)
    monkeypatch.setattr(data_cli, "store_stats", refuse)
    assert main(["data-stats", "anything.h5"]) == 3
    assert capsys.readouterr().err.splitlines() == [
        "scalefold data-stats: checkpoint error: first", "second ...", "scalefold data-stats: try the other preset",
    ]  # fmt: skip

    class EveryLine(UserError):
        label, max_lines = "", None

    def refuse_every_line(path):
        raise EveryLine("a\nb\nc")

    monkeypatch.setattr(data_cli, "store_stats", refuse_every_line)
    assert main(["data-stats", "anything.h5"]) == 3
    assert capsys.readouterr().err.splitlines() == ["scalefold data-stats: a", "b", "c"]


@pytest.mark.parametrize("module, name", [
    ("scalefold.data.parsers", "ParseError"), ("scalefold.data.store", "StoreSchemaError"),
    ("scalefold.checkpoint.files", "CheckpointError"), ("scalefold.train.run_directory", "StoreNotFoundError"),
    ("scalefold.distributed.runtime", "LaunchError"), ("scalefold.distributed.layout", "LayoutError"),
    ("scalefold.inference.weights", "InferenceError"), ("scalefold.config.training", "ConfigError"),
    ("scalefold.perf.recompute", "PolicyDoesNotFit"), ("scalefold.compilation.graphed_step", "CudaGraphsUnavailable"),
    ("scalefold.kernels.launch_table", "TableError"), ("scalefold.data.mlperf_layout", "PickleNotAllowedError"),
])  # fmt: skip
def test_the_input_errors_of_every_unit_are_user_errors(module, name):
    """No registry of class names: each unit's input error is a ``UserError`` (the types it was before too,
    for the callers that catch those)."""
    import importlib

    from scalefold.errors import UserError

    assert issubclass(getattr(importlib.import_module(module), name), UserError)
