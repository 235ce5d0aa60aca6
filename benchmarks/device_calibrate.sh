#!/usr/bin/env bash
# The GPU's calibration in one device call (<= 10 min): the full calibration (its slim table to
# dispatch/heuristics/tables/<gpu>.json, its raw points to benchmarks/results/calibrate_points-<gpu>.json), the
# choice tables, the log with the self-check, then the held-out evaluation (models outside the
# calibration's sizes); every file also lands under $OUT with the same relative path.
#   bash benchmarks/device_calibrate.sh
# CAL_BUDGET: default the calibrator's own (a full run in one call). EVAL_BUDGET: default 0, no evaluation
# (its 90 calls take ~150 s, more than a full run leaves of a call: run it in the next call). CAL_ARGS adds
# calibrate arguments (e.g. "--resume"). TAG names a run's files (calibrate_full-<date><TAG>.log). The
# compile caches start empty, as on a newcomer's machine, even where an earlier call left them. CAL_LIMIT
# (default 580 s) stops the calibrator so its checkpoint still comes back in a 600 s call.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
CAL_BUDGET=${CAL_BUDGET:-}
EVAL_BUDGET=${EVAL_BUDGET:-0}
TAG=${TAG:-}
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
# a user table left on the machine must not answer for the new one
export DISPATCH_HEURISTICS_DIR="$OUT/user-tables"
R=benchmarks/results
mkdir -p "$OUT/$R" "$OUT/heuristics/tables" "$DISPATCH_HEURISTICS_DIR" "$R"
GPU=$(python3 -c "import torch; from dispatch import heuristics; print(heuristics.device_info(torch.device('cuda', 0))['slug'])")
DATE=$(date +%F)$TAG
RAW=$R/calibrate_points-$GPU$TAG.json
SLIM=dispatch/heuristics/tables/$GPU.json
start=$SECONDS

# shellcheck disable=SC2086  (CAL_ARGS is a list of arguments)
timeout "${CAL_LIMIT:-580}" python3 -m dispatch.calibrate ${CAL_BUDGET:+--budget "$CAL_BUDGET"} --out "$RAW" --slim-out "$SLIM" ${CAL_ARGS:-} \
  >"$R/calibrate_full-$DATE.log" 2>"$R/calibrate_full-$DATE.err"
echo "calibrate rc=$? in $((SECONDS - start)) s"
python3 -m dispatch.table --gpu "$SLIM" >"$R/choice_tables-$DATE.txt" 2>&1
if [ "$EVAL_BUDGET" != 0 ]; then
  python3 benchmarks/bench_heldout.py --table "$SLIM" --budget "$EVAL_BUDGET" --out "$R/heldout-$DATE.json" \
    >"$R/heldout-$DATE.log" 2>"$R/heldout-$DATE.err"
  echo "evaluate rc=$? at $((SECONDS - start)) s"
fi

for f in "$RAW" "$SLIM" "$R/calibrate_full-$DATE.log" "$R/calibrate_full-$DATE.err" "$R/choice_tables-$DATE.txt" \
  "$R/heldout-$DATE.json" "$R/heldout-$DATE.log" "$R/heldout-$DATE.err"; do
  [ -f "$f" ] && cp "$f" "$OUT/$f"
done
grep -A1 "^self-check on" "$R/calibrate_full-$DATE.log"
tail -n 3 "$R/calibrate_full-$DATE.log"
[ -f "$R/heldout-$DATE.log" ] && cat "$R/heldout-$DATE.log"
