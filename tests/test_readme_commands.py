"""The README's ```bash blocks work as written.

Every block carries a marker, an HTML comment on the line before it (invisible on GitHub):

* ``<!-- readme-test: run -->``: run as written, in a scratch copy of the checkout's layout;
* ``<!-- readme-test: after-demo -->``: run there after the demo's ``scalefold train`` with a small step
  budget (``SCALEFOLD_MAX_STEPS=2``, a 40-chain store: the commands need its store and checkpoints,
  not its quality);
* ``<!-- readme-test: skip: REASON -->``: not run; the reason shows in the test report.

A block without a marker fails :func:`test_every_bash_block_has_a_marker`, so a new command cannot slip
into the README untested by accident.

The scratch "checkout" has ``examples/`` (linked) and a ``.venv/bin`` whose ``activate`` puts a
``scalefold`` on ``PATH`` that runs this interpreter on this checkout's code -- what ``make demo``'s
``.venv`` provides -- so the blocks run with ``bash -e`` exactly as pasted into a fresh shell.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MARKER = re.compile(r"^<!--\s*readme-test:\s*(run|after-demo|skip)\s*(?::\s*(.*?))?\s*-->\s*$")
# The demo's `scalefold train`, shrunk: the blocks need its outputs, not its quality.
DEMO_BUDGET = {
    "SCALEFOLD_MAX_STEPS": "2", "SCALEFOLD_CHECKPOINT_EVERY": "2", "SCALEFOLD_EVAL_EVERY": "0",
    "SCALEFOLD_SYNTH_NUM_CHAINS": "40", "SCALEFOLD_SYNTH_NUM_FAMILIES": "5", "SCALEFOLD_PROGRESS": "0",
}  # fmt: skip
RUN_TIMEOUT_S = 900


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    kind: str | None  # run / after-demo / skip; None: no marker
    reason: str
    code: str


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start = i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            previous = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            match = MARKER.match(previous.strip())
            blocks.append(Block(start + 1, match.group(1) if match else None, (match.group(2) or "") if match else "",
                                "\n".join(lines[start + 1 : end]) + "\n"))  # fmt: skip
            i = end
        i += 1
    return blocks


BLOCKS = readme_blocks(README.read_text())


def test_every_bash_block_has_a_marker():
    unmarked = [b.line for b in BLOCKS if b.kind is None]
    assert not unmarked, f"README.md ```bash blocks at lines {unmarked} need a <!-- readme-test: ... --> marker"
    assert all(b.reason for b in BLOCKS if b.kind == "skip"), "a skipped block must name its reason"
    assert any(b.kind == "after-demo" for b in BLOCKS)  # the "After the demo" section is tested


def test_marker_parsing():
    text = "x\n<!-- readme-test: skip: needs Slurm -->\n```bash\necho a\n```\n\n```bash\necho b\n```\n"
    first, second = readme_blocks(text)
    assert (first.kind, first.reason, first.code, first.line) == ("skip", "needs Slurm", "echo a\n", 3)
    assert second.kind is None


def _sandbox(root: Path) -> dict[str, str]:
    """A scratch checkout layout: examples/ and a .venv/bin with activate + a scalefold shim."""
    (root / "examples").symlink_to(REPO / "examples")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    shim = bin_dir / "scalefold"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m scalefold "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "activate").write_text(f'export VIRTUAL_ENV="{root / ".venv"}"\nexport PATH="{bin_dir}:$PATH"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCALEFOLD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return env


def _bash(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip


def _params(kinds: tuple[str, ...]):
    params = []
    for b in BLOCKS:
        if b.kind in kinds:
            params.append(pytest.param(b, id=f"line{b.line}"))
        elif b.kind == "skip":
            params.append(pytest.param(b, id=f"line{b.line}", marks=pytest.mark.skip(reason=f"README line {b.line}: {b.reason}")))
    return params


@pytest.mark.parametrize("block", _params(("run",)))
def test_run_block(block, tmp_path):
    env = _sandbox(tmp_path)
    proc = _bash(block.code, tmp_path, env)
    assert proc.returncode == 0, f"README line {block.line}:\n{block.code}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow  # a 2-step demo run (40-chain store), then the block
@pytest.mark.parametrize("block", [p for p in _params(("after-demo",)) if not p.marks])
def test_after_demo_block(block, tmp_path):
    env = _sandbox(tmp_path)
    demo = _bash(".venv/bin/scalefold train", tmp_path, {**env, **DEMO_BUDGET})
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert list((tmp_path / "runs" / "demo" / "checkpoints").glob("*.pt")), demo.stdout[-3000:]
    proc = _bash(block.code, tmp_path, env)
    assert proc.returncode == 0, f"README line {block.line}:\n{block.code}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "mean lDDT-Cα:" in out and "mean pLDDT:" in out and "lDDT-Cα against examples/demo_target" in out
    assert (tmp_path / "runs" / "demo" / "eval.json").is_file() and (tmp_path / "runs" / "demo" / "target.pdb").is_file()
