"""The suite's own rules (issue 45): `make test` runs it on every core, and the tests that start several processes
are marked ``distributed`` so that tests/conftest.py puts them in one xdist group (one multi-rank launch at a time,
never two fighting for the cores) -- a new multi-process test without the mark would break that silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
#: what starts several processes in a test: torchrun, torch.multiprocessing / multiprocessing's spawn, ScaleFold's
#: own launcher, mpirun, a real Slurm's sbatch / srun
MULTI_PROCESS = re.compile(r"torch\.distributed\.run|mp\.spawn|get_context\(\"spawn\"\)|run_processes\(|mpirun|mpiexec|"
                           r"LocalSlurm\(")  # fmt: skip


def test_every_multi_process_test_file_is_marked_distributed():
    unmarked = [str(path.relative_to(REPO)) for path in sorted(TESTS.rglob("test_*.py"))
                if MULTI_PROCESS.search(path.read_text()) and "mark.distributed" not in path.read_text()]  # fmt: skip
    assert unmarked == [], f"start several processes but carry no pytest.mark.distributed: {unmarked}"


def test_the_distributed_tests_share_one_xdist_group_and_run_first(request):
    """The hook itself, on three fake items: the distributed one is grouped and moved to the front."""
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__) == TESTS / "conftest.py")  # fmt: skip

    class Item:
        def __init__(self, name: str, distributed: bool) -> None:
            self.name, self.marks = name, ([pytest.mark.distributed.mark] if distributed else [])

        def get_closest_marker(self, name: str):
            return next((m for m in self.marks if m.name == name), None)

        def add_marker(self, marker) -> None:
            self.marks.append(marker.mark)

    class Config:
        class option:  # noqa: N801 -- pytest's config.option namespace
            numprocesses = 2

    items = [Item("a", False), Item("b", True), Item("c", False)]
    conftest.pytest_collection_modifyitems(Config(), items)
    assert [i.name for i in items] == ["b", "a", "c"]
    group = items[0].get_closest_marker("xdist_group")
    assert group is not None and group.args == (conftest.PROCESSES_GROUP,)
    assert items[1].get_closest_marker("xdist_group") is None


def test_make_test_runs_the_suite_on_every_core_with_the_guard():
    makefile = (REPO / "Makefile").read_text()
    assert "TEST_WORKERS ?= auto" in makefile and "--dist loadgroup" in makefile
    assert "SCALEFOLD_SUITE_GUARD=1" in makefile
    ci = (REPO / ".ci" / "run").read_text()
    for part in ("system packages", "install", "suite", "floor"):
        assert f'part_done "{part}"' in ci, part
