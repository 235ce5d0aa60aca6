#!/usr/bin/env bash
# One device call = several stages, each with its own time limit and log (<stage>.stage.log); the results
# come back as one tarball in $OUT (results.tgz), beside the calibration's two tables. Usage (on the device):
#   bash benchmarks/device_run.sh STAGE[:SECONDS] ...        (benchmarks/device_session.md: the calls)
#   install                   pip install -e . (no deps, no index), then the wheels in .whl/ (Liger's) into
#                             ${SITE:-/tmp/site}, put on PYTHONPATH for the later stages
#   env                       GPU clocks and power, versions, python -m dispatch.info
#   gputests                  pytest -m gpu -n ${GPU_N:-8} over ${GPU_TESTS:-tests} (-k "$GPU_K" if set;
#                             GPU_N=0: one process), each test stopped after ${GPU_TIMEOUT:-60} s
#   cputests                  the whole suite, stop at the first failure
#   pytest                    pytest $PYTEST_ARGS (re-parsed by a shell: quoted -k expressions survive)
#   parity                    python -m dispatch.parity --quick
#   bench_bias_act_dropout, bench_fused_linear, bench_dispatch_overhead, bench_e2e, bench_mlp,
#   bench_e2e_llama, bench_judge, bench_add_norm, sweep_add_norm, bench_module_host, profile_mlp,
#   sweep_mlp_passes, probe_epilogue_mlp
#                             benchmarks/<stage>.py --out $R, then $ARGS_<stage> or else $BENCH_ARGS
#   benchmarks                the four benchmarks with --quick, one after another
#   calfull                   the full calibration into calibrate_points-<gpu>$CAL_TAG.json (raw points) and
#                             dispatch/heuristics/tables/<gpu>.json (slim: later stages of the call use it), budget =
#                             the stage's limit - 40 s; fresh, or with CAL_RESUME=1 extending the raw file the
#                             working tree carries at benchmarks/results/ (copied there from an earlier call's
#                             $OUT), or with CAL_REFRESH=1 measuring CAL_ARGS's families again into it (the
#                             rest kept); both tables also to $OUT, the choice tables to the tarball; CAL_ARGS adds
#                             arguments (e.g. "--quick" for a CPU check)
#   calibrate                 the full calibration into $R/tables, budget = the stage's limit - 60 s
#   calibrate_quick           python -m dispatch.calibrate --quick
#   calibrate_resume          extends $RESUME_FROM's table
#   refresh                   measures the families selected by $REFRESH again into the shipped table
#   table                     the choice tables of the table calibrate wrote
#   heldout                   python benchmarks/bench_heldout.py on the shipped table, budget = limit - 90 s
# Stages run in the order given; a stage's limit defaults to 300 s and is cut to what is left of CALL_S
# (default 585 s: a stage that would start with under 30 s left is skipped), so the tarball always comes
# back from a 600 s call. Last: each target line the logs hold (PASS / MISS), one line a stage (rc, seconds).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
R="$OUT/results"
mkdir -p "$R/tables"
# calibrate writes its table here and later stages use it (a folder of its own: the loader reads every
# .json in it, and the other results are not tables)
export DISPATCH_HEURISTICS_DIR="${DISPATCH_HEURISTICS_DIR:-$R/tables}"
SLUG=$(python3 -c "import torch; from dispatch import heuristics as h
print(h.device_info(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))['slug'])" 2>/dev/null)
TABLE="$DISPATCH_HEURISTICS_DIR/$SLUG.json"
CALL_S=${CALL_S:-585}
summary=()

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$R/$name.stage.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - start))s")
  tail -n "${TAILN:-12}" "$R/$name.stage.log"
  return $rc
}

calfull() {  # calfull SECONDS: the full calibration, fresh or (CAL_RESUME=1) extending the carried raw points
  local gpu raw slim
  gpu=$(python3 -c "import torch; from dispatch import heuristics as h
print(h.device_info(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))['slug'])")
  raw=benchmarks/results/calibrate_points-$gpu${CAL_TAG:-}.json
  slim=dispatch/heuristics/tables/$gpu.json
  if [ "${CAL_REFRESH:-0}" = 1 ]; then  # the selected families (CAL_ARGS) measured again, the rest kept
    :
  elif [ "${CAL_RESUME:-0}" = 1 ]; then
    if [ ! -f "$raw" ]; then
      echo "CAL_RESUME=1: no $raw here (copy it from the last call's \$OUT)"
      summary+=("calfull: no $raw to resume")
      return 1
    fi
  else
    rm -f "$raw"  # a run over an existing table keeps its entries, and --resume would count them as done
  fi
  # shellcheck disable=SC2046,SC2086  (--resume or nothing; CAL_ARGS a list of arguments)
  stage calfull "$1" python3 -m dispatch.calibrate --budget $(($1 > 80 ? $1 - 40 : 40)) --out "$raw" \
    --slim-out "$slim" $([ "${CAL_RESUME:-0}" = 1 ] && echo --resume) \
    $([ "${CAL_REFRESH:-0}" = 1 ] && echo --refresh) ${CAL_ARGS:-}
  cp "$raw" "$slim" "$OUT/" 2>/dev/null
  python3 -m dispatch.table --gpu "$slim" >"$R/choice_tables.txt" 2>&1
  grep -A1 "^self-check on" "$R/calfull.stage.log"
}

