# shellcheck shell=bash
# Throughput mode: 16 concurrent trainings x 128 GPUs (16 nodes each, 256 nodes in all), DAP-1:
# each instance has global batch 128 and its own MLPerf log. ~690 iterations at ~1.8 s.
#   source launch/config_DGXH100_throughput_256x8x1x1.sh && sbatch -N "$DGXNNODES" -t "$WALLTIME" run.sub
: "${DGXSYSTEM:=DGXH100_throughput_256x8x1x1}"
: "${DGXNNODES:=256}"
: "${DGXNGPU:=8}"
: "${NUM_INSTANCES:=16}"
: "${DAP_SIZE:=1}"
: "${NUM_ASYNC_VAL_RANKS:=0}"
: "${EXPECTED_ITERS:=690}"
: "${STEP_TIME_S:=1.8}"
: "${MAX_STEPS:=1500}"
export DGXSYSTEM DGXNNODES DGXNGPU
# shellcheck source=launch/config_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_common.sh"
scalefold_layout
