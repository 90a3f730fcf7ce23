#!/usr/bin/env bash
# Builds flux_jax with CUDA and its loopback tests on a Hopper host, then runs every GPU check
# that fits the host: the loopback tests (every rank of a TP group a host thread on one GPU, at
# TP 2, 4 and 8) and the pytest GPU tests (test_gpu_one.py on one GPU; the TP=2 suites on two).
#
#   tests/run_gpu_checks.sh <out-dir> [cutlass: a source root, or a .tgz of include/ and
#                                      tools/util/include/; default: the nvidia-cutlass wheel]
#
# With PREBUILT=<dir> (holding _flux_jax_ffi*.so and the loopback executables, e.g. copied from
# a build tree made elsewhere) nothing is built here: the package is this checkout's flux_jax/
# with that extension. (An extension built by a toolchain that links libstdc++ statically
# crashed inside iostreams in a JAX process; a build whose libstdc++ is the system's did not.)
# Writes build.log (with ptxas register / spill reports), loopback.log, pytest.log and
# summary.txt into <out-dir>. Each stage is bounded (STAGE_TIMEOUT_S, default 240 s). Extra
# commands to run after the checks, with flux_jax importable: EXTRA="..." (output in extra.log).
set -uo pipefail
out=${1:?usage: tests/run_gpu_checks.sh <out-dir> [cutlass]}
cutlass=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary=$out/summary.txt
: > "$summary"
limit=${STAGE_TIMEOUT_S:-240}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
note() { echo "$*" | tee -a "$summary"; }

note "host: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1), $(nproc) cores"
if [[ $cutlass == *.tgz ]]; then
  mkdir -p /tmp/cutlass && tar xzf "$cutlass" -C /tmp/cutlass && cutlass=/tmp/cutlass
fi

# ---- build: the extension (into /tmp/site) and the loopback executables, one CMake tree
start=$SECONDS
build=/tmp/flux-jax-build
if [[ -n ${PREBUILT:-} ]]; then
  rm -rf /tmp/site && mkdir -p /tmp/site $build/cpp/tests/loopback
  cp -r "$repo/flux_jax" /tmp/site/ && cp "$PREBUILT"/_flux_jax_ffi*.so /tmp/site/flux_jax/
  cp "$PREBUILT"/ops_loopback "$PREBUILT"/rs_decode_loopback $build/cpp/tests/loopback/
  : > "$out/build.log"
else
(cd "$repo" && CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout $((2 * limit)) python3 -m pip install --no-deps --no-build-isolation --no-index \
  --target /tmp/site -Cbuild-dir=$build ${cutlass:+-Ccmake.define.FLUX_JAX_CUTLASS_DIR=$cutlass} \
  -Ccmake.define.FLUX_JAX_BUILD_LOOPBACK_TESTS=ON -Ccmake.define.FLUX_JAX_PTXAS_VERBOSE=ON \
  -Cbuild.verbose=true . > "$out/build.log" 2>&1) || { note "build: FAILED"; tail -40 "$out/build.log"; exit 1; }
timeout "$limit" cmake --build $build --target ops_loopback rs_decode_loopback -j"$(nproc)" >> "$out/build.log" 2>&1 \
  || { note "loopback build: FAILED"; tail -40 "$out/build.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site
note "build: ok, $((SECONDS - start)) s; $(cd /tmp && python3 -c 'import flux_jax; print(flux_jax.build_info())')"
note "ptxas, kernels by registers and spills: $(grep -o 'Used [0-9]* registers' "$out/build.log" | sort | uniq -c | \
  tr -s ' \n' ' ')"
grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$out/build.log" | sort | uniq -c | head -5 | tee -a "$summary"
grep -q "C751[01]" "$out/build.log" && note "ptxas: C7510/C7511 warnings present (wgmma serialized)"

# ---- loopback tests: all ranks on one GPU
start=$SECONDS
LOOPBACK_TIMEOUT_S=$limit "$repo/cpp/tests/loopback/run_all.sh" $build /tmp/loopback > "$out/loopback.log" 2>&1
rc=$?
for f in /tmp/loopback/*.log; do echo "===== $f"; cat "$f"; done >> "$out/loopback.log"
note "loopback: exit $rc, $((SECONDS - start)) s"
cat /tmp/loopback/summary.txt >> "$summary" 2>/dev/null

# ---- pytest GPU tests (whatever this host's GPU count allows)
start=$SECONDS
(cd "$repo" && FLUX_JAX_REQUIRE_GPU=0 timeout "$limit" python3 -m pytest -q -p no:cacheprovider -o timeout=120 \
  tests/test_gpu_one.py tests/test_gpu_fused.py tests/test_gpu_decode.py > "$out/pytest.log" 2>&1)
note "pytest: exit $?, $((SECONDS - start)) s: $(tail -n 1 "$out/pytest.log")"
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20 | tee -a "$summary"

if [[ -n ${EXTRA:-} ]]; then
  start=$SECONDS
  (cd "$repo" && timeout "$limit" bash -c "$EXTRA" > "$out/extra.log" 2>&1)
  note "extra: exit $?, $((SECONDS - start)) s"
fi