for arg in "$@"; do
  name=${arg%%:*}
  limit=${arg#*:}
  [ "$limit" = "$arg" ] && limit=300
  left=$((CALL_S - SECONDS - 10))  # 10 s for the tarball
  if [ "$left" -lt 30 ]; then
    echo "=== $name skipped: ${left}s left of CALL_S=$CALL_S"
    summary+=("$name skipped (${left}s left)")
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  case $name in
    install)
      stage install "$limit" python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
      if compgen -G ".whl/*.whl" >/dev/null; then
        stage wheels "$limit" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --upgrade --target "${SITE:-/tmp/site}" .whl/*.whl && export PYTHONPATH="${SITE:-/tmp/site}:$PYTHONPATH"
      fi ;;
    env) stage env "$limit" bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; python3 -c "import liger_kernel, importlib.metadata as m; print(\"liger_kernel\", m.version(\"liger-kernel\"))"; python3 -m dispatch.info' ;;
    gputests)
      n=${GPU_N:-8}
      [ "$n" = 0 ] && n=
      # -v: a log cut by the stage's limit names every test that finished (the straggler is the one missing)
      stage gputests "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider --durations=25 -rfE \
        --timeout "${GPU_TIMEOUT:-60}" ${n:+-n "$n"} ${GPU_K:+-k "$GPU_K"} ${GPU_TESTS:-tests} ;;
    cputests) stage cputests "$limit" python3 -m pytest -q -p no:cacheprovider -x tests ;;
    pytest) stage pytest "$limit" bash -c "python3 -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ARGS:?}" ;;
    parity) stage parity "$limit" python3 -m dispatch.parity --quick ;;
    bench_bias_act_dropout | bench_fused_linear | bench_dispatch_overhead | bench_e2e | bench_mlp | bench_e2e_llama | \
      bench_judge | bench_add_norm | sweep_add_norm | bench_module_host | profile_mlp | sweep_mlp_passes | \
      probe_epilogue_mlp)
      own="ARGS_$name"
      # shellcheck disable=SC2086  (a list of arguments)
      stage "$name" "$limit" python3 "benchmarks/$name.py" --out "$R" ${!own:-${BENCH_ARGS:-}} ;;
    benchmarks) stage benchmarks "$limit" bash -c "for b in bias_act_dropout fused_linear dispatch_overhead e2e; do python3 benchmarks/bench_\$b.py --quick --out '$R' || echo \"bench_\$b failed: \$?\"; done" ;;
    calfull) calfull "$limit" ;;
    calibrate) stage calibrate "$limit" python3 -m dispatch.calibrate --budget $((limit - 60)) --out "$TABLE" ;;
    calibrate_quick) stage calibrate_quick "$limit" python3 -m dispatch.calibrate --quick --out "$TABLE" ;;
    calibrate_resume) cp "${RESUME_FROM:?}" "$TABLE"; stage calibrate_resume "$limit" python3 -m dispatch.calibrate --resume --budget $((limit - 60)) --out "$TABLE" ;;
    # REFRESH holds the selecting arguments, e.g. "--ops bias_act_dropout --modes training"
    refresh)
      [ -f "$TABLE" ] || cp "dispatch/heuristics/tables/$SLUG.json" "$TABLE"
      # shellcheck disable=SC2086
      stage refresh "$limit" python3 -m dispatch.calibrate --refresh ${REFRESH:?} --budget $((limit - 45)) --out "$TABLE" ;;
    table) stage table "$limit" python3 -m dispatch.table --gpu "$TABLE" ;;
    heldout) stage heldout "$limit" python3 benchmarks/bench_heldout.py --table "dispatch/heuristics/tables/$SLUG.json" \
      --budget $((limit > 120 ? limit - 90 : 30)) --out "$R/heldout.json" ;;
    *) echo "unknown stage $name" ;;
  esac
done
echo "=== targets"
grep -h -E "(PASS|MISS)$" "$R"/*.stage.log 2>/dev/null | sed -E 's/  +/  /g' | cut -c1-160
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
printf '%s\n' "${summary[@]}"
