# shellcheck shell=bash
# The demo on a CPU box (no GPU, no containers): one node, LOCAL_RANKS gloo ranks per instance
# (2-4), a synthetic store staged into DATADIR on first use, the `tiny` preset by default.
#   source launch/config_local_cpu.sh && sbatch -N 1 -t "$WALLTIME" run.sub
# Throughput mode on the same node (a prefix assignment on `source` would not outlive it, so export
# or use bash -c): NUM_INSTANCES=2 bash -c 'source launch/config_local_cpu.sh && sbatch -N 1 -t "$WALLTIME" run.sub'
: "${DGXSYSTEM:=local_cpu}"
: "${LOCAL_RANKS:=2}"                 # ranks per instance
: "${NUM_INSTANCES:=1}"
if ((LOCAL_RANKS < 2 || LOCAL_RANKS > 4)); then
  echo "config_local_cpu.sh: LOCAL_RANKS=${LOCAL_RANKS}; use 2-4 ranks on a CPU box" >&2
  return 1
fi
DGXNNODES=1
DGXNGPU=$((LOCAL_RANKS * NUM_INSTANCES))  # tasks per node (all instances share the node)
: "${CONT:=none}"
: "${DATADIR:=${PWD}/runs/local_cpu_data}"
: "${LOGDIR:=${PWD}/runs/local_cpu_results}"
: "${PRESET:=tiny}"
: "${PRECISION:=fp32}"
: "${MAX_STEPS:=4}"
: "${VAL_EVERY:=2}"
: "${DAP_SIZE:=1}"
: "${NUM_ASYNC_VAL_RANKS:=0}"
: "${CLEAR_CACHES:=0}"                # needs root and a writable /proc/sys
: "${SRUN_MPI:=none}"                 # gloo bootstraps over TCP from the Slurm environment
: "${SRUN_EXTRA_ARGS:=--overcommit}"  # more ranks than cores is fine for the demo
: "${ENABLE_BINDING:=0}"
: "${STAGE_SYNTHETIC_STORE:=1}"       # run.sub writes DATADIR/STORE_NAME with `scalefold synth` if absent
: "${SYNTH_ARGS:=--num-chains 20 --num-families 2 --min-length 24 --max-length 32 --workers 1}"
: "${INIT_MINUTES:=2}"
: "${EXPECTED_ITERS:=${MAX_STEPS}}"
: "${STEP_TIME_S:=10}"
: "${EVAL_MINUTES:=0.2}"
: "${WALLTIME_MARGIN:=2}"
export DGXSYSTEM LOCAL_RANKS DGXNNODES DGXNGPU CONT DATADIR LOGDIR SRUN_EXTRA_ARGS STAGE_SYNTHETIC_STORE SYNTH_ARGS
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# shellcheck source=launch/config_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_common.sh"
scalefold_layout
