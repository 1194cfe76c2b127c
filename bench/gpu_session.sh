#!/usr/bin/env bash
# GPU validation of ScaleFold's CUDA-only paths, in one batch (for a lent GPU machine: one command,
# <= 10 minutes, files come back from $OUT).
#
#   bash bench/gpu_session.sh                       # everything (OUT defaults to runs/gpu_session)
#   PARTS="tests train" bash bench/gpu_session.sh   # a subset (or: bash bench/gpu_session.sh tests train)
#   DRY_RUN=1 [CARD=h100|h200] PARTS=headline bash bench/gpu_session.sh   # the plan on that card (no CUDA needed):
#                                                   # each part's expected seconds, the call's total with set-up and
#                                                   # packing, and the device-time plan of a 15-minute window
#   PARTS=headline bash bench/gpu_session.sh        # THE first call of a window: env + install + headline, <= 540 s
#   REHEARSE=cpu PARTS=headline bash bench/gpu_session.sh   # the same script on a CPU: preset tiny, fp32, torch
#                                                   # kernels, the same driver, caps, deadline (300 s), skip rules,
#                                                   # packing and SUMMARY.txt; what needs CUDA skipped with why
#
# A window (15 minutes of device time: the machine's start, 1-2 minutes, and every idle second included; one
# command <= 600 s) has room for ONE full call and, if that call ends early, a short follow-up on the still-warm
# machine (<= ~140 s, e.g. PARTS=probe_attention_grid), then give-back. So each window runs one group:
# PARTS=headline first; later windows PARTS="tests train", PARTS=bench, PARTS=policies, PARTS=tune.
#
# What runs, in this order (each part under `timeout`; per-part limits in seconds; the order puts
# correctness first, so the global deadline, if ever reached, cuts benchmarks rather than tests):
#
#   part               limit  what
#   env                   90  nvidia-smi, torch/triton/NCCL versions, torch.cuda.is_available() (ENV_LIMIT; a cold
#                             first import on a fresh machine can take tens of seconds: a timeout is SLOW, the
#                             call goes on); no CUDA: "no CUDA" message, exit 2 (nothing else runs; REHEARSE=cpu:
#                             goes on, the rehearsal)
#   install               30  never a network index (the GPU machine reaches none): gemmi/mlperf-logging from
#                             carried wheels ($WHEELS, default .whl/, `pip --no-index`) if missing; scalefold
#                             from the checkout by PYTHONPATH (no pip install). The headline needs neither wheel
#   tests_kernels         90  pytest tests/kernels (Triton kernels compiled for the GPU, bf16 tests)
#   probe_attention_grid  40  Triton attention at the template-pointwise shape of crops 64/128/256
#                             ([1, N, N] x 4 heads, 1 query, 4 templates): Z*H = N*N*4 blocks, past
#                             CUDA's 65535 of grid axes 1/2 from crop 128 on (the launchers put Z*H on
#                             axis 0 since d3f1b36; this checks it on a GPU); exits 1 if any size fails
#   tests_graphs         150  pytest tests/compilation/test_cuda_graphs.py tests/compilation/test_graphed_step.py
#                             tests/train/test_precision_compile.py (real CUDA-graph capture, bf16;
#                             the compile tests run inductor)
#                             (pytest: with pytest-xdist, as the device image has, PYTEST_WORKERS
#                             processes, default 8: Triton/inductor compiles are CPU-bound; a failing
#                             test's traceback is printed when it fails, SCALEFOLD_EARLY_TRACEBACKS=1,
#                             so a run cut short by its limit still says why)
#   headline             480  bench/step_headline.py: THE figure -- the full training step at MLPerf shapes
#                             (crop 256, 124/1024 MSA, 4 templates, recycling 0..3 in turn), bf16, six ways, in
#                             the order of their value: eager (baseline), graphs-step (whole-step CUDA graphs,
#                             torch kernels; the bar: <= 1.2 s/step on an H100), all (the product's figure:
#                             Triton + compile + whole-step CUDA graphs), triton, graphs (recycling passes),
#                             compile; each in a process of its own, started only when the time left
#                             covers its expected seconds on the card in hand (bench/headline_plan.py: from the
#                             step's FLOPs / bytes and the measured H200 row; after eager, from eager's measured
#                             step), killed at its cap (1.5x expected + 15 s); what is skipped is said with why.
#                             Per configuration, printed and written ($WORK/headline/rows.jsonl) the moment they
#                             exist, BEFORE its profile: s/step per recycling count, mean, MFU, peak
#                             torch.cuda.max_memory_allocated. Extras a cap may cut without losing the row: a
#                             torch.profiler profile of one step ($WORK/headline/<config>_profile.json / .png)
#                             and, for eager, one more step's allocator trace ($WORK/memory/, compared by
#                             allocating line with the memory model's --sites). The CPU estimates
#                             (estimate-memory x2, estimate-step: FLOPs, and `predicted_s` where it has one) run
#                             meanwhile, niced, each with its own cap (HEADLINE_ESTIMATE_CAP), their output and
#                             errors in $WORK/headline/estimates/ (in the tarball), kept in $ESTIMATES for the
#                             next call (or computed on a CPU machine and carried); the table never waits past the
#                             driver's deadline (the part's limit - 15 s): a late estimate is reported late.
#                             Beside each row: the step-time model's predicted_s for the card in hand (eager, or
#                             graphed for graphs-step / all) and the miss in %.
#                             Its --deadline is the call plan's (bench/headline_plan.py --call-plan: what the
#                             group's other parts leave of 85 % of DEADLINE_S); a whole-step row's captures are
#                             counted from the capture code, and the row reshaped to fewer recycling counts where
#                             they would not fit. DRY_RUN=1 prints the call plan on $CARD (issue 46, RESULTS.md):
#                             H100 eager ~88 s, graphs-step ~111 (counts 0..2), the rest skipped; the call ~430 s
#                             of 540; H200 eager ~85, graphs-step ~132 (0..3), the call ~448 s.
#   train_step_off        90  (headline group) scalefold train --preset demo --precision bf16 --max-steps 8
#                             --eval-every 4 --checkpoint-every 4 --cuda-graphs off, PyTorch kernels
#   train_step_graphs    120  the same with --cuda-graphs step (the trainer's whole-step path: loader, evaluation,
#                             checkpoints around replays)
#   train_step_compare    30  bench/train_step_compare.py: the graphed steps counted from its output, every step's
#                             metrics within the warm-up check's GPU tolerance (2e-2) of the eager run's
#   train_bf16            90  scalefold train --preset demo --precision bf16 --max-steps 20
#                             --eval-every 10 --cuda-graphs off   (eager bf16 baseline)
#   train_graphs          60  the same with --cuda-graphs on      (captured recycling passes)
#                             (the kernels launch the shipped launch-config table's configs, nothing is
#                             timed at start-up; with run-time autotuning, SCALEFOLD_AUTOTUNE=1, timing
#                             every candidate at each new shape class took the whole 70 s on an H200)
#   policy_on/22/off     150  (PARTS=policies only) the Triton MLPerf-shape step under each recompute policy:
#                             s/step, MFU, real peak beside the memory model (issue 25 part 4); the estimates
#                             (minutes at MLPerf shapes) outlast a 140 s deadline and are reported late unless
#                             computed beforehand on a CPU machine and carried: for P in on 22 off: python
#                             bench/step_headline.py --estimates-only --estimate-reuse runs/headline_estimates
#                             --configs triton --activation-checkpointing $P; carry runs/headline_estimates
#   tune_kernels         270  (PARTS=tune only) scalefold tune-kernels --out $WORK/launch_configs.json
#                             --max-seconds 240: times the launch configs at the MLPerf call sites, writes the table
#   bench_attention       55  bench/kernels.py --kernel attention --shape mlperf --dtype bf16
#   bench_layernorm       30  bench/kernels.py --kernel layernorm --shape mlperf --dtype bf16
#   bench_adam            30  bench/kernels.py --kernel adam --shape mlperf --dtype bf16
#   bench_trimul          60  bench/kernels.py --kernel trimul --shape mlperf --dtype bf16
#   bench_anchor          90  bench/anchor_kernels.py: cuEquivariance's triangle multiplication / attention beside
#                             ScaleFold's Triton kernels and the PyTorch reference (crop 256, bf16, fwd+bwd; each
#                             checked against the float32 reference first); cuEquivariance from carried wheels
#                             ($WHEELS, pip --no-index, like gemmi) -- where it is missing, one line says so
#   bench_fusions        120  bench/fusions.py: the fused outer product mean and the Evoformer attentions beside their
#                             PyTorch paths (MLPerf shapes, bf16, fwd+bwd; expected 80 s is an estimate, never run)
#   bench_cuda_graphs     35  bench/cuda_graphs.py --preset demo --precision bf16 --steps 3
#   bench_dap             30  bench/dap.py --cuda --dap 1 [2 4 8: as many GPUs as there are]
#                   total 1270 s of limits: more than one call, and a window's device time is 15 minutes,
#                   the machine's start (1-2 minutes) included. So one group per window: PARTS=headline
#                   first (the figure the project exists for); the global deadline cuts the tail
#                   (SKIPPED lines in SUMMARY.txt).
#
# Groups for PARTS: env and install (always run), tests (tests_* and the probe), headline, train, bench;
# single part names work too, and "-NAME" leaves a part out (PARTS="headline -train_step_off ..."). A global deadline (DEADLINE_S, default 540) caps every part's limit at the
# time left and skips a part with < 10 s left. TIMEOUT_SCALE multiplies every limit (e.g. 1.5 when a
# call runs only part of the list and its parts need more time).
#
# Not run: bench/optimizer_step.py (CPU only: no device option; the GPU optimizer is bench_adam and
# the training runs), bench/data_pipeline.py, loader_stall.py, dali_loader.py (data / CPU).
# NCCL: no test in tests/ uses NCCL (the distributed tests are gloo on CPU). One GPU cannot host two
# NCCL ranks ("duplicate GPU"), so on a 1-GPU machine bench_dap runs DAP 1 only (NCCL initialised,
# no collective); DAP 2/4/8 over NCCL needs a machine with that many GPUs.
#
# Output ($OUT: at most 8 files come back from the device tool, so the detail is packed):
#   $OUT/SUMMARY.txt       one line per part: status, exit code, seconds, limit, last log line
#   $OUT/session.log       the whole console output
#   $OUT/results.tar.gz    every part's log, junit XML, benchmark output, training metrics.jsonl /
#                          mlperf.log / curves, autotune tables, env.txt (checkpoints and the store
#                          left out); refreshed after every part, so a kill still leaves one
#   $OUT/junit_tests_kernels.xml, $OUT/junit_tests_graphs.xml   (copies, for a quick look)
#   $OUT/headline.json     the headline's rows, late estimates and predictions
#   SUMMARY.txt's last line (OUT) checks what comes back: <= 8 files, <= 16 MiB each, <= two folders deep
#   $OUT/eager_memory.pickle.gz   the headline's allocator trace of one eager step, where under 16 MiB (its
#                          peak by allocating line and the comparison with the memory model: memory/ in the tarball)
# Exit status: 0 all selected parts passed, 1 some part failed or timed out, 2 no CUDA.
#
# Environment: OUT, WORK (scratch, default a fresh mktemp dir), PYTHON, WHEELS, PARTS, DEADLINE_S (default 540;
# REHEARSE=cpu: 300), REHEARSE, CARD, ENV_LIMIT, ESTIMATES (default runs/headline_estimates), HEADLINE_ESTIMATE_CAP,
# SCALEFOLD_HEADLINE_CAP_SCALE (the caps' factor; REHEARSE=cpu: 3), SCALEFOLD_REHEARSE_FAULT (the rehearsal's
# fault hooks: raise:<config>, hang-profile:<config>, late-estimate:<flops|torch|triton>; bench/headline_procs.py),
# TIMEOUT_SCALE, DRY_RUN, BENCH_CUDA_GRAPHS_PRESET (default demo; mlperf needs a longer limit), COMPILE_CACHE.
#
# Compile cache: inductor's and Triton's caches go to COMPILE_CACHE (default runs/compile_cache in the
# repository: ignored by git, so it stays on the device machine between calls), a subfolder per torch /
# Triton / Python / GPU (scalefold/compilation/cache.py), Triton's per rank: the second call with the same
# code, shapes and versions starts warm. A new torch, Triton or GPU gets a fresh subfolder; a corrupt one
# is rebuilt with one line -- only on an error a corrupt or stale cache raises (a loader / unpickling error, a
# file of the cache named), never on an out-of-memory or a CUDA-graph capture error (compile_with_rebuild).

