"""A run never silently replaces an earlier one in its --out (needs --resume or --overwrite)."""

from __future__ import annotations

import pytest

from scalefold.config.training import TrainConfig
from scalefold.errors import UserError
from scalefold.train.run_directory import check_out, clear_previous_run


def _cfg(out, **overrides):
    return TrainConfig.from_preset("tiny", overrides={"out": str(out), **overrides}, env={})


def test_a_previous_run_needs_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    check_out(_cfg(out))  # absent: fine
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    check_out(_cfg(out))  # a directory without a run's outputs: fine
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "checkpoint_00000002.pt").write_bytes(b"x")
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match=r"holds a previous run \(checkpoints/checkpoint_00000002.pt, metrics.jsonl\)"
                                        r".*--resume.*--overwrite"):  # fmt: skip
        check_out(_cfg(out))
    check_out(_cfg(out, resume=True))
    check_out(_cfg(out, overwrite=True))
    assert sorted(p.name for p in clear_previous_run(out)) == ["checkpoint_00000002.pt", "metrics.jsonl"]
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own outputs go
    check_out(_cfg(out))


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file, expected a run directory"):
        check_out(_cfg(tmp_path / "f"))


def test_cli_refuses_with_exit_3(tmp_path, capsys):
    from scalefold.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    assert main(["train", "--preset", "tiny", "--out", str(out), "--store", str(tmp_path / "s.h5")]) == 3
    err = capsys.readouterr().err
    assert "holds a previous run" in err and "Traceback" not in err
