#!/usr/bin/env bash
# The CPU test suite under another torch, in a venv of its own: by default torch 2.11.0, the GPU
# machine's (shared/FINDINGS.md), whose PyPI wheel is a CUDA 13.0 build (about 5 GB with its
# nvidia-* wheels; it runs on the CPU here). Extra arguments go to pytest.
#
#   bash scripts/torch_compat.sh [TORCH_VERSION] [PYTEST_ARGS...]
#
# GEMMGEN_TEST_CACHE_DIR shares compiled test kernels with other runs (cache keys do not depend
# on which torch is installed); VENV chooses where the venv goes.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.11.0}
venv=${VENV:-/tmp/gemmgen-torch-$version}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$version" numpy -e ".[test]"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${@:2}"
