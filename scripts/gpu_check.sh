#!/usr/bin/env bash
# The GPU check, in one command on the H200 machine (prepared by scripts/prepare_gpu_check.sh):
# installs the carried wheels, unpacks the carried kernel bundle, runs the GPU tests, the speed
# check, the training-step table, the MLP example and the overhead table. Every kernel comes from the bundle (GEMMGEN_JIT=0:
# a missing one fails at once, naming it, instead of spending device minutes compiling).
# Prints a compact summary and keeps each step's whole output in $OUT (the device tool brings that
# folder back; /tmp/gpu_check elsewhere), so a failure's traceback needs no second run. Exits
# non-zero if any test failed. The step timeouts add up to 585 s, under the device tool's 600 s
# per command, so a hung step still leaves the others' output. `gemmgen profile` (Nsight Compute's
# replays) is a step of its own, so that a slow ncu cannot take the other tests' time.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -f .gpu_bundle.tar.xz ]; then
  "${PYTHON:-python3}" -c "import tarfile; tarfile.open('.gpu_bundle.tar.xz').extractall(filter='data')" || exit 1
fi
export GEMMGEN_BUNDLE_PATH=$PWD/.gpu_bundle GEMMGEN_CACHE_DIR=/tmp/gemmgen-cache GEMMGEN_JIT=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
start=$(date +%s)
# each GPU marker runs on its device (tests/conftest.py skips the other's, with the reason)
timeout 260 "${PYTHON:-python3}" -m pytest -p no:cacheprovider -m "gpu or gpu_sm100" -v -rfEs --durations=5 tests/gpu \
  --ignore=tests/gpu/test_profile_gpu.py 2>&1 | tee "$LOGS/gpu_tests.log" | tail -25
rc=${PIPESTATUS[0]}
echo "gpu tests: rc=$rc in $(( $(date +%s) - start )) s (whole output: gpu_tests.log)"
timeout 55 "${PYTHON:-python3}" -m pytest -p no:cacheprovider -m gpu -rs -s tests/gpu/test_profile_gpu.py 2>&1 \
  | tee "$LOGS/profile.log" | tail -8
profile_rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && rc=$profile_rc
timeout 105 "${PYTHON:-python3}" scripts/gpu_bench.py --reps 30 2>&1 | tee "$LOGS/bench.log" | tail -50
timeout 60 "${PYTHON:-python3}" scripts/gpu_bench.py --training --reps 20 2>&1 | tee "$LOGS/training.log" | tail -5
timeout 65 "${PYTHON:-python3}" examples/mlp.py 2>&1 | tee "$LOGS/mlp.log" | tail -4
timeout 40 "${PYTHON:-python3}" scripts/op_overhead.py 2>&1 | tee "$LOGS/op_overhead.log" | tail -20
exit "$rc"
