#!/bin/bash
# Deterministic runs (single rank, DAP-2, BP-2 x DAP-2, async eval, resume) to compare two versions of the
# code bit for bit: run.sh CODE_DIR OUT_DIR for each, then python compare.py OUT_BEFORE OUT_AFTER
# (compare reads OUT_BEFORE/NAME.metrics.jsonl: copy each run's metrics.jsonl there, as the redesign did).
# Each run: tiny preset, --deterministic, fp64, 1 loader worker, eval every 2 steps.
set -u
CODE=$1; OUT=$2
PY=${PY:-python}  # the project venv's python, e.g. PY=$PWD/.venv/bin/python
mkdir -p "$OUT"; cd "$OUT"
export PYTHONPATH=$CODE OMP_NUM_THREADS=1
for v in $(env | grep -o '^\(SCALEFOLD_[A-Z_]*\|SLURM_[A-Z_]*\|RANK\|WORLD_SIZE\|LOCAL_RANK\|MASTER_ADDR\|MASTER_PORT\)='); do unset "${v%=}"; done
STORE=$OUT/store.h5
COMMON=(--preset tiny --deterministic --precision fp64 --num-workers 1 --eval-every 2 --store "$STORE" --no-progress)
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
tr() { local n=$1; shift; $PY -m torch.distributed.run --nproc-per-node "$n" --master-port "$(port)" -m scalefold train "$@"; }
run() { local name=$1; shift; echo "== $name"; "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; }
run single   $PY -m scalefold train "${COMMON[@]}" --max-steps 4 --checkpoint-every 2 --out "$OUT/single"
run dap2     tr 2 "${COMMON[@]}" --max-steps 4 --checkpoint-every 2 --dap 2 --out "$OUT/dap2"
run bp2dap2  tr 4 "${COMMON[@]}" --max-steps 4 --checkpoint-every 2 --bp 2 --dap 2 --parallel-evoformer --out "$OUT/bp2dap2"
run async    tr 2 "${COMMON[@]}" --max-steps 4 --checkpoint-every 2 --num-async-eval-ranks 1 --out "$OUT/async"
run resume_a $PY -m scalefold train "${COMMON[@]}" --max-steps 2 --checkpoint-every 2 --out "$OUT/resume"
cp "$OUT/resume/metrics.jsonl" "$OUT/resume_first.metrics.jsonl"
run resume_b $PY -m scalefold train "${COMMON[@]}" --max-steps 4 --checkpoint-every 2 --resume --out "$OUT/resume"
