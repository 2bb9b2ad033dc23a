#!/usr/bin/env bash
# One bench run on the lent 16-core machine, from the repository root there
# (the device tool runs commands there, with .devbundle carried: see
# benches/device/bundle.sh). Installs the bundle into /tmp/site, runs one
# bench file with one BLAS/OpenMP thread per worker, and writes its output
# to $OUT/<NAME>.log as it goes (so it comes back even if the call is cut
# off), with the machine's state before and after.
#
# usage: [W=8] [MEM="4 GiB"] [ROUNDS=2] [SCALE=1] [K=expr] [PCP=100000] [HUGE=1]
#        [KEYS=100000] [LIMIT=540] [RUN_LIMIT=120] [NAME=run] benches/device/run.sh [BENCH_FILE]
#   BENCH_FILE  default benches/bench_workloads.py
#   W, MEM, ROUNDS, SCALE  bench_workloads' DASK_SHM_BENCH_* settings
#   K           pytest -k expression (e.g. "double_diff or matmul")
#   PCP         vm.percpu_pagelist_high_fraction for the run (the bench restores it)
#   HUGE=1      shared-memory root on a fresh tmpfs mounted huge=within_size
#               (arrays born shared turn on), unmounted at the end
#   KEYS        bench_scale's DASK_SHM_BENCH_KEYS
#   LIMIT       seconds before the bench is stopped (keep under the call's timeout_s)
#   RUN_LIMIT   bench_workloads' DASK_SHM_BENCH_RUN_TIMEOUT: seconds after which
#               one run is failed and the bench goes on with the next
set -uo pipefail
cd "$(dirname "$0")/../.."
BENCH="${1:-benches/bench_workloads.py}"
OUT="${OUT:-/tmp/device-out}"
NAME="${NAME:-run}"
LOG="$OUT/$NAME.log"
mkdir -p "$OUT"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .devbundle/whl/*.whl >"$OUT/$NAME.pip.log" 2>&1 \
    || { echo "installing .devbundle failed:"; cat "$OUT/$NAME.pip.log"; exit 1; }
export PYTHONPATH=/tmp/site
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
export DASK_SHM_BENCH_WORKERS="${W:-8}" DASK_SHM_BENCH_WORKER_MEMORY="${MEM:-4 GiB}"
export DASK_SHM_BENCH_ROUNDS="${ROUNDS:-2}" DASK_SHM_BENCH_SCALE="${SCALE:-1}"
[[ -n "${PCP:-}" ]] && export DASK_SHM_BENCH_PCP_HIGH_FRACTION="$PCP"
[[ -n "${KEYS:-}" ]] && export DASK_SHM_BENCH_KEYS="$KEYS"
[[ -n "${RUN_LIMIT:-}" ]] && export DASK_SHM_BENCH_RUN_TIMEOUT="$RUN_LIMIT"

HUGE_ROOT=""
if [[ "${HUGE:-0}" == 1 ]]; then
    HUGE_ROOT="$(mktemp -d /tmp/dask-shm-huge.XXXXXX)"
    mount -t tmpfs -o "size=${HUGE_SIZE:-64g},huge=within_size,mode=1777" tmpfs "$HUGE_ROOT" \
        || { echo "cannot mount a huge-page tmpfs"; exit 1; }
    export DASK_SHM__SHARED_MEMORY__ROOT="$HUGE_ROOT"
fi
cleanup() { [[ -n "$HUGE_ROOT" ]] && umount -l "$HUGE_ROOT"; }
trap cleanup EXIT

{
    echo "== $(date -u +%FT%TZ) $NAME: $BENCH W=$DASK_SHM_BENCH_WORKERS MEM=$DASK_SHM_BENCH_WORKER_MEMORY" \
        "ROUNDS=$DASK_SHM_BENCH_ROUNDS SCALE=$DASK_SHM_BENCH_SCALE K=${K:-} PCP=${PCP:-} HUGE=${HUGE:-0}" \
        "KEYS=${KEYS:-} wheel built at $(cat .devbundle/commit 2>/dev/null || echo '?')"
    echo "== machine: $(nproc --all) CPUs, $(uname -r), $(python3 --version)"
    grep -E "^(MemTotal|MemAvailable|Shmem):" /proc/meminfo
    uptime
    python3 -c "import dask, distributed, dask_shm; print('dask', dask.__version__, 'distributed', distributed.__version__, 'dask_shm', dask_shm.__file__)"
    ARGS=(-s -p no:cacheprovider --timeout=0 --benchmark-columns=min,median,max)
    [[ -n "${K:-}" ]] && ARGS+=(-k "$K")
    timeout --kill-after=10 "${LIMIT:-540}" python3 -m pytest "$BENCH" "${ARGS[@]}"
    echo "== pytest exit status $? at $(date -u +%FT%TZ)"
    uptime
} 2>&1 | tee "$LOG"
