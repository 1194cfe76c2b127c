# shellcheck shell=bash
# Settings shared by every launch/config_*.sh (sourced, never executed).
#
# A system config sets the machine (DGXSYSTEM, DGXNNODES, DGXNGPU), the parallel layout (DAP_SIZE,
# NUM_ASYNC_VAL_RANKS, NUM_INSTANCES) and a time estimate (EXPECTED_ITERS, STEP_TIME_S), sources this
# file, then calls `scalefold_layout`, which derives and exports the rest:
#
#   RANKS_PER_INSTANCE = DGXNNODES * DGXNGPU / NUM_INSTANCES
#   TRAIN_RANKS        = RANKS_PER_INSTANCE - NUM_ASYNC_VAL_RANKS   (the last ranks evaluate)
#   DP_GROUPS          = TRAIN_RANKS / (DAP_SIZE * BP_SIZE)          (each group holds one sample)
#   GLOBAL_BATCH_SIZE  = DP_GROUPS * LOCAL_BATCH_SIZE
#   WALLTIME           = NEXP * (init + iterations * step time + synchronous evals) * margin, as HH:MM:SS
#
# Everything here is a default: a variable already set in the environment wins (`: "${X:=...}"`).

# --- benchmark (MLPerf HPC OpenFold closed division) ----------------------------------------------
: "${PRESET:=mlperf}"                # `scalefold train --preset`
: "${VAL_EVERY:=40}"                 # evaluation every 40 iterations (fixed by the benchmark)
: "${TARGET_LDDT:=0.8}"              # stop at mean lDDT-Ca >= 0.8 (fixed by the benchmark)
: "${PRECISION:=bf16}"               # bf16 compute, fp32 master weights
: "${MAX_STEPS:=2000}"               # safety cap; a converging run stops much earlier
: "${CHECKPOINT_EVERY:=0}"           # timed runs do not checkpoint
: "${LOCAL_BATCH_SIZE:=1}"           # samples per DAP group per step (the model takes batch 1)
: "${SUBMISSION_ORG:=ScaleFold}"
: "${SUBMISSION_PLATFORM:=${DGXSYSTEM:-unknown}}"
# The reference checkpoint every timed run starts from (see data/README.md for where to get it).
: "${INIT_CHECKPOINT:=}"             # path as seen by the ranks (e.g. /data/mlperf_hpc_openfold_resumable_checkpoint.pt)
: "${STORE_NAME:=store.h5}"          # the preprocessed dataset store inside DATADIR

# --- parallel layout -------------------------------------------------------------------------------
: "${DAP_SIZE:=1}"                   # Dynamic Axial Parallelism group size
: "${NUM_ASYNC_VAL_RANKS:=0}"        # trailing ranks that only evaluate (asynchronous evaluation)
: "${NUM_INSTANCES:=1}"              # >1: throughput mode, concurrent independent trainings
: "${BP_SIZE:=1}"                    # branch parallelism degree (--bp 2)
: "${PARALLEL_EVOFORMER:=0}"         # 1: --parallel-evoformer

# --- submission ------------------------------------------------------------------------------------
: "${NEXP:=1}"                       # timed runs per job, in sequence, seeds SEED_BASE+0.. (a submission: 10, see run.sub)
: "${CLEAR_CACHES:=1}"               # drop the page cache on every node before each run
: "${SRUN_MPI:=pmix}"                # srun --mpi=...
: "${ENABLE_BINDING:=1}"             # numactl CPU/memory binding per local rank (when numactl exists)
: "${NIC_LIST:=}"                    # comma-separated NICs; local rank r uses NIC r % count (UCX_NET_DEVICES)
: "${INIT_MINUTES:=10}"              # model build, checkpoint load, warm-up, CUDA-graph capture (< 30 min rule)
: "${EVAL_MINUTES:=0.5}"             # one synchronous evaluation (ignored with asynchronous evaluation)
: "${WALLTIME_MARGIN:=1.5}"          # safety factor on the estimate
: "${EXPECTED_ITERS:=700}"           # iterations to reach the target at this global batch
: "${STEP_TIME_S:=2.0}"              # seconds per training step at this layout

