#!/usr/bin/env bash
# The floor job: ScaleFold's oldest supported torch and Triton (.ci/floor-constraints.txt, the lower
# bounds pyproject.toml declares) in an environment of their own, running a fast subset -- kernel
# dispatch and the kernels (Triton's CPU interpreter), the model, version/packaging checks, and a
# short `scalefold train` logged to a file (tests/train/test_plain_progress.py).
#
# The environment is .venv-floor/ in the checkout (ignored; SCALEFOLD_FLOOR_VENV overrides), reused
# while the constraints and pyproject.toml are unchanged. torch's Linux wheels on PyPI are CUDA
# builds: the first install downloads about 3 GB (torch, triton, nvidia-* libraries).
#
# Exit status: 0 the subset passed; 1 it failed (CI turns red); 75 the environment could not be
# installed (network, package index: an infrastructure failure, which .ci/run reports loudly
# without turning CI red).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
VENV=${SCALEFOLD_FLOOR_VENV:-.venv-floor}
CONSTRAINTS=.ci/floor-constraints.txt
EX_INSTALL=75
start=$(date +%s)

key=$(cat "$CONSTRAINTS" pyproject.toml | sha256sum | cut -c1-16)
if [[ -f "$VENV/.installed-$key" ]]; then
  echo "CI floor: reusing $VENV (constraints and pyproject.toml unchanged)"
else
  rm -rf "$VENV"
  echo "CI floor: installing $(grep -E '^[a-z]' "$CONSTRAINTS" | tr '\n' ' ')into $VENV ..."
  if ! { "$PYTHON" -m venv "$VENV" \
      && "$VENV/bin/python" -m pip install -q --upgrade pip \
      && "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" torch triton numpy -e . pytest pytest-timeout; }; then
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
"$VENV/bin/python" -m pytest -q -m "not slow" \
  tests/kernels tests/model tests/test_packaging.py tests/train/test_plain_progress.py
rc=$?
verdict=$([[ $rc -eq 0 ]] && echo PASSED || echo "FAILED (pytest exit $rc)")
echo "CI floor: subset (kernels, model, packaging, scalefold train) with $versions: $verdict in $(($(date +%s) - tests_start)) s"
[[ $rc -eq 0 ]] && exit 0 || exit 1
