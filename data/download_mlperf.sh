#!/bin/bash
# Download the MLPerf HPC OpenFold starting checkpoint (and, with --processed, the reference's
# preprocessed dataset) from the MLCommons HPC data location at NERSC, and verify the checkpoint.
#
#   bash data/download_mlperf.sh DIR               # DIR/mlperf_hpc_openfold_resumable_checkpoint.pt (1.1 GiB, minutes)
#   bash data/download_mlperf.sh DIR --processed   # + DIR/pdb_data/ (MLPerf "processed" layout: a ~616 GiB
#                                                  #   tar, needs ~1.2 TiB free while it is unpacked; 6-24 h)
#
# Needs curl and sha256sum. Resumable: an interrupted download continues from its `.part` file; a
# checkpoint that is already there and verifies is not downloaded again. The checkpoint is only moved
# into place after its sha256 matches; a mismatch leaves it as `<name>.bad` and fails.
set -euo pipefail

CHECKPOINT_SHA256=b518be4677048f2c0f94889c91e2da73655a73b825a8aa7f8b6f5e580d8ffbed
CHECKPOINT_NAME=mlperf_hpc_openfold_resumable_checkpoint.pt
: "${MLPERF_DATA_URL:=https://portal.nersc.gov/cfs/m4291/openfold}"

if [[ $# -lt 1 || $# -gt 2 || ($# -eq 2 && "$2" != --processed) ]]; then
  echo "usage: $0 DIR [--processed]" >&2
  exit 2
fi
for tool in curl sha256sum; do
  command -v "${tool}" >/dev/null || { echo "$0: ${tool} is required" >&2; exit 1; }
done
dir=$1
mkdir -p "${dir}"
ckpt="${dir}/${CHECKPOINT_NAME}"

verified() { echo "${CHECKPOINT_SHA256}  $1" | sha256sum --check --status --strict; }

if [[ -f "${ckpt}" ]] && verified "${ckpt}"; then
  echo "$(date -Is) checkpoint ${ckpt} already there (sha256 OK)"
else
  url="${MLPERF_DATA_URL}/mlperf_hpc_openfold_resumable_checkpoint_${CHECKPOINT_SHA256:0:8}.pt"
  echo "$(date -Is) checkpoint ${url} -> ${ckpt}"
  curl -fL --retry 5 -C - -o "${ckpt}.part" "${url}"
  if ! verified "${ckpt}.part"; then
    mv -f "${ckpt}.part" "${ckpt}.bad"
    got=$(sha256sum "${ckpt}.bad" | cut -d' ' -f1)
    echo "$0: ${url}: sha256 mismatch: got ${got}, expected ${CHECKPOINT_SHA256};" \
      "the file is kept as ${ckpt}.bad (delete it and re-run)" >&2
    exit 1
  fi
  mv -f "${ckpt}.part" "${ckpt}"
  echo "$(date -Is) checkpoint sha256 OK: ${CHECKPOINT_SHA256}"
fi

if [[ "${2:-}" == --processed ]]; then
  if [[ -f "${dir}/pdb_data/.complete" ]]; then
    echo "$(date -Is) ${dir}/pdb_data already unpacked"
  else
    echo "$(date -Is) processed dataset ${MLPERF_DATA_URL}/pdb_data.tar -> ${dir}/pdb_data"
    curl -fL --retry 5 -C - -o "${dir}/pdb_data.tar" "${MLPERF_DATA_URL}/pdb_data.tar"
    tar -xf "${dir}/pdb_data.tar" -C "${dir}"
    [[ -d "${dir}/pdb_data" ]] || { echo "$0: pdb_data.tar did not contain pdb_data/" >&2; exit 1; }
    touch "${dir}/pdb_data/.complete"
    rm "${dir}/pdb_data.tar"
  fi
fi
echo "$(date -Is) done"
