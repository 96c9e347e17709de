#!/usr/bin/env bash
# Every GPU check of this repository in one call on the lent H200 (see BENCHMARKS.md for results):
# the OrbitKV transfer tests and benchmark (benchmarks/transfer.py),
# the gpu-marked tests of tests/example and tests/orbitkv (tests/gpu needs vLLM: benchmarks/gpu_engines.sh), `cacheon verify --device cuda` for the Triton variants, and eager dispatch
# overhead on CUDA tensors, the RMSNorm kernel benchmark (benchmarks/norm_gpu.py). Expects the wheels of cacheon-core,
# cacheon-orbitkv, cacheon-vllm, the example plugin, Liger-Kernel, attrs, cattrs,
# msgpack and prometheus-client for the machine's Python (3.12) and redis (tests/orbitkv imports it)
# in .whl/ (the machine has no package index). Writes logs under $OUT.
# The launch sweep of the example norms is separate: python3 benchmarks/norm_sweep.py --out $OUT.
# SECTIONS picks what runs (default all): a comma list of checks (the example tests, verify,
# dispatch), norms (benchmarks/norm_gpu.py), transfers (the orbitkv tests, benchmarks/transfer.py) and tries
# (benchmarks/transfer_tries.py, the transfer changes tried; TRIES picks its sections).
# Every step runs whatever the others did; the script exits 1 when any step failed, naming them.
# (vLLM in the GPU engine: benchmarks/gpu_engines.sh.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH
exec > >(tee "$OUT/gpu_run.log") 2>&1

failed=()
step() {
  local name=$1
  shift
  echo "== $name"
  "$@"
  local rc=$?
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

SECTIONS=${SECTIONS:-all}
[ "$SECTIONS" = all ] && SECTIONS=checks,norms,transfers
want() { [[ ",$SECTIONS," == *",$1,"* ]]; }

if want checks; then
  step environment bash -c 'nvidia-smi --query-gpu=name,driver_version --format=csv,noheader &&
    python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, torch.cuda.get_device_name())"'
  step "pytest -m gpu tests/example" python3 -m pytest -p no:cacheprovider -n 0 -m gpu -v tests/example
  for pair in norm.rmsnorm:example_triton norm.fused_add_rmsnorm:example_triton_fused norm.rmsnorm:example_torch \
    moe.finalize:example_triton_finalize moe.finalize:example_torch_finalize \
    collective.all_reduce:example_torch_all_reduce arfusion.allreduce_add_rmsnorm:example_torch_arfusion; do
    step "cacheon verify ${pair} --device cuda" \
      python3 -m cacheon_core.cli verify "${pair%%:*}" --variant "${pair##*:}" --device cuda
  done
  step "dispatch overhead on cuda" python3 benchmarks/dispatch.py --device cuda --reps 200
fi
if want norms; then
  step "rmsnorm kernels against the copy ceiling, Liger-Kernel and torch" python3 benchmarks/norm_gpu.py --out "$OUT"
fi
if want transfers; then
  # tests/gpu imports vLLM, which only benchmarks/gpu_engines.sh brings to the machine: it runs them there
  step "pytest -m gpu tests/orbitkv" python3 -m pytest -p no:cacheprovider -n 0 -m gpu -v tests/orbitkv
  step "orbitkv transfers" python3 benchmarks/transfer.py --out "$OUT"
fi
if want tries; then
  step "orbitkv transfer changes tried" python3 benchmarks/transfer_tries.py --out "$OUT" --sections "${TRIES:-items,batch,both}"
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
