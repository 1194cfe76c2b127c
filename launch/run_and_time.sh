#!/bin/bash
# One rank of a timed ScaleFold run; `run.sub` starts one copy per rank with `srun` (no torchrun:
# `scalefold train` reads its rank from the SLURM_* environment, see scalefold/distributed/runtime.py).
#
# Maps the config_*.sh environment to `scalefold train` flags, gives every rank its own
# TRITON_CACHE_DIR, optionally binds the rank to the CPUs/memory of its NUMA node and to one NIC, and
# prints `RESULT,OPENFOLD_HPC,,<seconds>,<org>,<start>` (on the first rank of the run).
#
# Environment (all optional unless noted):
#   DATA_ROOT, RESULTS_ROOT  where the data and the results are, as seen by this rank (run.sub sets
#                            /data and /results in a container, DATADIR and LOGDIR without)
#   RUN_OUT                  run directory (default RESULTS_ROOT/run); STORE_NAME (default store.h5)
#   PRESET PRECISION MAX_STEPS VAL_EVERY CHECKPOINT_EVERY TARGET_LDDT SEED INIT_CHECKPOINT
#   NUM_ASYNC_VAL_RANKS DAP_SIZE BP_SIZE PARALLEL_EVOFORMER TRAIN_CONFIG EXTRA_ARGS
#   ENABLE_BINDING NIC_LIST SUBMISSION_ORG SCALEFOLD_BIN (default: scalefold)
#   DRYRUN=1                 print the command instead of running it
set -euo pipefail

rank=${SLURM_PROCID:-${RANK:-0}}
local_rank=${SLURM_LOCALID:-${LOCAL_RANK:-0}}
local_size=${SLURM_NTASKS_PER_NODE:-${LOCAL_WORLD_SIZE:-1}}
local_size=${local_size%%(*}  # "8(x2)" -> 8

: "${DATA_ROOT:=${DATADIR:-/data}}"
: "${RESULTS_ROOT:=${LOGDIR:-/results}}"
: "${RUN_OUT:=${RESULTS_ROOT}/run}"
: "${STORE_NAME:=store.h5}"
: "${SUBMISSION_ORG:=ScaleFold}"
: "${SCALEFOLD_BIN:=scalefold}"

# --- environment -> flags ---------------------------------------------------------------------------
# The config_*.sh variables (PRECISION, MAX_STEPS, VAL_EVERY, DAP_SIZE, ...) become flags through the
# options' one declaration (scalefold/config/training.py): `python -m scalefold slurm-flags`
# prints them, one a line (standard library only, run from this checkout).
args=(train --preset "${PRESET:-mlperf}" --out "${RUN_OUT}" --store "${DATA_ROOT}/${STORE_NAME}" --no-progress)
[[ -n "${TRAIN_CONFIG:-}" ]] && args+=(--config "${TRAIN_CONFIG}")
checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! derived=$(PYTHONPATH="${checkout}${PYTHONPATH:+:${PYTHONPATH}}" "${PYTHON:-python3}" -m scalefold slurm-flags); then
  echo "run_and_time.sh: could not map the config variables to scalefold train flags" >&2
  exit 3
fi
if [[ -n "${derived}" ]]; then
  mapfile -t mapped <<<"${derived}"
  args+=("${mapped[@]}")
fi
if [[ -n "${EXTRA_ARGS:-}" ]]; then
  read -r -a extra <<<"${EXTRA_ARGS}"
  args+=("${extra[@]}")
fi

# --- per-rank environment ---------------------------------------------------------------------------
# Triton's autotune/compile cache must not be shared by concurrent ranks on one node.
export TRITON_CACHE_DIR="${TRITON_CACHE_ROOT:-${TMPDIR:-/tmp}/scalefold_triton}/${SLURM_JOB_ID:-local}_${SLURM_STEP_ID:-0}_rank${rank}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

launcher=()
if [[ "${ENABLE_BINDING:-0}" == 1 ]] && command -v numactl >/dev/null; then
  numa_nodes=$(find /sys/devices/system/node -maxdepth 1 -name 'node[0-9]*' 2>/dev/null | wc -l)
  if ((numa_nodes > 1 && local_size > 0)); then
    numa_node=$((local_rank * numa_nodes / local_size))
    launcher=(numactl "--cpunodebind=${numa_node}" "--membind=${numa_node}")
  fi
fi
if [[ -n "${NIC_LIST:-}" ]]; then
  IFS=, read -r -a nics <<<"${NIC_LIST}"
  export UCX_NET_DEVICES="${nics[local_rank % ${#nics[@]}]}:1"
fi

if [[ "${DRYRUN:-0}" == 1 ]]; then
  printf 'TRITON_CACHE_DIR=%q' "${TRITON_CACHE_DIR}"
  [[ -n "${UCX_NET_DEVICES:-}" ]] && printf ' UCX_NET_DEVICES=%q' "${UCX_NET_DEVICES}"
  printf ' %q' "${launcher[@]}" "${SCALEFOLD_BIN}" "${args[@]}"
  printf '\n'
  exit 0
fi

# --- timed run -------------------------------------------------------------------------------------
mkdir -p "${TRITON_CACHE_DIR}"
start=$(date +%s)
start_fmt=$(date +'%Y-%m-%d %r')
if ((rank == 0)); then
  echo "STARTING TIMING RUN AT ${start_fmt}"
fi
rc=0
"${launcher[@]}" "${SCALEFOLD_BIN}" "${args[@]}" || rc=$?
end=$(date +%s)
if ((rank == 0)); then
  echo "ENDING TIMING RUN AT $(date +'%Y-%m-%d %r') (exit status ${rc})"
  echo "RESULT,OPENFOLD_HPC,,$((end - start)),${SUBMISSION_ORG},${start_fmt}"
fi
exit "${rc}"
