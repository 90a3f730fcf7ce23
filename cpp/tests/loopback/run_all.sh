#!/usr/bin/env bash
# Runs the loopback tests on one GPU: ops_loopback and rs_decode_loopback at TP 2, 4 and 8, then
# ops_loopback's self-test. One log per run in <out-dir>, plus summary.txt; exits 1 if any run
# failed (or timed out), 0 if all passed.
#
#   cpp/tests/loopback/run_all.sh <build-dir> <out-dir>
#
# <build-dir>: the CMake build tree (configured with -DFLUX_JAX_BUILD_LOOPBACK_TESTS=ON), or a
# folder that holds the two executables. LOOPBACK_TIMEOUT_S bounds each run (default 900).
set -uo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 <build-dir> <out-dir>" >&2
  exit 2
fi
build=$1
out=$2
bin=$build/cpp/tests/loopback
[[ -x $bin/ops_loopback ]] || bin=$build
for exe in ops_loopback rs_decode_loopback; do
  if [[ ! -x $bin/$exe ]]; then
    echo "$exe not found under $build (build the CMake targets ops_loopback and rs_decode_loopback)" >&2
    exit 2
  fi
done
mkdir -p "$out"
summary=$out/summary.txt
: > "$summary"
failed=0

run() {  # $1: log name; the rest: the command
  local name=$1
  shift
  local log=$out/$name.log start=$SECONDS rc
  echo "== $name: $*"
  timeout "${LOOPBACK_TIMEOUT_S:-900}" "$@" > "$log" 2>&1
  rc=$?
  local verdict=passed
  if [[ $rc -ne 0 ]]; then
    verdict="FAILED (exit $rc$([[ $rc -eq 124 ]] && echo ', timed out'))"
    failed=$((failed + 1))
    grep -m 20 "FAIL" "$log"
  fi
  echo "$name: $verdict, $((SECONDS - start)) s, last line: $(tail -n 1 "$log")" | tee -a "$summary"
}

for tp in 2 4 8; do
  run "ops_tp$tp" "$bin/ops_loopback" --tp=$tp
  run "rs_decode_tp$tp" "$bin/rs_decode_loopback" --tp=$tp
done
run ops_self_test "$bin/ops_loopback" --self-test

if [[ $failed -ne 0 ]]; then
  echo "$failed of 7 runs failed; logs in $out" | tee -a "$summary"
  exit 1
fi
echo "all 7 runs passed; logs in $out" | tee -a "$summary"
