#!/usr/bin/env bash
# The floor job: ScaleFold's oldest supported torch and Triton (.ci/floor-constraints.txt, the lower
# bounds pyproject.toml declares) in an environment of their own, running a fast subset -- kernel
# dispatch and the kernels (Triton's CPU interpreter), the model, version/packaging checks, and a
# short `scalefold train` logged to a file (tests/train/test_plain_progress.py).
#
# The environment lives outside the checkout, in ~/.cache/scalefold/venv-floor-<key> (SCALEFOLD_FLOOR_VENV
# overrides), <key> a hash of the constraints and pyproject.toml's dependencies (its test extra included): CI's fresh clones on one
# machine reuse it (its editable install re-pointed at this checkout, a few seconds), a new machine or new
# constraints install it afresh. torch's Linux wheels on PyPI are CUDA builds: that first install downloads
# about 3 GB (torch, triton, nvidia-* libraries), about 4 minutes here. The subset runs on every core
# (pytest-xdist, as `make test`).
#
# Exit status: 0 the subset passed; 1 it failed (CI turns red); 75 the environment could not be
# installed (network, package index: an infrastructure failure, which .ci/run reports loudly
# without turning CI red).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
CONSTRAINTS=.ci/floor-constraints.txt
EX_INSTALL=75
start=$(date +%s)

# the key: the constraints and the dependencies pyproject.toml declares (the whole file where tomllib is missing)
deps=$("$PYTHON" -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p["optional-dependencies"]["test"]]))' 2>/dev/null) || deps=$(cat pyproject.toml)
key=$({ cat "$CONSTRAINTS"; echo "$deps"; } | sha256sum | cut -c1-16)
VENV=${SCALEFOLD_FLOOR_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/scalefold/venv-floor-$key}
if [[ -f "$VENV/.installed-$key" ]] && "$VENV/bin/python" -m pip install -q --no-deps -e . >/dev/null 2>&1; then
  echo "CI floor: reusing $VENV (constraints and pyproject.toml unchanged; editable install re-pointed here)"
else
  rm -rf "$VENV"; mkdir -p "$(dirname "$VENV")"
  echo "CI floor: installing $(grep -E '^[a-z]' "$CONSTRAINTS" | tr '\n' ' ')into $VENV ..."
  if ! { "$PYTHON" -m venv "$VENV" \
      && "$VENV/bin/python" -m pip install -q --upgrade pip \
      && "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" torch triton numpy -e . pytest pytest-timeout pytest-xdist; }; then
    echo "CI floor: installing the floor environment FAILED after $(($(date +%s) - start)) s (see pip's output above)"
    exit "$EX_INSTALL"
  fi
  touch "$VENV/.installed-$key"
  echo "CI floor: installed in $(($(date +%s) - start)) s ($(du -sh "$VENV" | cut -f1) on disk)"
fi

# the versions actually installed, and whether they are the tested floor (exit 1 if outside the range)
versions=$("$VENV/bin/python" -m scalefold check-versions) || { echo "CI floor: $versions: outside the tested range"; exit 1; }
echo "CI floor: environment $versions"

tests_start=$(date +%s)
"$VENV/bin/python" -m pytest -q -m "not slow" -n "${SCALEFOLD_TEST_WORKERS:-auto}" --dist loadgroup \
  tests/kernels tests/model tests/test_packaging.py tests/train/test_plain_progress.py
rc=$?
verdict=$([[ $rc -eq 0 ]] && echo PASSED || echo "FAILED (pytest exit $rc)")
echo "CI floor: subset (kernels, model, packaging, scalefold train) with $versions: $verdict in $(($(date +%s) - tests_start)) s"
[[ $rc -eq 0 ]] && exit 0 || exit 1
