#!/bin/bash
# Download the MLPerf HPC OpenFold starting checkpoint (and, with --processed, the reference's
# preprocessed dataset) from the MLCommons HPC data location at NERSC, and verify the checkpoint.
#
#   bash data/download_mlperf.sh DIR               # DIR/mlperf_hpc_openfold_resumable_checkpoint.pt (1.1 GiB)
#   bash data/download_mlperf.sh DIR --processed   # + DIR/pdb_data/ (MLPerf "processed" layout, ~616 GiB)
#
# Needs curl (resumable: re-running continues a partial download) and sha256sum.
set -euo pipefail

CHECKPOINT_SHA256=b518be4677048f2c0f94889c91e2da73655a73b825a8aa7f8b6f5e580d8ffbed
: "${MLPERF_DATA_URL:=https://portal.nersc.gov/cfs/m4291/openfold}"

if [[ $# -lt 1 || $# -gt 2 || ( $# -eq 2 && "$2" != --processed ) ]]; then
  echo "usage: $0 DIR [--processed]" >&2
  exit 2
fi
dir=$1
mkdir -p "${dir}"
ckpt="${dir}/mlperf_hpc_openfold_resumable_checkpoint.pt"

echo "$(date -Is) checkpoint -> ${ckpt}"
curl -fL --retry 5 -C - -o "${ckpt}" "${MLPERF_DATA_URL}/mlperf_hpc_openfold_resumable_checkpoint_b518be46.pt"
echo "${CHECKPOINT_SHA256}  ${ckpt}" | sha256sum --check --strict

if [[ "${2:-}" == --processed ]]; then
  echo "$(date -Is) processed dataset -> ${dir}/pdb_data"
  curl -fL --retry 5 -C - -o "${dir}/pdb_data.tar" "${MLPERF_DATA_URL}/pdb_data.tar"
  tar -xf "${dir}/pdb_data.tar" -C "${dir}"
  rm "${dir}/pdb_data.tar"
fi
echo "$(date -Is) done"
