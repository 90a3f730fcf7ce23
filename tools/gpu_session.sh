#!/usr/bin/env bash
# One call on the lent GPU host: install flux_jax, record build facts, run the
# GPU tests and the benchmarks, leave everything under $OUT.
#
#   run(command="bash tools/gpu_session.sh [tests|bench|probe|train|trainmp|trainsweep|multiprocess|anatomy|ab|gemmgap|install|all] [args...]", carry=[".whl"])
#
# .whl/ holds the wheel built here (pip wheel . -w .whl) and, as a fallback,
# cutlass_headers.tgz to build from source there. WHEEL=path picks another wheel
# (e.g. .whl/main/flux_jax-*.whl next to a branch build).
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/flux_out}; mkdir -p "$OUT"
REPO=$(pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log="$OUT/session.log"
exec > >(tee -a "$log") 2>&1

echo "== host"; date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv; nvidia-smi topo -m | head -5
python3 -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())"

echo "== install"
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${WHEEL:-.whl/flux_jax-*.whl}
export PYTHONPATH=/tmp/site
if ! (cd /tmp && python3 -c "import flux_jax; print(flux_jax.build_info())"); then
  echo "prebuilt wheel does not import here; building from source"
  mkdir -p /tmp/cutlass && tar xzf .whl/cutlass_headers.tgz -C /tmp/cutlass
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
    -Ccmake.define.FLUX_JAX_CUTLASS_DIR=/tmp/cutlass -Cbuild-dir=/tmp/build . || exit 1
  (cd /tmp && python3 -c "import flux_jax; print(flux_jax.build_info())") || exit 1
fi
so=$(ls /tmp/site/flux_jax/_flux_jax_ffi*.so)
echo "HGMMA instructions in SASS: $(cuobjdump --dump-sass "$so" 2>/dev/null | grep -c HGMMA)"
cuobjdump --dump-resource-usage "$so" 2>/dev/null | grep -E "REG|STACK" | sort | uniq -c | head -20

if [[ $what == tests || $what == all ]]; then
  echo "== GPU tests"
  tlog="$OUT/gpu_tests${FLUX_JAX_TEST_TUNING:+_tuned}.log"; echo "tuning: ${FLUX_JAX_TEST_TUNING:-default}"
  FLUX_JAX_REQUIRE_GPU=1 timeout 300 pytest -q -o timeout=90 -p no:cacheprovider tests/test_gpu_fused.py tests/test_gpu_decode.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} > "$tlog" 2>&1
  grep -E "passed|failed|^FAILED|^E " "$tlog" | head -40
fi
if [[ $what == multiprocess ]]; then
  if [[ -z ${MP_SKIP_TESTS:-} ]]; then
    echo "== GPU tests, one process per GPU"
    FLUX_JAX_REQUIRE_GPU=1 timeout 240 pytest -q -p no:cacheprovider tests/test_gpu_multiprocess.py > "$OUT/gpu_mp_tests.log" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_mp_tests.log" | head -40
    echo "== GPU tests, one process (subset)"
    FLUX_JAX_REQUIRE_GPU=1 timeout 150 pytest -q -p no:cacheprovider tests/test_gpu_fused.py -k "${GPU_TEST_FILTER:-4096x2048x4096 or timeout or latency_path_small}" > "$OUT/gpu_tests.log" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests.log" | head -20
  fi
  echo "== one process vs one process per GPU"
  (cd /tmp && timeout ${MP_TIMEOUT:-200} python3 "$REPO/tools/multiprocess_bench.py" --out "$OUT/multiprocess_bench.json" --budget-s $(( ${MP_TIMEOUT:-200} - 20 )) "$@")
fi
if [[ $what == debug ]]; then
  (cd /tmp && timeout 500 python3 "$REPO/tools/gpu_debug.py" "$@")
fi
if [[ $what == probe || $what == all ]]; then
  echo "== perf probe"
  (cd /tmp && timeout ${PROBE_TIMEOUT:-240} python3 "$REPO/tools/perf_probe.py" --out "$OUT/probe.json" "$@")
fi
if [[ $what == bench ]]; then
  echo "== harness"
  (cd /tmp && PYTHONPATH=/tmp/site:$REPO timeout ${BENCH_TIMEOUT:-540} python3 -m benchmarks.run --out "$OUT/results" "$@")
  (cd "$OUT" && tar czf "results_$(date +%s).tgz" results && rm -rf results)
fi
if [[ $what == anatomy ]]; then
  echo "== loop anatomy (profiler trace of the serialized loop), per XLA flag setting"
  cases=${ANATOMY_CASES:-ag:64x8192x8192,ag:256x8192x8192,rs:64x8192x8192,rs:256x8192x8192,ag:256x8192x128}
  vars=${ANATOMY_VARIANTS:-gemm_only,flux_latency,xla_shard_map,comm_only}
  i=0
  for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_graph_min_graph_size=1" "$@"; do
    i=$((i + 1)); echo "-- XLA_FLAGS='$flags'"
    (cd /tmp && XLA_FLAGS="$flags" PYTHONPATH=/tmp/site:$REPO timeout ${ANATOMY_TIMEOUT:-150} python3 "$REPO/tools/loop_anatomy.py" \
       --cases "$cases" --variants "$vars" --out "$OUT/anatomy_$i.json" 2>&1 | grep "^ANATOMY")
  done
