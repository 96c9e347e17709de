#!/usr/bin/env bash
# OrbitKV inside vLLM 0.33's GPU engine on the lent H200 (results in BENCHMARKS.md).
#
# vLLM travels with the recipe in ../shared/gpu-vllm (README.md there): device call 1 carries
# .gpu-vllm/a (with the cacheon-core/-orbitkv/-vllm, cattrs and redis wheels added to .gpu-vllm/a/whl;
# tests/orbitkv imports redis)
# and runs `bash .gpu-vllm/a/device-setup.sh`; call 2, at once, carries .gpu-vllm/b and runs
# `bash .gpu-vllm/b/device-finish.sh && bash benchmarks/gpu_engines.sh`.
# Every call also carries this repository's files, and with them .gpu-vllm/a or /b (about 61 MiB each)
# can pass the 64 MiB a call carries. Then move some wheels of a/whl to a folder of their own, split
# b's C_stable_libtorch.so.xz in two, and spend a call between the two above carrying those wheels and
# the first part: `pip install --target /tmp/site` the wheels and copy the part under /tmp. Carry the
# second part with call 2, join the parts and unpack them as device-finish.sh does (into
# /tmp/vp/vllm/_C_stable_libtorch.abi3.so), then run this script. (Done so on 2026-12-03.)
#
# Steps, each run whatever the others did; the script exits 1 when any failed:
#   environment (GPU, /dev/shm), `pytest -m gpu tests/orbitkv tests/gpu` (GPU paths against
#   wire.checksum, every vLLM 0.33 KV cache layout), the engine cases of benchmarks/gpu_engines.py.
# Environment: CASES (default eager,ssd,graphs,sliding,decode; empty for none), TTFT=1 (time to first
# token, Llama-3-8B shape), TRANSFER=1 (benchmarks/transfer.py: bandwidth with and without
# checksums), SKIP_TESTS=1. Logs and JSON land in $OUT; engine logs in $OUT/engine_logs.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=/tmp/vp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_engines.log") 2>&1

failed=()
step() {
  local name=$1
  shift
  echo "== $name"
  local began=$SECONDS
  "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - began)) s"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

step environment bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader &&
  python3 -c "import torch, triton, vllm, cacheon_vllm; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"vllm\", vllm.__version__)" &&
  df -h /dev/shm && nproc && free -g | head -2'
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step "pytest -m gpu" timeout 240 python3 -m pytest -p no:cacheprovider -n 0 -m gpu -v tests/orbitkv tests/gpu
fi
if [ "${TRANSFER:-0}" = 1 ]; then
  step "transfer bandwidth with and without checksums" timeout 300 \
    python3 benchmarks/transfer.py --out "$OUT" --sections "${TRANSFER_SECTIONS:-ceilings,orbitkv,llama}"
fi
cases=${CASES-eager,ssd,graphs,sliding,decode}
if [ -n "$cases" ] || [ "${TTFT:-0}" = 1 ]; then
  step "vLLM engines: ${cases:-none}${TTFT:+ + ttft}" timeout "${ENGINES_TIMEOUT:-480}" \
    python3 benchmarks/gpu_engines.py --out "$OUT" --cases "$cases" $([ "${TTFT:-0}" = 1 ] && echo --ttft)
fi
if [ -d "$OUT/logs" ]; then
  tar czf "$OUT/engine_logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
