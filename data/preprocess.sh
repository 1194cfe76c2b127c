#!/bin/bash
# Build the ScaleFold dataset store (one HDF5 file) that `scalefold train --store` reads.
#
#   bash data/preprocess.sh raw PDB_DIR OPENPROTEINSET_DIR STORE   # from download_pdb_mmcif.sh + download_openproteinset.sh
#   bash data/preprocess.sh mlperf PDB_DATA_DIR STORE              # from download_mlperf.sh --processed
#
# `raw` parses every mmCIF (gemmi) with its OpenProteinSet MSAs and template hits (Kalign realigns
# templates when it is on PATH): CPU-bound, scales with WORKERS (default: all cores); expect about a
# day on 64 cores for ~200k entries. `mlperf` converts the reference's processed shards (pickle: only
# for files from the MLPerf data location) in a few hours. Either way the store needs ~600-650 GiB.
set -euo pipefail

usage() {
  echo "usage: $0 raw PDB_DIR OPENPROTEINSET_DIR STORE | $0 mlperf PDB_DATA_DIR STORE" >&2
  exit 2
}
: "${WORKERS:=$(nproc)}"
: "${SCALEFOLD:=scalefold}"
: "${PYTHON:=python3}"

case "${1:-}" in
  raw)
    [[ $# -eq 4 ]] || usage
    pdb=$2 ops=$3 store=$4
    # OpenProteinSet keeps each chain's files in a3m/ and hhr/ subdirectories; the store builder reads
    # one flat directory per chain: link the files into <store>.alignments/<chain>/.
    flat="${store}.alignments"
    echo "$(date -Is) linking ${ops}/pdb/*/{a3m,hhr}/* -> ${flat}"
    "${PYTHON}" - "${ops}/pdb" "${flat}" <<'PY'
import os, sys
src, dst = sys.argv[1:3]
for chain in os.scandir(src):
    if not chain.is_dir():
        continue
    out = os.path.join(dst, chain.name)
    os.makedirs(out, exist_ok=True)
    for sub in os.scandir(chain.path):
        files = os.scandir(sub.path) if sub.is_dir() else [sub]
        for f in files:
            link = os.path.join(out, f.name)
            if not os.path.lexists(link):
                os.symlink(os.path.abspath(f.path), link)
PY
    echo "$(date -Is) preprocess with ${WORKERS} workers -> ${store}"
    "${SCALEFOLD}" preprocess --mmcif-dir "${pdb}/raw" --alignments-dir "${flat}" \
      --cluster-file "${pdb}/clusters-by-entity-40.txt" --workers "${WORKERS}" --out "${store}" --no-progress
    ;;
  mlperf)
    [[ $# -eq 3 ]] || usage
    "${SCALEFOLD}" preprocess --mlperf-dir "$2" --out "$3" --allow-pickle --no-progress
    ;;
  *)
    usage
    ;;
esac
"${SCALEFOLD}" data-stats "${store:-$3}"
echo "$(date -Is) done"
