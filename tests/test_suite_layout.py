"""The suite's own rules (issue 45): `make test` runs it on every core, and the tests that start several processes
are marked ``distributed`` so that tests/conftest.py's scheduler sends their files as one unit of work (one
multi-rank launch at a time, never two fighting for the cores) -- a new multi-process test file without the
mark would break that silently."""

from __future__ import annotations

import logging
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


def test_the_multi_process_files_are_one_unit_of_work_and_every_other_file_its_own(request):
    """The scheduler ``make test`` gets (``--dist loadgroup``): node ids of the multi-process files map to the one
    group, any other test to its file; another ``--dist`` keeps pytest-xdist's own scheduler."""
    xdist = pytest.importorskip("xdist")
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__) == TESTS / "conftest.py")  # fmt: skip
    grouped = conftest.multi_process_files(REPO)
    assert "tests/train/test_ddp_train.py" in grouped and "tests/test_lddt.py" not in grouped

    class Config:
        rootpath = REPO

        def __init__(self, dist: str) -> None:
            self.dist = dist
            self.option = request.config.option

        def getvalue(self, name: str):
            return {"dist": self.dist, "tx": ["2*popen"]}.get(name)

    class Log:
        def __getattr__(self, name):
            return lambda *a, **k: None

    scheduler = conftest.pytest_xdist_make_scheduler(Config("loadgroup"), Log())
    assert isinstance(scheduler, xdist.scheduler.LoadScopeScheduling)
    assert (
        scheduler._split_scope("tests/train/test_ddp_train.py::test_every_rank_announces_itself")
        == conftest.PROCESSES_GROUP
    )
    assert scheduler._split_scope("tests/test_lddt.py::test_x[a::b]") == "tests/test_lddt.py"
    assert conftest.pytest_xdist_make_scheduler(Config("load"), Log()) is None


def test_the_costliest_unit_left_goes_to_the_worker_that_asks(request, monkeypatch):
    """Longest processing time first: the order follows the recorded CPU seconds (the multi-process group: its
    files' sum; a file without a record: one second a test), not the collection order or the test count."""
    pytest.importorskip("xdist")
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__) == TESTS / "conftest.py")  # fmt: skip
    multi = next(iter(sorted(conftest.multi_process_files(REPO))))
    monkeypatch.setattr(conftest, "recorded_costs", lambda path: {"tests/a.py": 10.0, multi: 30.0})

    class Config:
        rootpath = REPO
        option = request.config.option

        def getvalue(self, name: str):
            return {"dist": "loadgroup", "tx": ["2*popen"]}.get(name)

    class Log:
        def __getattr__(self, name):
            return lambda *a, **k: None

    class Node:
        shutting_down = False
        sent: list[list[int]] = []

        def send_runtest_some(self, indices):
            self.sent.append(indices)

    nodeids = ["tests/a.py::t1", "tests/a.py::t2", "tests/d.py::t1", *(f"tests/e.py::t{i}" for i in range(12)),
               f"{multi}::t1"]  # fmt: skip
    scheduler = conftest.pytest_xdist_make_scheduler(Config(), Log())
    node = Node()
    scheduler.registered_collections[node] = nodeids
    for nodeid in nodeids:
        scheduler.workqueue.setdefault(scheduler._split_scope(nodeid), {})[nodeid] = False
    for _ in range(4):
        scheduler._assign_work_unit(node)
    order = [sorted({nodeids[i].split("::")[0] for i in sent}) for sent in node.sent]
    assert order == [[multi], ["tests/e.py"], ["tests/a.py"], ["tests/d.py"]]
    assert (
        conftest.unit_cost({"tests/d.py::t1": False, "tests/d.py::t2": False}, {}) == 2 * conftest.UNKNOWN_TEST_COST_S
    )


def test_recorded_costs_are_the_test_time_by_file_where_recorded(request, tmp_path):
    """The scheduler's costs: each file's test time (a worker's seconds on it: a real Slurm's jobs or waiting ranks
    hold a worker beyond their CPU seconds) from a ``SCALEFOLD_SUITE_TIMES`` record, its CPU seconds from an older
    record without it, nothing from an unreadable one."""
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__) == TESTS / "conftest.py")  # fmt: skip
    record = tmp_path / "times.json"
    record.write_text('{"cpu_s_by_file": {"tests/a.py": 1.5, "tests/b.py": 9}, "test_s_by_file": {"tests/a.py": 30.0}}')
    assert conftest.recorded_costs(record) == {"tests/a.py": 30.0}
    record.write_text('{"cpu_s_by_file": {"tests/a.py": 1.5, "tests/b.py": 9}}')
    assert conftest.recorded_costs(record) == {"tests/a.py": 1.5, "tests/b.py": 9.0}
    record.write_text("{not json")
    assert conftest.recorded_costs(record) == {}
    assert conftest.recorded_costs(REPO / conftest.SUITE_COSTS)  # the shipped record is readable


#: a logger that does not propagate, made before the tests run: pytest's log capture attaches its handlers to it
_NON_PROPAGATING = logging.getLogger("suite layout: a logger that does not propagate")
_NON_PROPAGATING.propagate = False


def test_pytests_log_capture_stays_out_of_torchs_structured_trace():
    """tests/conftest.py keeps pytest's handlers off torch's structured-trace logger (with a handler there every
    ``torch.compile`` builds its trace records for pytest to store), while pytest still captures the other loggers
    that do not propagate."""
    import torch
    from torch._logging import _internal

    assert any(type(h).__module__.startswith("_pytest") for h in _NON_PROPAGATING.handlers)  # capture is on
    torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.randn(3))
    assert not any(type(h).__module__.startswith("_pytest") for h in _internal.trace_log.handlers)


_LEFT = "/nonexistent/left-by-the-test-before"


def test_a_test_pointing_the_compile_cache_elsewhere():
    """(with the next test) what ``--compile-cache`` run in-process does: the caches' environment set, not undone"""
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TRITON_CACHE_DIR"] = _LEFT


def test_does_not_leave_it_to_the_next_test():
    import os

    assert _LEFT not in (os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR"))


def test_make_test_runs_the_suite_on_every_core_with_the_guard():
    makefile = (REPO / "Makefile").read_text()
    assert "TEST_WORKERS ?= auto" in makefile and "--dist loadgroup" in makefile
    assert "SCALEFOLD_SUITE_GUARD=1" in makefile
    ci = (REPO / ".ci" / "run").read_text()
    for part in ("system packages", "install", "suite", "floor"):
        assert f'part_done "{part}"' in ci, part
