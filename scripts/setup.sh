#!/usr/bin/env bash
# The main job's setup: no root, no test tools. Creates .venv (if missing) and installs gemmgen
# (editable) with its pinned NVIDIA wheels and torch 2.13.0, the version CI tests. A torch already
# in .venv stays: on a GPU machine, install a CUDA build there first (the README says how).
# `--test` (what .ci/setup runs) also installs the test extras and always pins torch.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
torch="torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
elif [ -n "${1:-}" ]; then
  echo "usage: bash scripts/setup.sh [--test]" >&2
  exit 2
elif [ -x .venv/bin/python ] && .venv/bin/python -m pip show -q torch >/dev/null 2>&1; then
  torch=""
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q ${torch:+"$torch"} -e ".$extras"
