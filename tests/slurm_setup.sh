#!/bin/bash
# Install what the real-Slurm tests (tests/test_slurm_*.py) need: slurm-wlm and munge (Debian/Ubuntu,
# root). Idempotent; exits 0 without doing anything when the binaries are already there. The daemons
# are not started here: each test run starts its own slurmctld/slurmd/munged from a temporary
# directory and stops them by PID.
#
#   bash tests/slurm_setup.sh            # then: python -m pytest -k slurm
set -euo pipefail

needed=(slurmctld slurmd sbatch srun scontrol sinfo munged mungekey)
missing=()
for bin in "${needed[@]}"; do
  command -v "${bin}" >/dev/null 2>&1 || [[ -x "/usr/sbin/${bin}" ]] || missing+=("${bin}")
done
if ((${#missing[@]} == 0)); then
  echo "slurm_setup: Slurm and munge already installed ($(slurmd -V))"
  exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
  echo "slurm_setup: missing ${missing[*]} and not root: cannot install slurm-wlm/munge" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "slurm_setup: missing ${missing[*]} and no apt-get: install slurm-wlm and munge by hand" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; then
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
fi
echo "slurm_setup: installed $(slurmd -V) and $(munged --version 2>&1 | head -n 1)"