set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1

OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT" || { echo "gpu_session: cannot create OUT=$OUT" >&2; exit 1; }
OUT="$(cd "$OUT" && pwd)"
WORK_IS_TEMP=0
[ -z "${WORK:-}" ] && WORK_IS_TEMP=1
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX")}
mkdir -p "$WORK" && WORK="$(cd "$WORK" && pwd)"
WHEELS=${WHEELS:-.whl}
REHEARSE=${REHEARSE:-}
case "$REHEARSE" in "" | cpu) ;; *) echo "gpu_session: REHEARSE=$REHEARSE: only REHEARSE=cpu exists" >&2; exit 3 ;; esac
CARD=${CARD:-h100}  # DRY_RUN: the card the plan is for (h100, h200)
if [ "$REHEARSE" = cpu ]; then DEADLINE_S=${DEADLINE_S:-300}; else DEADLINE_S=${DEADLINE_S:-540}; fi
TIMEOUT_SCALE=${TIMEOUT_SCALE:-1}
DRY_RUN=${DRY_RUN:-0}
BENCH_CUDA_GRAPHS_PRESET=${BENCH_CUDA_GRAPHS_PRESET:-demo}
COMPILE_CACHE=${COMPILE_CACHE:-$REPO/runs/compile_cache}
ESTIMATES=${ESTIMATES:-$REPO/runs/headline_estimates}  # the headline's CPU estimates, kept (and reused) between calls
HEADLINE_ESTIMATE_CAP=${HEADLINE_ESTIMATE_CAP:-}     # seconds each estimate may take (default: the headline's deadline)
# expected seconds per part on an H100 (DRY_RUN prints them beside the limits; the limits are the caps); those of the
# headline call's parts (env, install, capture_real, train_step_*, pack) are bench/headline_plan.py's CALL_PARTS, below
declare -A EXPECT=([env]=20 [install]=3 [capture_real]=90 [tests_kernels]=60 [probe_attention_grid]=20 [tests_graphs]=110 [headline]=425 [tune_kernels]=240 [policy_on]=120 [policy_22]=120 [policy_off]=120
                   [train_bf16]=60 [train_graphs]=45 [bench_attention]=35 [bench_layernorm]=20 [bench_adam]=20 [bench_trimul]=40
                   [bench_cuda_graphs]=25 [bench_dap]=20 [bench_anchor]=60 [bench_fusions]=80)
