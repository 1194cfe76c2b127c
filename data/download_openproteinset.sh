#!/bin/bash
# Download the OpenProteinSet PDB alignments (MSAs + template hits per PDB chain) from AWS open data.
#
#   bash data/download_openproteinset.sh DIR   # DIR/pdb/<pdb_id>_<chain>/{a3m,hhr}/..., DIR/duplicate_pdb_chains.txt
#
# Needs the AWS CLI (no account: --no-sign-request); ~606 GiB in ~524k files / ~394k directories;
# typically 6-24 h depending on bandwidth. `aws s3 sync` resumes an interrupted download.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
command -v aws >/dev/null || { echo "$0: the AWS CLI is required (https://aws.amazon.com/cli/)" >&2; exit 1; }
dir=$1
: "${OPENPROTEINSET_BUCKET:=s3://openfold}"
mkdir -p "${dir}/pdb"

echo "$(date -Is) ${OPENPROTEINSET_BUCKET} -> ${dir}"
aws s3 cp --no-sign-request "${OPENPROTEINSET_BUCKET}/LICENSE" "${dir}/"
aws s3 cp --no-sign-request "${OPENPROTEINSET_BUCKET}/duplicate_pdb_chains.txt" "${dir}/"
aws s3 sync --no-sign-request --only-show-errors "${OPENPROTEINSET_BUCKET}/pdb/" "${dir}/pdb/"
echo "$(date -Is) done: $(find "${dir}/pdb" -mindepth 1 -maxdepth 1 -type d | wc -l) chains"
