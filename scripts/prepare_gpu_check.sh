#!/usr/bin/env bash
# Run here (CPU machine) before scripts/gpu_check.sh on the GPU machine:
#  - .whl/: the wheels the GPU machine lacks (CUTLASS and CUDA headers; it has torch, NVRTC, cuda-bindings)
#  - .gpu_bundle.tar.xz: every kernel the GPU checks launch, compiled here (cache: .gpu_cache/), as one
#    gemmgen bundle, xz-compressed (cubins are mostly symbol names: ~60 MB -> a few MB); those of the
#    arches in GEMMGEN_GPU_ARCHES (default sm_90a: an H100/H200; "sm_90a sm_100a" adds a B200's)
# Both are git-ignored; pass them to the device tool with carry=[".whl", ".gpu_bundle.tar.xz"].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! ls .whl/nvidia_cutlass-4.2.0.0-*.whl >/dev/null 2>&1; then
  rm -rf .whl && mkdir -p .whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    nvidia-cutlass==4.2.0.0 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96
fi
rm -rf .gpu_bundle
ARCHES=()
for arch in ${GEMMGEN_GPU_ARCHES:-sm_90a}; do ARCHES+=(--arch "$arch"); done
GEMMGEN_CACHE_DIR="$PWD/.gpu_cache" "$PY" tests/data/gpu_matrix.py --bundle .gpu_bundle "${ARCHES[@]}"
"$PY" -c "import tarfile; tarfile.open('.gpu_bundle.tar.xz', 'w:xz').add('.gpu_bundle')"
rm -rf .gpu_bundle
du -sh .whl .gpu_bundle.tar.xz