if [ "$#" -gt 0 ]; then PARTS="$*"; fi
PARTS=${PARTS:-"tests headline train bench"}

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] && command -v python >/dev/null; then PY=python
elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY=python3
fi

# the headline call's plan, one source (bench/headline_plan.py): its parts' expected seconds, and the headline's
# deadline, what the other parts leave of DEADLINE_S less a 15 % margin (the rehearsal: its own figures)
PLAN_FLAGS=()
[ "$REHEARSE" = cpu ] && PLAN_FLAGS=(--rehearsal)
if plan_expect=$("$PY" bench/headline_plan.py --bash-expect "${PLAN_FLAGS[@]}" 2>/dev/null); then
    eval "$plan_expect"
fi
HEADLINE_DEADLINE=$("$PY" bench/headline_plan.py --headline-deadline --deadline "$DEADLINE_S" "${PLAN_FLAGS[@]}" 2>/dev/null) \
    || HEADLINE_DEADLINE=$((DEADLINE_S * 85 / 100 - 200))
EXPECTED_TOTAL=${EXPECT[env]}
PACK_S=${EXPECT[pack]:-5}  # the last packing of $OUT (DRY_RUN's total of the call)

SUMMARY="$OUT/SUMMARY.txt"
START=$SECONDS
FAILED=0
: >"$SUMMARY"
: >"$OUT/session.log"
exec > >(tee -a "$OUT/session.log") 2>&1
TEE_PID=$!
trap 'exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null' EXIT  # session.log complete before we return