fi
if [[ $what == ab ]]; then
  echo "== A/B of Config settings in one process (tools/ab_config.py; AB_CASES, AB_VARIANT, AB_ROUNDS)"
  configs=$1; shift
  (cd /tmp && PYTHONPATH=/tmp/site:$REPO timeout ${AB_TIMEOUT:-500} python3 "$REPO/tools/ab_config.py" \
     --cases "$AB_CASES" --configs "$configs" --variant ${AB_VARIANT:-flux_overlap} --rounds ${AB_ROUNDS:-5} \
     --out "$OUT/ab_$(date +%s).json" "$@" 2>&1 | grep -E "^AB|Error|error" | head -60)
fi
if [[ $what == gemmgap ]]; then
  # Our GEMM vs cuBLAS / XLA at the held-out shapes (tools/gpu_next_session.md item 1): the
  # standalone probe (bash tools/gemm_probe/build.sh first) and the kernels XLA picks.
  lib=$(find / -name 'libcublas.so.1[0-9]*' ! -name '*Lt*' 2>/dev/null | head -1); echo "cuBLAS: $lib"
  probe() {  # $1: a probe in .whl/probe, $2: its time limit; on GPU 0 with the JAX plugin's cuBLAS
    CUDA_VISIBLE_DEVICES=0 FLUX_PROBE_CUBLAS=$lib LD_LIBRARY_PATH=$(dirname "$lib"):${LD_LIBRARY_PATH:-} \
      timeout "$2" "./.whl/probe/$1" 2>&1 | tee "$OUT/$1.txt"
  }
  echo "== gemm_cublas probe (GPU 0)"
  probe gemm_cublas 120
  if [[ -x .whl/probe/gemm_widths ]]; then
    echo "== gemm_widths probe (GPU 0): wave-filling tile widths against cuBLAS"
    probe gemm_widths 150
  fi
  echo "== XLA's kernels at the held-out shapes (one call's timeline)"
  (cd /tmp && PYTHONPATH=/tmp/site:$REPO timeout ${ANATOMY_TIMEOUT:-150} python3 "$REPO/tools/loop_anatomy.py" \
     --cases "${GAP_CASES:-ag:3000x3072x9216,ag:12288x3072x16384,ag:3000x5120x7168,rs:3000x5120x5120}" \
     --variants gemm_only,flux_gemm_only --calls 20 --timeline --out "$OUT/anatomy_gemmgap.json" 2>&1 | tail -60)
fi
if [[ $what == train ]]; then
  echo "== 8B-like layer stack, fused vs xla"
  (cd /tmp && timeout ${TRAIN_TIMEOUT:-300} python3 "$REPO/examples/train_transformer.py" --preset llama3-8b-layers \
     --compare --sample-chars 0 --out "$OUT/train_$(date +%s)" "$@" 2>&1 | grep -v "it/s\]$" | tail -25)
fi
if [[ $what == trainmp ]]; then
  echo "== the training example with one process per GPU (2 processes, jax.distributed), fused vs xla"
  port=$((20000 + RANDOM % 20000))
  preset=(--preset ${TRAIN_PRESET:-llama3-8b-layers}); [[ ${TRAIN_PRESET-x} == "" ]] && preset=()
  workers=()
  for pid in 1 0; do
    (cd /tmp && timeout ${TRAIN_TIMEOUT:-300} python3 "$REPO/examples/train_transformer.py" "${preset[@]}" --compare \
       --coordinator 127.0.0.1:$port --num-processes 2 --process-id $pid --out "$OUT/train_mp_p$pid" "$@" \
       > "$OUT/train_mp_p$pid.log" 2>&1; echo "process $pid exit $?" >> "$OUT/train_mp_p$pid.log") &
    workers+=($!)
  done
  wait "${workers[@]}"  # not a bare wait: that would also wait for the log's tee
  for pid in 0 1; do echo "-- process $pid"; grep -E "^(impl=|compare)|exit|Error" "$OUT/train_mp_p$pid.log" | tail -6; done
fi
if [[ $what == trainsweep ]]; then
  echo "== 8B-like layer stack, fused vs xla, per sequence length x batch (TRAIN_SWEEP='seq:batch ...')"
  for sb in ${TRAIN_SWEEP:-2048:2 4096:1 4096:2 8192:1}; do
    seq=${sb%:*}; batch=${sb#*:}
    (cd /tmp && timeout ${TRAIN_TIMEOUT:-150} python3 "$REPO/examples/train_transformer.py" --preset llama3-8b-layers \
       --seq "$seq" --batch "$batch" --steps ${TRAIN_STEPS:-20} --compare --sample-chars 0 \
       --out "$OUT/train_sweep_${seq}x${batch}" "$@" 2>&1 | grep -E "^(impl=|compare)" | sed "s/^/seq $seq batch $batch: /")
  done
fi
echo "== done"; date -u
