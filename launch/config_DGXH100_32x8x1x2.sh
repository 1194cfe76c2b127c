# shellcheck shell=bash
# 32 DGX H100 nodes (256 GPUs), DAP-2: 128 data-parallel groups of 2 GPUs, global batch 128,
# synchronous evaluation. ~690 iterations to the target at batch 128; DAP-2 step ~1.12 s.
#   source launch/config_DGXH100_32x8x1x2.sh && sbatch -N "$DGXNNODES" -t "$WALLTIME" run.sub
: "${DGXSYSTEM:=DGXH100_32x8x1x2}"
: "${DGXNNODES:=32}"
: "${DGXNGPU:=8}"
: "${DAP_SIZE:=2}"
: "${NUM_ASYNC_VAL_RANKS:=0}"
: "${EXPECTED_ITERS:=690}"
: "${STEP_TIME_S:=1.12}"
: "${MAX_STEPS:=1500}"
export DGXSYSTEM DGXNNODES DGXNGPU
# shellcheck source=launch/config_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_common.sh"
scalefold_layout
