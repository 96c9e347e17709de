#!/usr/bin/env bash
# OrbitKVLinker on CUDA with SGLang 0.5.23's own pools and tree code, on the lent H200 (results in
# BENCHMARKS.md). SGLang cannot serve there (sgl_kernel does not load on the device's torch 2.11);
# its Python tree and the cp312 wheels it imports travel in .gpu-sglang/ (git-ignored), made here by
# `bash benchmarks/gpu_sglang_prepare.sh`. One device call: carry .gpu-sglang, run this script.
#
# Steps, each run whatever the others did; the script exits 1 when any failed:
#   environment; import probe (which SGLang modules were handed the absent sgl_kernel, in
#   tests/sglang/absent_sgl_kernel.py); `pytest tests/sglang/test_linker_cuda.py` (the CPU suite's
#   poisoned-restore test for MHA, SWA and Mamba pools and its two-rank test, on the GPU);
#   benchmarks/gpu_sglang_linker.py
#   (Llama-3-8B-shaped pool, 8k and 32k prompts: restore times, byte-exact checks).
# Environment: CASES (gpu_sglang_linker.py --cases), REPEATS (default 3), SKIP_BENCH=1. Logs and JSON land in $OUT.
set -uo pipefail
G=${G:-.gpu-sglang}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_sglang.log") 2>&1
export PYTHONUNBUFFERED=1 SGLANG_LOG_LEVEL=warning TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export PYTHONPATH=$PWD:$PWD/cacheon_core/src:$PWD/cacheon_orbitkv/src:$PWD/cacheon_sglang/src:/tmp/sp:/tmp/site

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

step unpack bash -c "mkdir -p /tmp/sp && python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(\"/tmp/sp\")' $G/sglang_py.zip &&
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl"
step environment bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader &&
  python3 -c "import torch, triton, transformers, sglang; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, \"sglang\", sglang.__version__)" &&
  df -h /dev/shm && nproc && free -g | head -2'
# SGLang's page hashes come from hash_binding.cpp, compiled at first use (g++, Python.h, OpenSSL):
# with the device's headers if it has them, else with the carried ones against its libcrypto.so.3.
native_hash() {
  python3 -c "from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module as load; print('native hash:', load())"
}
echo "== native hash"
which g++ c++ ninja
if ! native_hash; then
  mkdir -p /tmp/hdr-lib
  ln -sf "$(ldconfig -p | awk '/libcrypto\.so\.3 .*x86-64/ {print $NF; exit}')" /tmp/hdr-lib/libcrypto.so
  export CPATH=$PWD/$G/hdr/include:$PWD/$G/hdr/include/python3.12 LIBRARY_PATH=/tmp/hdr-lib
  step "native hash, carried headers" native_hash
fi
ANY=()
step "import probe" timeout 180 python3 benchmarks/gpu_sglang_linker.py --probe
if [ "${failed[*]}" != "" ] && [[ "${failed[*]}" == *"import probe"* ]]; then
  step "import probe, any importer" timeout 180 python3 benchmarks/gpu_sglang_linker.py --probe --any-importer && ANY=(--any-importer)
  export ABSENT_SGL_KERNEL=any
fi
step "pytest gpu" timeout 360 python3 -m pytest -p no:cacheprovider -n 0 -m gpu -v tests/sglang/test_linker_cuda.py
[ "${SKIP_BENCH:-0}" = 1 ] || step "linker on CUDA" timeout 300 python3 benchmarks/gpu_sglang_linker.py --out "$OUT" --repeats "${REPEATS:-3}" \
  ${CASES:+--cases "$CASES"} "${ANY[@]}"

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
