"""``bench/train_step_compare.py``: the trainer's ``--cuda-graphs step`` run against its ``--cuda-graphs off`` twin
(the headline group's ``train_step_compare`` part). Records as ``scalefold train`` writes them to ``metrics.jsonl``
and the summary line ``WholeStepGraphs.summary()`` prints; the runs themselves are rehearsed by
``REHEARSE=cpu PARTS=headline bash bench/gpu_session.sh`` (bench/RESULTS.md, issue 46)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUMMARY = ("cuda graphs (whole step): {n} step(s) graphed, 1 eager before SWA's first update, 0 eager (uncaptured "
           "shapes), 0 eager (off: --cuda-graphs step: the whole step, emulated on the CPU, one rank)")  # fmt: skip


def _compare():
    spec = importlib.util.spec_from_file_location("train_step_compare", REPO / "bench" / "train_step_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, losses: list[float], lddt: float = 0.5, log: str | None = None) -> Path:
    folder.mkdir()
    records = [{"step": 0, "eval_lddt_ca": lddt, "epoch_num": 0}]
    records += [{"step": i, "loss": x, "grad_norm": 2 * x, "loss_fape": x / 3, "time_step": 0.1 * i, "lr": 1e-3}
                for i, x in enumerate(losses, 1)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if log is not None:
        (folder / "run.log").write_text(f"scalefold train: ...\n{log}\nstep throughput: ...\n")
    return folder


def test_agreeing_runs_pass_and_name_the_graphed_steps(tmp_path, capsys):
    c = _compare()
    off = _run(tmp_path / "off", [4.0, 3.0, 2.0])
    graphs = _run(tmp_path / "g", [4.0, 3.0 * (1 + 1e-3), 2.0], log=SUMMARY.format(n=2))
    assert c.main(["--graphs", str(graphs), "--off", str(off), "--log", str(graphs / "run.log")]) == 0
    out = capsys.readouterr().out
    assert "PASS: 2 graphed step(s)" in out and "3 training steps and 1 evaluations" in out
    assert "loss " in out and "1.00e-03 (train step 2)" in out and "time_step" not in out  # timings not compared


def test_a_difference_past_the_tolerance_or_nothing_graphed_fails(tmp_path, capsys):
    c = _compare()
    off = _run(tmp_path / "off", [4.0, 3.0])
    graphs = _run(tmp_path / "g", [4.0, 3.3], log=SUMMARY.format(n=1))  # 10 % at step 2
    assert c.main(["--graphs", str(graphs), "--off", str(off), "--log", str(graphs / "run.log")]) == 1
    assert "FAIL" in capsys.readouterr().out
    same = _run(tmp_path / "fell_back", [4.0, 3.0], log=SUMMARY.format(n=0))  # the capture fell back: eager twice
    assert c.main(["--graphs", str(same), "--off", str(off), "--log", str(same / "run.log")]) == 1
    assert "no step was replayed from a whole-step graph" in capsys.readouterr().out
    short = _run(tmp_path / "short", [4.0], log=SUMMARY.format(n=1))  # a run that stopped early
    assert c.main(["--graphs", str(short), "--off", str(off), "--log", str(short / "run.log")]) == 1
    assert "different records" in capsys.readouterr().out


def test_a_missing_input_is_one_line_exit_3(tmp_path, capsys):
    c = _compare()
    off = _run(tmp_path / "off", [4.0])
    assert c.main(["--graphs", str(tmp_path / "nowhere"), "--off", str(off), "--log", str(off / "none.log")]) == 3
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "none.log" in err
    no_summary = _run(tmp_path / "g", [4.0], log="scalefold train: an eager run")
    assert c.main(["--graphs", str(no_summary), "--off", str(off), "--log", str(no_summary / "run.log")]) == 3
    assert "--cuda-graphs step" in capsys.readouterr().err