export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export SCALEFOLD_EARLY_TRACEBACKS=1               # tests/conftest.py: a failing test's traceback at once
export SCALEFOLD_AUTOTUNE_DIR="$WORK/autotune"   # tuned launch configs come back in the tarball
export MPLBACKEND=Agg
export SCALEFOLD_COMPILE_CACHE="$COMPILE_CACHE"  # scalefold train / bench step / step_headline: kept between runs
unset TRITON_INTERPRET                            # the kernels must compile for the GPU here
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "$REHEARSE" = cpu ]; then  # the rehearsal's caps: generous on a busy CPU (the work is seconds)
    export SCALEFOLD_HEADLINE_CAP_SCALE=${SCALEFOLD_HEADLINE_CAP_SCALE:-3}
    # one intra-op thread unless told otherwise: tiny tensors, and on a shared CPU two spin-waiting threads per
    # process made a tiny step ~20 s instead of ~0.3 s (2-core box, load 12-18, 2026-12-07)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# `timeout -s INT`: Python turns SIGINT into KeyboardInterrupt, so a stuck part prints where it was
# and pytest still writes its junit XML. `env --default-signal=INT` undoes an inherited SIG_IGN
# (commands started in the background ignore SIGINT). -k: SIGKILL 15 s later if that did not work.
if env --default-signal=INT true 2>/dev/null; then RESET_INT=(env --default-signal=INT); else RESET_INT=(); fi

note() { printf '\n=== gpu_session [%4ds] %s\n' "$((SECONDS - START))" "$*"; }

