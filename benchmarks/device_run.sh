#!/usr/bin/env bash
# One device call = several stages, each with its own time limit and log; the results come back as one
# tarball in $OUT. Usage (on the device): bash benchmarks/device_run.sh STAGE[:SECONDS] ...
#   env                       GPU clocks and power, versions, python -m dispatch.info
#   gputests                  pytest -m gpu over ${GPU_TESTS:-tests} (-k "$GPU_K" if set)
#   cputests                  the whole suite, stop at the first failure
#   pytest                    pytest $PYTEST_ARGS (re-parsed by a shell: quoted -k expressions survive)
#   parity                    python -m dispatch.parity --quick
#   bench_bias_act_dropout, bench_fused_linear, bench_dispatch_overhead, bench_e2e, bench_mlp,
#   bench_e2e_llama           benchmarks/<stage>.py --out $R $BENCH_ARGS (e.g. BENCH_ARGS="--quick")
#   benchmarks                the four benchmarks with --quick, one after another
#   calibrate                 the full calibration, budget = the stage's limit - 60 s
#   calibrate_quick           python -m dispatch.calibrate --quick
#   calibrate_resume          extends $RESUME_FROM's table
#   refresh                   measures the families selected by $REFRESH again into the shipped table
#   table                     the choice tables of the table calibrate wrote
#   heldout                   python benchmarks/bench_heldout.py on the shipped table, budget = limit - 90 s
# Stages run in the order given; a stage's limit defaults to 300 s.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
R="$OUT/results"
mkdir -p "$R/tables"
# calibrate writes its table here and later stages use it (a folder of its own: the loader reads every
# .json in it, and the other results are not tables)
export DISPATCH_HEURISTICS_DIR="${DISPATCH_HEURISTICS_DIR:-$R/tables}"
TABLE="$DISPATCH_HEURISTICS_DIR/nvidia-h200.json"
summary=()

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$R/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - start))s")
  tail -n "${TAILN:-12}" "$R/$name.log"
}

for arg in "$@"; do
  name=${arg%%:*}
  limit=${arg#*:}
  [ "$limit" = "$arg" ] && limit=300
  case $name in
    env) stage env "$limit" bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; python3 -m dispatch.info' ;;
    gputests) stage gputests "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider --durations=10 ${GPU_K:+-k "$GPU_K"} ${GPU_TESTS:-tests} ;;
    cputests) stage cputests "$limit" python3 -m pytest -q -p no:cacheprovider -x tests ;;
    pytest) stage pytest "$limit" bash -c "python3 -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ARGS:?}" ;;
    parity) stage parity "$limit" python3 -m dispatch.parity --quick ;;
    bench_bias_act_dropout | bench_fused_linear | bench_dispatch_overhead | bench_e2e | bench_mlp | bench_e2e_llama)
      # shellcheck disable=SC2086  (BENCH_ARGS is a list of arguments)
      stage "$name" "$limit" python3 "benchmarks/$name.py" --out "$R" ${BENCH_ARGS:-} ;;
    benchmarks) stage benchmarks "$limit" bash -c "for b in bias_act_dropout fused_linear dispatch_overhead e2e; do python3 benchmarks/bench_\$b.py --quick --out '$R' || echo \"bench_\$b failed: \$?\"; done" ;;
    calibrate) stage calibrate "$limit" python3 -m dispatch.calibrate --budget $((limit - 60)) --out "$TABLE" ;;
    calibrate_quick) stage calibrate_quick "$limit" python3 -m dispatch.calibrate --quick --out "$TABLE" ;;
    calibrate_resume) cp "${RESUME_FROM:?}" "$TABLE"; stage calibrate_resume "$limit" python3 -m dispatch.calibrate --resume --budget $((limit - 60)) --out "$TABLE" ;;
    # REFRESH holds the selecting arguments, e.g. "--ops bias_act_dropout --modes training"
    refresh)
      [ -f "$TABLE" ] || cp heuristics/tables/nvidia-h200.json "$TABLE"
      # shellcheck disable=SC2086
      stage refresh "$limit" python3 -m dispatch.calibrate --refresh ${REFRESH:?} --budget $((limit - 45)) --out "$TABLE" ;;
    table) stage table "$limit" python3 -m dispatch.table --gpu "$TABLE" ;;
    heldout) stage heldout "$limit" python3 benchmarks/bench_heldout.py --table heuristics/tables/nvidia-h200.json \
      --budget $((limit - 90)) --out "$R/heldout.json" ;;
    *) echo "unknown stage $name" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
printf '%s\n' "${summary[@]}"
