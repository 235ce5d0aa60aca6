#!/usr/bin/env bash
# One device call = several stages, each with its own time limit and log; results come back as one
# tarball in $OUT. Usage (on the device): bash benchmarks/device_run.sh STAGE[:SECONDS] ...
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
R="$OUT/results"
mkdir -p "$R/tables"
# calibrate writes its table here and later stages use it (a folder of its own: the loader reads every
# .json in it, and the other results are not tables)
export DISPATCH_HEURISTICS_DIR="${DISPATCH_HEURISTICS_DIR:-$R/tables}"
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
    tests_graph) stage tests_graph "$limit" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_nn.py::test_cuda_graph_replays_draw_new_masks tests/test_rng.py ;;
    probe_decode) stage probe_decode "$limit" python3 benchmarks/probes/probe_decode_dropout.py ;;
    probe_hot) stage probe_hot "$limit" python3 benchmarks/probes/probe_hot_path.py ;;
    probe_generator) stage probe_generator "$limit" python3 benchmarks/probes/probe_generator_calls.py ;;
    probe_linear_host) stage probe_linear_host "$limit" python3 benchmarks/probes/probe_linear_host.py ;;
    probe_fp16_rows) stage probe_fp16_rows "$limit" python3 benchmarks/probes/probe_fp16_rows.py ;;
    probe_sync) stage probe_sync "$limit" python3 benchmarks/probes/probe_rng_sync.py ;;
    probe_cold) stage probe_cold "$limit" python3 benchmarks/probes/probe_overhead_cold.py --devices "${COLD_DEVICES:-cuda}" ;;
    probe_dropout_overhead) stage probe_dropout_overhead "$limit" python3 benchmarks/probes/probe_dropout_overhead.py ;;
    probe_wrapper_floor) stage probe_wrapper_floor "$limit" python3 benchmarks/probes/probe_wrapper_floor.py ;;
    probe_mlp_host) stage probe_mlp_host "$limit" python3 benchmarks/probes/probe_mlp_host.py ;;
    probe_host) stage probe_host "$limit" python3 benchmarks/probes/probe_host_overhead.py ;;
    env) stage env "$limit" bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; python3 -m dispatch.info' ;;
    gputests) stage gputests "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider --durations=10 ${GPU_K:+-k "$GPU_K"} ${GPU_TESTS:-tests} ;;
    gputests2) stage gputests2 "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider --durations=10 ${GPU_K2:+-k "$GPU_K2"} ${GPU_TESTS2:-tests} ;;
    tests_act) stage tests_act "$limit" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_triton_fused_linear.py tests/test_triton_bias_act_dropout.py -k "epilogue_split or gelu_tanh or silu" ;;
    # PYTEST_ARGS is parsed by a shell again, so quoted -k expressions survive ("-k 'a or b'")
    pytest) stage pytest "$limit" bash -c "python3 -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ARGS:?}" ;;
    cputests) stage cputests "$limit" python3 -m pytest -q -p no:cacheprovider -x tests ;;
    tests_b) stage tests_b "$limit" python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/test_triton_bias_act_dropout.py tests/test_rng.py tests/test_compiled_backends.py tests/test_compile.py tests/test_nn.py tests/test_dispatch.py tests/test_patch.py tests/test_parity_cli.py tests/test_heuristics.py tests/test_fuzz.py tests/test_triton_fused_linear.py tests/test_fused_linear.py ;;
    tests_v) stage tests_v "$limit" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_compiled_backends.py::test_compiled_dropout_masks_gpu tests/test_compiled_backends.py::test_nvfuser_and_inductor_float32_refuse_dropout_on_cuda_gpu tests/test_bias_act_dropout.py tests/test_compile.py tests/test_rng.py::test_draw_for_forms_and_seeding tests/test_nn.py::test_cuda_graph_replays_draw_new_masks tests/test_triton_bias_act_dropout.py -m "gpu or not gpu" -k "gpu or compile or draw_for or rows_kernel or host_rng" ;;
    tests_1) stage tests_1 "$limit" python3 -m pytest -v -p no:cacheprovider -rfE --durations=20 tests/test_bad_input.py tests/test_bias_act_dropout.py tests/test_calibrate.py tests/test_compile.py tests/test_dispatch.py tests/test_heuristics.py tests/test_parity_cli.py ;;
    tests_2) stage tests_2 "$limit" python3 -m pytest -v -p no:cacheprovider -rfE --durations=20 tests/test_compiled_backends.py tests/test_fused_linear.py tests/test_fuzz.py tests/test_nn.py tests/test_patch.py tests/test_rng.py tests/test_triton_bias_act_dropout.py tests/test_triton_fused_linear.py tests/test_triton_launch.py ;;
    gpu_parallel)  # the gpu-marked suite in three pytest processes side by side, plus the parity CLI
      start=$SECONDS; echo "=== gpu_parallel (limit ${limit}s)"
      timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=5 tests/test_fused_linear.py >"$R/gpu_a.log" 2>&1 &
      timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=5 tests/test_bias_act_dropout.py tests/test_compiled_backends.py >"$R/gpu_b.log" 2>&1 &
      timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=5 tests/test_triton_bias_act_dropout.py tests/test_triton_fused_linear.py tests/test_nn.py tests/test_patch.py tests/test_bad_input.py tests/test_calibrate.py tests/test_parity_cli.py tests/test_dispatch.py tests/test_rng.py tests/test_compile.py >"$R/gpu_c.log" 2>&1 &
      timeout "$limit" python3 -m dispatch.parity --quick >"$R/parity.log" 2>&1 &
      wait
      summary+=("gpu_parallel $((SECONDS - start))s")
      for f in gpu_a gpu_b gpu_c parity; do echo "--- $f"; tail -n "${TAILN:-12}" "$R/$f.log"; done ;;
    alltests) stage alltests "$limit" python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests ;;
    fwd_variants) stage fwd_variants "$limit" python3 benchmarks/probes/fwd_variants.py ;;
    dropout_first_call) stage dropout_first_call "$limit" python3 benchmarks/probes/probe_compiled_dropout_first_call.py --repeats 2 --jobs 8 ;;
    dropout_pytest) stage dropout_pytest "$limit" python3 benchmarks/probes/probe_compiled_dropout_first_call.py --pytest --repeats ${REPEATS:-1} --jobs 8 ;;
    dropout_seed) stage dropout_seed "$limit" bash -c 'for seed in 1110409946 1939550148; do python3 benchmarks/probes/probe_compiled_dropout_first_call.py --worker eager float32 0 0 --seed $seed; done' ;;
    nvfuser_probe) stage nvfuser_probe "$limit" python3 benchmarks/probes/probe_nvfuser_dropout.py ;;
    bench_overhead_quick) stage bench_overhead_quick "$limit" env DISPATCH_HEURISTICS_DIR="$(mktemp -d)" python3 benchmarks/bench_dispatch_overhead.py --quick --out "$R" ;;
    bench_bad) stage bench_bad "$limit" python3 benchmarks/bench_bias_act_dropout.py --out "$R" ;;
    bench_bad_quick) stage bench_bad_quick "$limit" python3 benchmarks/bench_bias_act_dropout.py --quick --out "$R" ;;
    bench_linear) stage bench_linear "$limit" python3 benchmarks/bench_fused_linear.py --out "$R" ;;
    bench_linear_variants) stage bench_linear_variants "$limit" python3 benchmarks/bench_fused_linear.py --quick --variants --out "$R" ;;
    bench_linear_quick) stage bench_linear_quick "$limit" python3 benchmarks/bench_fused_linear.py --quick ${BENCH_LINEAR_ARGS:-} --out "$R" ;;
    sweep_epilogue) stage sweep_epilogue "$limit" python3 benchmarks/probes/sweep_fused_linear.py --set epilogue --acts gelu_tanh,gelu,relu --out "$R" ;;
    # bench_e2e at another batch size (bench_e2e_batch16: 16 sequences), E2E_STEPS steps of E2E_CONFIGS
    bench_e2e_batch*)
      b=${name#bench_e2e_batch}; mkdir -p "$R/e2e_batch$b"
      stage "$name" "$limit" python3 benchmarks/bench_e2e.py --batch "$b" --steps "${E2E_STEPS:-60}" --configs "${E2E_CONFIGS:-eager,patched}" --out "$R/e2e_batch$b" ;;
    sweep_linear) stage sweep_linear "$limit" python3 benchmarks/probes/sweep_fused_linear.py --out "$R" ;;
    bench_overhead) stage bench_overhead "$limit" python3 benchmarks/bench_dispatch_overhead.py --out "$R" ;;
    e2e_profile) stage e2e_profile "$limit" python3 benchmarks/probes/probe_e2e_profile.py ;;
    e2e_profile_compile) stage e2e_profile_compile "$limit" python3 benchmarks/probes/probe_e2e_profile.py --configs compile,compile+patched ;;
    bench_e2e) stage bench_e2e "$limit" python3 benchmarks/bench_e2e.py ${E2E_CONFIGS:+--configs "$E2E_CONFIGS"} ${E2E_ARGS:-} --out "$R" ;;
    bench_overhead2) stage bench_overhead2 "$limit" python3 benchmarks/bench_dispatch_overhead.py --out "$R/overhead2" ;;
    # every fused op forced onto triton: under compile the ops are then opaque triton kernels, not the
    # plain math that inductor fuses (issue 7: does a triton c_fc beat inductor's own under compile?)
    bench_e2e_triton) mkdir -p "$R/e2e_triton"; stage bench_e2e_triton "$limit" python3 benchmarks/bench_e2e.py --backend triton --configs "${E2E_CONFIGS:-compile,compile+patched}" --out "$R/e2e_triton" ;;
    # issue 7's experiment: c_proj's bias in the dropout's pass (dispatch.patch(bias_in_linear=False),
    # the default until session 8)
    bench_e2e_biasdrop) mkdir -p "$R/e2e_biasdrop"; stage bench_e2e_biasdrop "$limit" python3 benchmarks/bench_e2e.py --bias-in-dropout --configs "${E2E_CONFIGS:-patched,compile,compile+patched}" --out "$R/e2e_biasdrop" ;;
    bench_e2e_nolindrop) mkdir -p "$R/e2e_nolindrop"; stage bench_e2e_nolindrop "$limit" python3 benchmarks/bench_e2e.py --no-linear-dropout --configs "${E2E_CONFIGS:-patched,compile,compile+patched}" --out "$R/e2e_nolindrop" ;;
    bench_e2e_quick) stage bench_e2e_quick "$limit" python3 benchmarks/bench_e2e.py --quick --out "$R" ;;
    parity) stage parity "$limit" python3 -m dispatch.parity --quick ;;
    calibrate) stage calibrate "$limit" python3 -m dispatch.calibrate --budget $((limit - 60)) --out "$DISPATCH_HEURISTICS_DIR/nvidia-h200.json" ;;
    calibrate_resume) cp "${RESUME_FROM:?}" "$DISPATCH_HEURISTICS_DIR/nvidia-h200.json"; stage calibrate_resume "$limit" python3 -m dispatch.calibrate --resume --budget $((limit - 60)) --out "$DISPATCH_HEURISTICS_DIR/nvidia-h200.json" ;;
    # measure some families again into the shipped table (first use copies it): REFRESH1 / REFRESH2
    # hold the selecting arguments, e.g. "--ops bias_act_dropout --modes training"
    refresh1 | refresh2)
      table="$DISPATCH_HEURISTICS_DIR/nvidia-h200.json"
      [ -f "$table" ] || cp heuristics/tables/nvidia-h200.json "$table"
      if [ "$name" = refresh1 ]; then sel=${REFRESH1:?}; else sel=${REFRESH2:?}; fi
      stage "$name" "$limit" python3 -m dispatch.calibrate --refresh $sel --budget $((limit - 45)) --out "$table" ;;
    calibrate_quick) stage calibrate_quick "$limit" python3 -m dispatch.calibrate --quick --out "$DISPATCH_HEURISTICS_DIR/nvidia-h200.json" ;;
    table) stage table "$limit" python3 -m dispatch.table --gpu "$DISPATCH_HEURISTICS_DIR/nvidia-h200.json" ;;
    *) echo "unknown stage $name" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
printf '%s\n' "${summary[@]}"
