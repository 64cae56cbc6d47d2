#!/usr/bin/env bash
# The GPU check, in one command on the H200 machine (prepared by scripts/prepare_gpu_check.sh):
# installs the carried wheels, runs the GPU tests against carried cubins, then the speed check.
# Prints a compact summary; exits non-zero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export GEMMGEN_CACHE_DIR=$PWD/.gpu_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
start=$(date +%s)
timeout 420 "${PYTHON:-python3}" -m pytest -p no:cacheprovider -m gpu -q -rs tests/test_gpu.py 2>&1 | tail -25
rc=${PIPESTATUS[0]}
echo "gpu tests: rc=$rc in $(( $(date +%s) - start )) s"
timeout 120 "${PYTHON:-python3}" scripts/gpu_bench.py --reps 30 2>&1 | tail -8
timeout 60 "${PYTHON:-python3}" examples/mlp.py 2>&1 | tail -3
timeout 60 "${PYTHON:-python3}" scripts/op_overhead.py 2>&1 | tail -6
exit "$rc"
