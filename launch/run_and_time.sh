#!/bin/bash
# STUB: maps the config_*.sh environment to `scalefold train` flags; the full version (per-rank
# TRITON_CACHE_DIR, CPU/NIC binding, RESULT line) is built by the HPC-submission issue.
set -euo pipefail
start=$(date +%s)
scalefold train ${SCALEFOLD_ARGS:-}
end=$(date +%s)
echo "RESULT,OPENFOLD_HPC,,$((end - start)),${SUBMISSION_ORG:-scalefold},${start}"