export PRESET VAL_EVERY TARGET_LDDT PRECISION MAX_STEPS CHECKPOINT_EVERY LOCAL_BATCH_SIZE SUBMISSION_ORG \
  SUBMISSION_PLATFORM INIT_CHECKPOINT STORE_NAME DAP_SIZE NUM_ASYNC_VAL_RANKS NUM_INSTANCES BP_SIZE \
  PARALLEL_EVOFORMER NEXP CLEAR_CACHES SRUN_MPI ENABLE_BINDING NIC_LIST

# scalefold_layout: check the layout and export RANKS_PER_INSTANCE, TRAIN_RANKS, DP_GROUPS,
# GLOBAL_BATCH_SIZE, NODES_PER_INSTANCE and WALLTIME. Returns 1 (with a message on stderr) when the
# layout is impossible.
scalefold_layout() {
  local name
  for name in DGXSYSTEM DGXNNODES DGXNGPU; do
    if [[ -z "${!name:-}" ]]; then
      echo "scalefold_layout: ${name} is not set (the system config must set it)" >&2
      return 1
    fi
  done
  local nodes=$DGXNNODES gpus=$DGXNGPU instances=$NUM_INSTANCES
  if ((nodes < 1 || gpus < 1 || instances < 1 || DAP_SIZE < 1 || BP_SIZE < 1 || LOCAL_BATCH_SIZE < 1)); then
    echo "scalefold_layout: DGXNNODES, DGXNGPU, NUM_INSTANCES, DAP_SIZE, BP_SIZE, LOCAL_BATCH_SIZE must be >= 1" >&2
    return 1
  fi
  if (((nodes * gpus) % instances != 0)); then
    echo "scalefold_layout: ${nodes}x${gpus} ranks do not split into ${instances} equal instances" >&2
    return 1
  fi
  RANKS_PER_INSTANCE=$((nodes * gpus / instances))
  if ((nodes >= instances)); then
    if ((nodes % instances != 0)); then
      echo "scalefold_layout: ${nodes} nodes do not split into ${instances} instances" >&2
      return 1
    fi
    NODES_PER_INSTANCE=$((nodes / instances))
  else
    NODES_PER_INSTANCE=$nodes  # instances share the nodes (small machines)
  fi
  TRAIN_RANKS=$((RANKS_PER_INSTANCE - NUM_ASYNC_VAL_RANKS))
  if ((NUM_ASYNC_VAL_RANKS < 0 || TRAIN_RANKS < 1)); then
    echo "scalefold_layout: NUM_ASYNC_VAL_RANKS=${NUM_ASYNC_VAL_RANKS} leaves no training rank of ${RANKS_PER_INSTANCE}" >&2
    return 1
  fi
  local group=$((DAP_SIZE * BP_SIZE))  # ranks that share one sample
  if ((TRAIN_RANKS % group != 0)); then
    echo "scalefold_layout: ${TRAIN_RANKS} training ranks are not a multiple of DAP_SIZE*BP_SIZE=${group}" >&2
    return 1
  fi
  DP_GROUPS=$((TRAIN_RANKS / group))
  GLOBAL_BATCH_SIZE=$((DP_GROUPS * LOCAL_BATCH_SIZE))
  WALLTIME=$(scalefold_walltime)
  export RANKS_PER_INSTANCE NODES_PER_INSTANCE TRAIN_RANKS DP_GROUPS GLOBAL_BATCH_SIZE WALLTIME
}

# scalefold_walltime: the job time limit as HH:MM:SS from the estimate variables.
scalefold_walltime() {
  local evals=$(((EXPECTED_ITERS + VAL_EVERY - 1) / VAL_EVERY))
  local eval_minutes=$EVAL_MINUTES
  if ((NUM_ASYNC_VAL_RANKS > 0)); then
    eval_minutes=0  # hidden behind training
  fi
  awk -v nexp="$NEXP" -v init="$INIT_MINUTES" -v iters="$EXPECTED_ITERS" -v step="$STEP_TIME_S" \
    -v evals="$evals" -v evalm="$eval_minutes" -v margin="$WALLTIME_MARGIN" 'BEGIN {
      minutes = nexp * (init + iters * step / 60 + evals * evalm) * margin
      total = int(minutes * 60 + 0.999); if (total < 60) total = 60
      printf "%02d:%02d:%02d\n", int(total / 3600), int(total % 3600 / 60), total % 60
    }'
}
