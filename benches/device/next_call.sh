#!/usr/bin/env bash
# The next call of the lent 16-core machine in one command: the steps of
# benches/device/README.md's open items that fit in one call, most useful
# first, each a benches/device/run.sh run with its own log under $OUT. A
# session is lent about 15 minutes of that machine, its start included, and
# a call may run 10: give the call timeout_s 590 and carry .devbundle (built
# by benches/device/bundle.sh from the commit to measure).
#
# usage: [DEADLINE=570] [STEPS="1 2 3 4"] benches/device/next_call.sh
#   DEADLINE  seconds from the start after which no step starts; a step's
#             own limit is cut to what is left (a step with under 40 s left
#             is skipped, and says so in next_call.log)
#   STEPS     the steps to run, in this order (default: 1 2 3 4; steps 5
#             and 6 take a call of their own: STEPS=5, STEPS=6; step 7 fits
#             beside 3 or 4: STEPS="7 3")
# Steps (the README's items; times at 8 workers x 1 GiB on that machine):
#   1  double_diff and anom_mean, lists pinned (PCP=100000), one round  (item 1, 5)
#   2  double_diff alone, lists not pinned, one round                   (item 1)
#   3  bench_chain: the cost of one hand-over, stock beside it           (item 1, 5)
#   4  quadratic_mean and monthly_map_reduce, lists pinned, one round   (item 6)
#   5  matmul with x 8 GiB on 8 x 8 GiB, lists pinned (x 2 GiB took 31 s
#      in stock, this has 8x the flops: a call of its own)                (item 2)
#   6  arrays born shared (huge-page root): climatic_mean, double_diff and
#      rechunk_p2p, lists pinned, one round (a call of its own)           (item 7)
#   7  the P2P join, set_index, vorticity, dataframe_align, lists pinned,
#      one round                                                        (item 8)
#   8  bag_groupby (lists of dicts, sent from the frames serialized once)
#      at the dev box's size, SCALE=0.125, lists pinned, one round
#      (item 9; fits beside 3 or 4: STEPS="8 3")
# RUN_LIMIT (runs take 10-30 s at 8 x 1 GiB) fails a run that stalls, as a
# stock set_index_p2p run did on the dev box, so the step goes on without it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/device-out}"
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE="${DEADLINE:-570}"
STEPS="${STEPS:-1 2 3 4}"
LOG="$OUT/next_call.log"

# step NAME LIMIT [VAR=value...] [BENCH_FILE]: one run.sh run within the deadline
step() {
    local name="$1" limit="$2" left
    shift 2
    left=$((DEADLINE - ($(date +%s) - START)))
    if ((left < 40)); then
        echo "== $(date -u +%T) $name skipped: ${left}s left of the call" | tee -a "$LOG"
        return
    fi
    ((limit > left - 10)) && limit=$((left - 10))
    echo "== $(date -u +%T) $name (limit ${limit}s): $*" | tee -a "$LOG"
    local vars=() args=()
    for a in "$@"; do
        if [[ "$a" == *=* ]]; then vars+=("$a"); else args+=("$a"); fi
    done
    env NAME="$name" LIMIT="$limit" OUT="$OUT" "${vars[@]}" benches/device/run.sh "${args[@]}" \
        >/dev/null 2>&1
    echo "== $(date -u +%T) $name done:" \
        "$(grep -o 'pytest exit status [0-9]*' "$OUT/$name.log" 2>/dev/null || echo 'cut off')" \
        | tee -a "$LOG"
}

for s in $STEPS; do
    case "$s" in
        1) step w8-pinned 200 W=8 MEM="1 GiB" ROUNDS=1 PCP=100000 RUN_LIMIT=120 K="double_diff or anom_mean" ;;
        2) step w8-unpinned 110 W=8 MEM="1 GiB" ROUNDS=1 RUN_LIMIT=100 K="double_diff" ;;
        3) step handover 80 K=handover benches/bench_chain.py ;;
        4) step w8-xarray 150 W=8 MEM="1 GiB" ROUNDS=1 PCP=100000 RUN_LIMIT=120 K="quadratic_mean or monthly_map_reduce" ;;
        5) step w8-matmul-8g 560 W=8 MEM="8 GiB" SCALE=2 ROUNDS=1 PCP=100000 K="matmul" ;;
        6) step w8-born 560 W=8 MEM="1 GiB" ROUNDS=1 PCP=100000 HUGE=1 RUN_LIMIT=120 \
            K="climatic_mean or double_diff or rechunk_p2p" ;;
        7) step w8-added 300 W=8 MEM="1 GiB" ROUNDS=1 PCP=100000 RUN_LIMIT=90 \
            K="merge_p2p or set_index_p2p or vorticity or dataframe_align" ;;
        8) step w8-bag 200 W=8 MEM="1 GiB" SCALE=0.125 ROUNDS=1 PCP=100000 RUN_LIMIT=120 \
            K="bag_groupby" ;;
        *) echo "unknown step $s" | tee -a "$LOG" ;;
    esac
done
echo "== $(date -u +%T) all steps done in $(($(date +%s) - START)) s" | tee -a "$LOG"
