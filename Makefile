# Two commands on a fresh machine:
#   make demo   -- create .venv, install ScaleFold, run the built-in default job (`scalefold train`)
#   make test   -- create .venv, install ScaleFold + test extras, run the test suite
# On a CPU-only machine torch==2.13.0 is pinned (a local CPU wheel); set TORCH_SPEC="torch" on GPU hosts
# (or use the NGC container, see Dockerfile).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/scalefold train

# pytest's exit code 5 means "no tests collected": not a failure for a fresh checkout.
test: venv
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

lint: venv
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check scalefold tests

clean:
	rm -rf $(VENV) runs .pytest_cache
