#!/bin/bash
# Install what the real-Slurm tests (tests/test_slurm_*.py) need: slurm-wlm and munge (Debian/Ubuntu,
# root), plus any extra Debian packages named on the command line (CI adds shellcheck). Idempotent;
# exits 0 without touching apt when everything is already there. The daemons are not started here:
# each test run starts its own munged/slurmctld/slurmd from a temporary directory and stops them by PID.
#
#   bash tests/slurm_setup.sh [EXTRA_PACKAGE...]    # then: python -m pytest -k slurm
#
# Exit status 0: installed (or already there); 1: could not install (the reason on stderr).
set -euo pipefail

needed=(slurmctld slurmd sbatch srun scontrol sinfo munged mungekey)
packages=()
for bin in "${needed[@]}"; do
  if ! command -v "${bin}" >/dev/null 2>&1 && [[ ! -x "/usr/sbin/${bin}" ]]; then
    packages=(slurm-wlm munge)
    break
  fi
done
for extra in "$@"; do
  command -v "${extra}" >/dev/null 2>&1 || packages+=("${extra}")
done
if ((${#packages[@]} == 0)); then
  echo "slurm_setup: already installed: $(slurmd -V)${*:+ and $*}"
  exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
  echo "slurm_setup: need ${packages[*]} but not root: cannot install them" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "slurm_setup: need ${packages[*]} and there is no apt-get: install them by hand" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "${log}"' EXIT
install() { apt-get install -y -q --no-install-recommends "${packages[@]}" >>"${log}" 2>&1; }
# A fresh machine (CI) has no package lists yet: update only when the first try fails.
if ! install && ! { apt-get update -q >>"${log}" 2>&1 && install; }; then
  echo "slurm_setup: apt-get could not install ${packages[*]}; its last lines:" >&2
  tail -n 15 "${log}" >&2
  exit 1
fi
echo "slurm_setup: installed ${packages[*]}: $(slurmd -V), $(munged --version 2>&1 | head -n 1)"
