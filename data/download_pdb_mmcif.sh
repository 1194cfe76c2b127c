#!/bin/bash
# Mirror the RCSB PDB mmCIF archive plus the two metadata files the training-set filters need.
#
#   bash data/download_pdb_mmcif.sh DIR        # DIR/raw/<xy>/<xyz>.cif.gz, DIR/obsolete.dat, DIR/clusters-by-entity-40.txt
#
# Needs rsync and curl; ~55 GiB in ~200k files; hours (one rsync stream). Re-running resumes and
# updates. Mirrors: RSYNC_SOURCE=rsync.ebi.ac.uk::pub/databases/pdb/data/structures/divided/mmCIF/
# (Europe) or ftp.pdbj.org::ftp_data/structures/divided/mmCIF/ (Asia; both with RSYNC_PORT=873).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
for tool in rsync curl; do
  command -v "${tool}" >/dev/null || { echo "$0: ${tool} is required" >&2; exit 1; }
done
dir=$1
: "${RSYNC_SOURCE:=rsync.rcsb.org::ftp_data/structures/divided/mmCIF/}"
: "${RSYNC_PORT:=33444}"
mkdir -p "${dir}/raw"

echo "$(date -Is) mmCIF mirror ${RSYNC_SOURCE} -> ${dir}/raw"
rsync --recursive --links --perms --times --compress --delete --info=progress2 --port="${RSYNC_PORT}" \
  "${RSYNC_SOURCE}" "${dir}/raw/"
curl -fsSL --retry 5 -o "${dir}/obsolete.dat" https://files.wwpdb.org/pub/pdb/data/status/obsolete.dat
curl -fsSL --retry 5 -o "${dir}/clusters-by-entity-40.txt" \
  https://cdn.rcsb.org/resources/sequence/clusters/clusters-by-entity-40.txt
echo "$(date -Is) done: $(find "${dir}/raw" -name '*.cif.gz' | wc -l) entries"
