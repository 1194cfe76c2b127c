# shellcheck shell=bash
# One DGX H100 (8 GPUs), DAP-1: 8 data-parallel ranks, global batch 8, synchronous evaluation.
#   source launch/config_DGXH100_1x8x1x1.sh && sbatch -N "$DGXNNODES" -t "$WALLTIME" run.sub
# Time estimate: ScaleFold DAP-1 step on H100 ~1.8 s; a batch this small needs several thousand
# iterations (an estimate: the benchmark's published runs use global batch 128-256).
: "${DGXSYSTEM:=DGXH100_1x8x1x1}"
: "${DGXNNODES:=1}"
: "${DGXNGPU:=8}"
: "${DAP_SIZE:=1}"
: "${NUM_ASYNC_VAL_RANKS:=0}"
: "${EXPECTED_ITERS:=4000}"
: "${STEP_TIME_S:=1.8}"
: "${MAX_STEPS:=8000}"
: "${EVAL_MINUTES:=2}"               # 180 targets on 8 GPUs
export DGXSYSTEM DGXNNODES DGXNGPU
# shellcheck source=launch/config_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_common.sh"
scalefold_layout
