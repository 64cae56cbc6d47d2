#!/usr/bin/env bash
# Run here (CPU machine) before scripts/gpu_check.sh on the GPU machine:
#  - .whl/: the wheels the GPU machine lacks (CUTLASS and CUDA headers; it has torch, NVRTC, cuda-bindings)
#  - .gpu_cache/: every kernel the GPU checks launch, compiled here, as a gemmgen cache
# Both are git-ignored; pass them to the device tool with carry=[".whl", ".gpu_cache"].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl \
  nvidia-cutlass==4.2.0.0 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96
GEMMGEN_CACHE_DIR="$PWD/.gpu_cache" "$PY" tests/data/gpu_matrix.py
du -sh .whl .gpu_cache
