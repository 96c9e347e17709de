#!/usr/bin/env bash
# Every GPU check of this repository in one call on the lent H200 (see BENCHMARKS.md for results):
# the OrbitKV transfer tests and benchmark (benchmarks/transfer.py),
# the gpu-marked tests, `cacheon verify --device cuda` for the Triton variants, and eager dispatch
# overhead on CUDA tensors, the RMSNorm kernel benchmark (benchmarks/norm_gpu.py). Expects the wheels of cacheon-core,
# cacheon-orbitkv, the example plugin, Liger-Kernel and cattrs/attrs
# in .whl/ (the machine has no package index). Writes logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH
{
  if [ "${SECTIONS:-all}" = all ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
  echo "== pytest -m gpu"
  python3 -m pytest -p no:cacheprovider -n 0 -m gpu -v tests/example
  echo "== cacheon verify --device cuda"
  for pair in norm.rmsnorm:example_triton norm.fused_add_rmsnorm:example_triton_fused norm.rmsnorm:example_torch; do
    python3 -m cacheon_core.cli verify "${pair%%:*}" --variant "${pair##*:}" --device cuda
    echo "exit=$?"
  done
  echo "== dispatch overhead on cuda"
  python3 benchmarks/dispatch.py --device cuda --reps 200
  echo "== rmsnorm kernels against the copy ceiling, Liger-Kernel (its wheel in .whl/) and torch"
  python3 benchmarks/norm_gpu.py --out "$OUT"
  fi
  echo "== orbitkv transfers"
  python3 -m pytest -p no:cacheprovider -n 0 -m gpu -v tests/orbitkv
  python3 benchmarks/transfer.py --out "$OUT"
} 2>&1 | tee "$OUT/gpu_run.log"