pack() {  # refresh $OUT/results.tar.gz from $WORK (small files only)
    tar -czf "$OUT/results.tar.gz.tmp" -C "$WORK" --exclude='*.h5' --exclude='*.pt' --exclude='*.ckpt' \
        --exclude='checkpoints' --exclude='*.tmp' --exclude='*.pickle.gz' . 2>/dev/null \
        && mv -f "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
    for f in "$WORK"/junit_*.xml "$WORK"/headline/headline.json; do [ -f "$f" ] && cp -f "$f" "$OUT/"; done
    # the allocator trace (tens of MiB at MLPerf shapes) beside the tarball, where it fits what comes back (16 MiB a
    # file); its peak summary and the comparison with the memory model are small and in the tarball (memory/)
    for f in "$WORK"/memory/*_memory.pickle.gz; do [ -f "$f" ] && [ "$(stat -c %s "$f")" -lt 16000000 ] && cp -f "$f" "$OUT/"; done
    return 0
}

check_out() {  # what comes back from $OUT: at most 8 files, 16 MiB each, two folders deep
    local n big deep
    n=$(find "$OUT" -type f | wc -l)
    big=$(find "$OUT" -type f -size +16M | wc -l)
    deep=$(find "$OUT" -mindepth 3 | wc -l)
    printf '%-20s %-8s %s files, %s over 16 MiB, %s entries deeper than two folders (limits: 8, 0, 0)\n' OUT \
        "$([ "$n" -le 8 ] && [ "$big" = 0 ] && [ "$deep" = 0 ] && echo PASS || echo FAIL)" "$n" "$big" "$deep" >>"$SUMMARY"
}

selected() {  # selected PART GROUP ("-PART" in PARTS leaves that part out of its group)
    local p
    [ "$2" = always ] && return 0
    for p in $PARTS; do [ "$p" = "-$1" ] && return 1; done
    for p in $PARTS; do [ "$p" = "$1" ] || [ "$p" = "$2" ] || [ "$p" = all ] && return 0; done
    return 1
}

# part NAME GROUP LIMIT_S CMD...: run CMD under timeout, log to $WORK/NAME.log, one SUMMARY line
part() {
    local name=$1 group=$2 limit=$3; shift 3
    if ! selected "$name" "$group"; then
        printf '%-20s -        not in PARTS (%s)\n' "$name" "$PARTS" >>"$SUMMARY"; return 0
    fi
    if [ "$REHEARSE" = cpu ] && [ "$group" != headline ] && [ "$group" != always ]; then
        printf '%-20s SKIPPED  rc=-       0s  | rehearsal (REHEARSE=cpu): needs CUDA; only the headline is rehearsed\n' "$name" >>"$SUMMARY"
        note "$name: skipped (rehearsal: needs CUDA)"; return 0
    fi
    limit=$(awk -v l="$limit" -v s="$TIMEOUT_SCALE" 'BEGIN { printf "%d", l * s }')
    local left=$((DEADLINE_S - (SECONDS - START)))
    local log="$WORK/$name.log" rc status t0 dt last
    if [ "$left" -lt 10 ]; then
        printf '%-20s SKIPPED  rc=-    %4ss  limit %ss  (global deadline %ss reached)\n' \
            "$name" 0 "$limit" "$DEADLINE_S" >>"$SUMMARY"
        note "$name: skipped, global deadline reached"; FAILED=1; return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    note "$name (limit ${limit}s)"
    t0=$SECONDS
    local args=() a
    local inside=$((limit - 15 > 20 ? limit - 15 : 20))
    for a in "$@"; do  # pytest's session timeout: 15 s inside this part's (possibly capped) limit; the headline's
        a=${a//@SESSION_LIMIT@/$inside}  # deadline: the plan's, never past that either
        args+=("${a//@PLAN_DEADLINE@/$((HEADLINE_DEADLINE < inside ? HEADLINE_DEADLINE : inside))}")
    done
    if [ "$DRY_RUN" = 1 ]; then
        EXPECTED_TOTAL=$((EXPECTED_TOTAL + ${EXPECT[$name]:-0}))
        echo "(dry run) expected ~${EXPECT[$name]:-?}s, limit ${limit}s: ${args[*]}" | tee "$log"; rc=dry
    else
        timeout -s INT -k 15 "$limit" "${RESET_INT[@]}" "${args[@]}" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    fi
    dt=$((SECONDS - t0))
    case $rc in
        0) status=PASS ;;
        dry) status=DRY_RUN ;;
        124 | 137) status=TIMEOUT; FAILED=1 ;;
        *) status=FAIL; FAILED=1 ;;
    esac
    last=$(grep -v '^[[:space:]]*$' "$log" 2>/dev/null | tail -n 1 | tr -d '\r' | cut -c1-160)
    printf '%-20s %-8s rc=%-4s %4ss  limit %ss  | %s\n' "$name" "$status" "$rc" "$dt" "$limit" "$last" >>"$SUMMARY"
    note "$name: $status (rc $rc, ${dt}s)"
    pack
}

pytest_args() {  # pytest_args NAME: junit XML + per-test and per-session timeouts when available
    PYTEST_ARGS=(-v -rfEs --junitxml="$WORK/junit_$1.xml" -o junit_family=xunit2)
    if "$PY" -c 'import xdist' 2>/dev/null; then
        PYTEST_ARGS+=(-n "${PYTEST_WORKERS:-8}")  # compiles are CPU-bound; the GPU has room for all
    fi
    if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
        PYTEST_ARGS+=(--timeout=60)  # one hung test fails, the others still run
        # >= 2.3: no new test starts after the session limit, so the junit XML is still written
        if "$PY" -c 'import importlib.metadata as m, sys
sys.exit(tuple(int(x) for x in m.version("pytest-timeout").split(".")[:2]) < (2, 3))' 2>/dev/null; then
            PYTEST_ARGS+=(--session-timeout=@SESSION_LIMIT@)
        fi
    fi
}

# ------------------------------------------------------------------------------------------------
note "repo $REPO  OUT $OUT  WORK $WORK  python $PY  PARTS '$PARTS'  deadline ${DEADLINE_S}s"

# 1. environment (always)
ENV_PY='
import os, platform, sys
print("python", sys.version.split()[0], platform.platform())
try:
    import torch
except Exception as exc:
    print("torch: not importable:", exc); sys.exit(3)
print("torch", torch.__version__, "cuda build", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
ok = torch.cuda.is_available()
print("torch.cuda.is_available()", ok)
if not ok:
    sys.exit(3)
n = torch.cuda.device_count()
print("cuda devices", n)
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} cc {p.major}.{p.minor} {p.total_memory / 2**30:.1f} GiB {p.multi_processor_count} SMs")
print("bf16 supported", torch.cuda.is_bf16_supported())
try:
    print("nccl", torch.cuda.nccl.version(), "distributed nccl", torch.distributed.is_nccl_available())
except Exception as exc:
    print("nccl: unknown:", exc)
for mod in ("gemmi", "mlperf_logging", "h5py", "pytest", "pytest_timeout", "scalefold"):
    try:
        __import__(mod); print(mod, "importable")
    except Exception as exc:
        print(mod, "NOT importable:", type(exc).__name__, exc)
'
note "env"
t0=$SECONDS
{ command -v nvidia-smi >/dev/null && timeout -k 5 10 nvidia-smi || echo "nvidia-smi: not found"; } 2>&1 | tee "$WORK/env.txt"
# 90 s: a cold `import torch` and CUDA's start on a fresh machine can take tens of seconds; a timeout is "slow",
# not "no CUDA": the call goes on (the headline checks CUDA itself and says so)
ENV_LIMIT=${ENV_LIMIT:-90}
timeout -k 5 "$ENV_LIMIT" "$PY" -c "$ENV_PY" 2>&1 | tee -a "$WORK/env.txt"
env_rc=${PIPESTATUS[0]}
if [ "$env_rc" = 124 ] || [ "$env_rc" = 137 ]; then
    msg="slow: the probe did not finish in ${ENV_LIMIT}s (a cold first import); going on"
    printf '%-20s %-8s rc=%-4s %4ss  | %s\n' env SLOW "$env_rc" "$((SECONDS - t0))" "$msg" >>"$SUMMARY"
    note "env: $msg"
elif [ "$env_rc" -ne 0 ] && [ "$REHEARSE" = cpu ]; then
    printf '%-20s %-8s rc=%-4s %4ss  | %s\n' env REHEARSE "$env_rc" "$((SECONDS - t0))" \
        "no CUDA: the CPU rehearsal (preset tiny, fp32, torch kernels; what needs CUDA is skipped)" >>"$SUMMARY"
elif [ "$env_rc" -ne 0 ] && [ "$DRY_RUN" != 1 ]; then
    msg="no CUDA: torch.cuda.is_available() is False (or torch is missing) for $PY -- nothing to validate here; run this on a GPU machine (REHEARSE=cpu PARTS=headline rehearses the headline here)"
    printf '%-20s %-8s rc=%-4s %4ss  | %s\n' env NO_CUDA "$env_rc" "$((SECONDS - t0))" "$msg" >>"$SUMMARY"
    pack
    echo "gpu_session: $msg" >&2
    cat "$SUMMARY"
    [ "$WORK_IS_TEMP" = 1 ] && rm -rf "$WORK"
    exit 2
else
    printf '%-20s %-8s rc=%-4s %4ss  | %s\n' env "$([ "$env_rc" = 0 ] && echo PASS || echo DRY_RUN)" "$env_rc" "$((SECONDS - t0))" \
        "$(grep -m1 '^  cuda:0' "$WORK/env.txt" | sed 's/^ *//')" >>"$SUMMARY"
fi
NGPU=$(sed -n 's/^cuda devices //p' "$WORK/env.txt" | head -n 1)
NGPU=${NGPU:-1}

# 2. install (always), never from a network index (the GPU machine reaches none): gemmi / mlperf-logging from
# carried wheels (--no-index), scalefold itself from the checkout by PYTHONPATH (no pip install). The headline
# needs neither wheel; the tests and the training runs need both.
cat >"$WORK/install.sh" <<'EOF'
set -x
# (cuEquivariance, the optional anchor of bench_anchor: installed from its carried wheels when they are there)
if ! "$PY" -c 'import gemmi, mlperf_logging' 2>/dev/null \
    || { compgen -G "$WHEELS/cuequivariance*.whl" >/dev/null && ! "$PY" -c 'import cuequivariance_torch' 2>/dev/null; }; then
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu_session_site "$WHEELS"/*.whl || echo "wheel install failed"
    else
        echo "gemmi/mlperf_logging missing and no wheels in $WHEELS (see bench/RESULTS.md, GPU validation; the headline needs neither)"
    fi
fi
"$PY" -c 'import scalefold, scalefold.train.step
print("scalefold", scalefold.__version__, "from", scalefold.__file__)'
EOF
export PY WHEELS
export PYTHONPATH="/tmp/gpu_session_site:$PYTHONPATH"  # where carried wheels go (harmless if absent)
part install always 30 bash "$WORK/install.sh"
if selected headline headline && ! "$PY" -c 'import gemmi, mlperf_logging' 2>/dev/null; then
    note "install: gemmi / mlperf_logging missing: the headline runs without them; tests and training would not"
fi

# 3. tests that exercise CUDA (all skip-on-CPU tests live in these files)
pytest_args tests_kernels
part tests_kernels tests 90 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/kernels
cat >"$WORK/probe_attention_grid.py" <<'EOF'
"""Triton attention at the template-pointwise shape (TemplatePointwiseAttention: batch [1, N, N],
4 heads, 1 query, 4 templates, c_hidden 16), forward + backward vs the PyTorch reference, bf16.
The kernels launch grid (cdiv(NQ, BLOCK_M), Z * H): Z * H = 4 N^2 exceeds CUDA's grid-y limit
(65535) from N = 128 on."""
import sys

import torch

from scalefold import kernels
from scalefold.kernels import reference

ok = True
for n in (64, 128, 256):
    torch.manual_seed(0)
    H, T, D = 4, 4, 16

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()

    q, k, v = leaf(1, n, n, H, 1, D), leaf(1, n, n, H, T, D), leaf(1, n, n, H, T, D)
    mask = torch.ones(1, 1, 1, 1, 1, T, device="cuda", dtype=torch.bfloat16)
    mask[..., -1] = 0
    head = f"N_res {n:3d} (grid y = Z*H = {n * n * H:6d})"
    try:
        o = kernels.attention(q, k, v, mask=mask, inf=1e5, backend="triton")
        got = (o, *torch.autograd.grad(o.float().square().sum(), (q, k, v)))
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        print(f"{head}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        ok = False
        continue
    ro = reference.attention(q, k, v, mask=mask, inf=1e5)
    want = (ro, *torch.autograd.grad(ro.float().square().sum(), (q, k, v)))
    with torch.no_grad():
        rel = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                  for a, b in zip(got, want))
    print(f"{head}: ran; max relative difference to the reference (o, dq, dk, dv) {rel:.2e}")
    ok = ok and rel < 3e-2
print("probe_attention_grid:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
part probe_attention_grid tests 40 "$PY" "$WORK/probe_attention_grid.py"
pytest_args tests_graphs
part tests_graphs tests 150 "$PY" -m pytest "${PYTEST_ARGS[@]}" \
    tests/compilation/test_cuda_graphs.py tests/compilation/test_graphed_step.py tests/train/test_precision_compile.py

# 3b. the headline: the MLPerf-shape training step, eager / all / triton / graphs / compile (that order), each capped
# and started only when its expected seconds fit, its row (s/step per recycling count, MFU, peak memory) out
# before its profile; the estimates on the CPUs meanwhile, never waited for past the deadline (its dry run prints
# the plan on $CARD; REHEARSE=cpu runs it on the CPU: preset tiny, fp32, torch kernels)
if [ "$REHEARSE" = cpu ]; then
    HEADLINE=(--device cpu --preset tiny --precision fp32)
else
    HEADLINE=(--preset mlperf --precision bf16)
fi
HEADLINE+=(--cycles 1 --out "$WORK/headline" --memory-snapshot "$WORK/memory" --compile-cache "$COMPILE_CACHE"
           --estimate-reuse "$ESTIMATES")
[ -n "$HEADLINE_ESTIMATE_CAP" ] && HEADLINE+=(--estimate-cap "$HEADLINE_ESTIMATE_CAP")
if [ "$DRY_RUN" = 1 ] && selected headline headline; then
    "$PY" bench/headline_plan.py --call-plan --card "$CARD" --deadline "$DEADLINE_S" "${PLAN_FLAGS[@]}"
    "$PY" bench/step_headline.py --dry-run --card "$CARD" "${HEADLINE[@]}" --deadline "$HEADLINE_DEADLINE" \
        | tee "$WORK/headline_plan.txt"
    EXPECT[headline]=$(sed -n 's/^  total expected ~\([0-9]*\) s.*/\1/p' "$WORK/headline_plan.txt" | head -n 1)
fi
# first in the headline group: the real capture at the settings that matter (the demo step with dropout and
# activation checkpointing, fp32 and bf16, and fp32 with the Parallel Evoformer's registered branch generators;
# two replays per recycling count; skipped on a CPU)
part capture_real headline 180 env SCALEFOLD_AUTOTUNE=0 "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/compilation/test_whole_step_graphs.py -k real
part headline headline 480 env SCALEFOLD_AUTOTUNE=0 "$PY" bench/step_headline.py "${HEADLINE[@]}" --deadline @PLAN_DEADLINE@

# 3c. the trainer's whole-step path (issue 46): the same short run with --cuda-graphs off and step (loader,
# evaluation and checkpoints around the replays; PyTorch kernels, as graphs-step's row), then every step's
# metrics compared within the whole step's warm-up tolerance and the graphed steps counted from the run's output
if [ "$REHEARSE" = cpu ]; then
    TRAIN_STEP=(--preset tiny --precision fp32 --max-steps 3 --eval-every 3 --checkpoint-every 3 --num-workers 1)
else
    TRAIN_STEP=(--preset demo --precision bf16 --max-steps 8 --eval-every 4 --checkpoint-every 4 --num-workers 4)
fi
TRAIN_STEP=(-m scalefold train "${TRAIN_STEP[@]}" --store "$WORK/step-store.h5" --no-progress)
part train_step_off headline 90 env SCALEFOLD_AUTOTUNE=0 SCALEFOLD_KERNELS=torch "$PY" "${TRAIN_STEP[@]}" \
    --out "$WORK/train_step_off" --cuda-graphs off
part train_step_graphs headline 120 env SCALEFOLD_AUTOTUNE=0 SCALEFOLD_KERNELS=torch "$PY" "${TRAIN_STEP[@]}" \
    --out "$WORK/train_step_graphs" --cuda-graphs step
part train_step_compare headline 30 "$PY" bench/train_step_compare.py --graphs "$WORK/train_step_graphs" \
    --off "$WORK/train_step_off" --log "$WORK/train_step_graphs.log"

# 4. short GPU training runs: bf16 eager, then bf16 with CUDA graphs (one synthetic store for both)
TRAIN=(-m scalefold train --preset demo --precision bf16 --max-steps 20 --eval-every 10
       --checkpoint-every 10 --store "$WORK/demo-store.h5" --no-progress --num-workers 4)
# (4 loader workers: with the demo's default 1 the first GPU run waited 92 ms a step for data, 19 % of it)
part train_bf16 train 90 env SCALEFOLD_AUTOTUNE=0 "$PY" "${TRAIN[@]}" --out "$WORK/train_bf16" --cuda-graphs off
part train_graphs train 60 env SCALEFOLD_AUTOTUNE=0 "$PY" "${TRAIN[@]}" --out "$WORK/train_bf16_graphs" --cuda-graphs on

# 4a. the recompute policies at MLPerf shapes (PARTS=policies; not in the default PARTS): the Triton step with
# on / the 80 GB auto choice (22 blocks) / off, each its s/step, MFU and max_memory_allocated beside the
# memory model (issue 25 part 4; `off` is predicted at 77 GiB: on an 80 GB H100 it may not fit)
for policy in on 22 off; do
    part "policy_$policy" policies 150 "$PY" bench/step_headline.py --preset mlperf --precision bf16 --cycles 1 \
        --configs triton --deadline 140 --activation-checkpointing "$policy" --out "$WORK/policy_$policy" \
        --compile-cache "$COMPILE_CACHE" --estimate-reuse "$ESTIMATES"
done

# 4b. fill the launch-config table for this GPU (PARTS=tune; not in the default PARTS): the file comes back
# in the tarball; check it with `scalefold aot-check --table FILE`, then copy it over
# scalefold/kernels/launch_configs.json
part tune_kernels tune 270 "$PY" -m scalefold tune-kernels --out "$WORK/launch_configs.json" --max-seconds 240

# 5. benchmarks (stdout is the result; each is tee'd to $WORK/<part>.log)
part bench_attention bench 55 "$PY" bench/kernels.py --kernel attention --shape mlperf --dtype bf16 --iters 50
part bench_layernorm bench 30 "$PY" bench/kernels.py --kernel layernorm --shape mlperf --dtype bf16 --iters 50
part bench_adam bench 30 "$PY" bench/kernels.py --kernel adam --shape mlperf --dtype bf16 --iters 50
part bench_trimul bench 60 "$PY" bench/kernels.py --kernel trimul --shape mlperf --dtype bf16 --iters 50
part bench_anchor bench 90 "$PY" bench/anchor_kernels.py --crop 256 --dtype bf16 --iters 50
part bench_fusions bench 120 "$PY" bench/fusions.py --iters 50
part bench_cuda_graphs bench 35 "$PY" bench/cuda_graphs.py --preset "$BENCH_CUDA_GRAPHS_PRESET" --precision bf16 --steps 3
DAP_SIZES="1"
for d in 2 4 8; do [ "${NGPU:-0}" -ge "$d" ] && DAP_SIZES="$DAP_SIZES $d"; done
# shellcheck disable=SC2086
part bench_dap bench 30 "$PY" bench/dap.py --cuda --dap $DAP_SIZES --n-res 256 --n-seq 128 --warmup 2 --iters 5

# ------------------------------------------------------------------------------------------------
if [ "$DRY_RUN" = 1 ]; then
    EXPECTED_TOTAL=$((EXPECTED_TOTAL + PACK_S))
    note "dry run on $CARD: the call expects ~${EXPECTED_TOTAL}s in all (env ~${EXPECT[env]}s, the parts, packing ~${PACK_S}s; deadline ${DEADLINE_S}s, one call's limit 600s)"
    "$PY" bench/headline_plan.py --window --call "$EXPECTED_TOTAL"
fi
printf '%-20s %-8s %4ss total (deadline %ss); detail in results.tar.gz (WORK %s)\n' \
    TOTAL "$([ "$FAILED" = 0 ] && echo PASS || echo FAIL)" "$((SECONDS - START))" "$DEADLINE_S" "$WORK" >>"$SUMMARY"
pack
check_out
note "summary ($SUMMARY)"
cat "$SUMMARY"
exit "$FAILED"
