# shellcheck shell=bash
# The record layout: 260 DGX H100 nodes (2080 GPUs) = 256 DAP-8 groups (2048 training GPUs,
# global batch 256) + 32 asynchronous-evaluation GPUs. ~520 iterations; DAP-8 step ~0.65 s.
#   source launch/config_DGXH100_260x8x1x8.sh && sbatch -N "$DGXNNODES" -t "$WALLTIME" run.sub
: "${DGXSYSTEM:=DGXH100_260x8x1x8}"
: "${DGXNNODES:=260}"
: "${DGXNGPU:=8}"
: "${DAP_SIZE:=8}"
: "${NUM_ASYNC_VAL_RANKS:=32}"
: "${EXPECTED_ITERS:=520}"
: "${STEP_TIME_S:=0.65}"
: "${MAX_STEPS:=1200}"
export DGXSYSTEM DGXNNODES DGXNGPU
# shellcheck source=launch/config_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_common.sh"
scalefold_layout
