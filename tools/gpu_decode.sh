#!/usr/bin/env bash
# Decode-shaped timing with the harness's loop (tools/loop_anatomy.py --no-trace): the latency
# path against gemm_only and the twin, then the AG latency path under extra configs.
# Runs after tools/gpu_session.sh installed the wheel into /tmp/site.
#   bash tools/gpu_decode.sh "cfg1;cfg2"
set -uo pipefail
OUT=${OUT:-/tmp/flux_out}; REPO=$(pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cases=${DECODE_CASES:-ag:64x8192x8192,ag:256x8192x8192,ag:1024x8192x8192,rs:64x8192x8192,rs:256x8192x8192,rs:1024x8192x8192}
ag_cases=$(echo "$cases" | tr ',' '\n' | grep '^ag' | paste -sd,)
cd /tmp
echo "== decode: default config"
PYTHONPATH=/tmp/site:$REPO timeout ${DECODE_TIMEOUT:-200} python3 "$REPO/tools/loop_anatomy.py" --no-trace \
  --cases "$cases" --variants ${DECODE_VARIANTS:-gemm_only,flux_latency,xla_shard_map} --out "$OUT/decode_default.json" 2>&1 | grep "^ANATOMY"
i=0
IFS=';' read -ra cfgs <<< "${1:-}"
for cfg in "${cfgs[@]}"; do
  i=$((i + 1)); echo "== decode: $cfg (AG latency path)"
  PYTHONPATH=/tmp/site:$REPO timeout 120 python3 "$REPO/tools/loop_anatomy.py" --no-trace --cases "$ag_cases" \
    --variants flux_latency --config "$cfg" --out "$OUT/decode_cfg$i.json" 2>&1 | grep "^ANATOMY"
done
