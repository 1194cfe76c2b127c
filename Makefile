# Two commands on a fresh machine:
#   make demo   -- create .venv, install ScaleFold (no test extras), run the built-in default job (`scalefold train`)
#   make test   -- create .venv, install ScaleFold + test extras, run the test suite
# On a CPU-only machine torch==2.13.0 is pinned (a local CPU wheel) and `make test` pins triton==3.9.0:
# the newest versions CI tests (scalefold/tested_versions.py; .ci/run also tests the oldest). On GPU
# hosts set TORCH_SPEC="torch" TRITON_SPEC="triton" (or use the NGC container, see Dockerfile).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
# `make test` runs the suite on every core (pytest-xdist; TEST_WORKERS=1 runs it serially, in one process)
TEST_WORKERS ?= auto
# extra `scalefold train` arguments of `make demo` (e.g. DEMO_ARGS=--overwrite to run it again afresh)
DEMO_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv demo test lint clean

# The demo needs ScaleFold and its own dependencies only; the test extras (pytest, triton for the
# kernels' interpreter tests, mpi4py + mpich for the mpirun launch tests) come with `make test`.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]" "$(TRITON_SPEC)"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/scalefold train $(DEMO_ARGS)

# pytest's exit code 5 means "no tests collected": not a failure for a fresh checkout. The tests that start
# several processes (marker `distributed`) share one xdist group, run one at a time (tests/conftest.py); the
# last line is the suite's serial-equivalent time against its budget (SUITE_BUDGET_S there).
ifeq ($(TEST_WORKERS),1)
PYTEST_PARALLEL :=
else
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup
endif
test: $(VENV)/.installed-test
	SCALEFOLD_SUITE_GUARD=1 $(PY) -m pytest -q $(PYTEST_PARALLEL); rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

lint: $(VENV)/.installed-test
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check scalefold tests

clean:
	rm -rf $(VENV) runs .pytest_cache
