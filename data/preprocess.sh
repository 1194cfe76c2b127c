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
    # OpenProteinSet keeps each chain's files in a3m/ and hhr/ subdirectories, and stores identical
    # chains once (duplicate_pdb_chains.txt: one line per group of identical chains). The store
    # builder reads one flat directory per chain: link the files into <store>.alignments/<chain>/
    # and every duplicate chain to the directory of its group's stored chain.
    flat="${store}.alignments"
    echo "$(date -Is) linking ${ops}/pdb/*/{a3m,hhr}/* -> ${flat}"
    "${PYTHON}" - "${ops}/pdb" "${flat}" "${ops}/duplicate_pdb_chains.txt" <<'PY'
import os, sys
src, dst, duplicates = sys.argv[1:4]
if not os.path.isdir(src):
    sys.exit(f"preprocess.sh: OpenProteinSet chain directory not found: {src}")
os.makedirs(dst, exist_ok=True)
stored = set()
for chain in os.scandir(src):
    if not chain.is_dir():
        continue
    stored.add(chain.name)
    out = os.path.join(dst, chain.name)
    os.makedirs(out, exist_ok=True)
    for sub in os.scandir(chain.path):
        for f in (os.scandir(sub.path) if sub.is_dir() else [sub]):
            link = os.path.join(out, f.name)
            if not os.path.lexists(link):
                os.symlink(os.path.abspath(f.path), link)
linked = 0
if os.path.isfile(duplicates):
    with open(duplicates) as fh:
        for line in fh:
            group = line.split()
            rep = next((c for c in group if c in stored), None)
            for chain in group:
                link = os.path.join(dst, chain)
                if rep is not None and chain != rep and not os.path.lexists(link):
                    os.symlink(rep, link)  # relative: <flat>/<chain> -> <flat>/<rep>
                    linked += 1
else:
    print(f"preprocess.sh: no {duplicates}: duplicate chains get no alignments", file=sys.stderr)
print(f"{len(stored)} chain directories, {linked} duplicate chains linked")
PY
    [[ -d "${pdb}/raw" ]] || { echo "$0: ${pdb}/raw not found (the mmCIF mirror of download_pdb_mmcif.sh)" >&2; exit 1; }
    clusters=()
    if [[ -f "${pdb}/clusters-by-entity-40.txt" ]]; then
      clusters=(--cluster-file "${pdb}/clusters-by-entity-40.txt")
    else
      echo "$0: warning: no ${pdb}/clusters-by-entity-40.txt: chains get no cluster id (the benchmark's training filter needs it)" >&2
    fi
    echo "$(date -Is) preprocess with ${WORKERS} workers -> ${store}"
    "${SCALEFOLD}" preprocess --mmcif-dir "${pdb}/raw" --alignments-dir "${flat}" "${clusters[@]}" \
      --workers "${WORKERS}" --out "${store}" --no-progress
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
