#!/usr/bin/env bash
# Create a virtual environment and install launcher with the given extras (default: train).
#   scripts/setup.sh                      # the CLI and the training entrypoints, into .venv
#   scripts/setup.sh train,dev,sagemaker,data,plot,tracking  # everything the test suite needs
#   VENV=/tmp/v scripts/setup.sh train    # another environment directory (CI: one per command)
# torch is pinned first so pip takes the 2.13.0 build already on disk (a CPU build on
# machines without a GPU) instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-train}"
venv="${VENV:-.venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
"$venv/bin/pip" install --quiet --disable-pip-version-check -e ".[${extras}]"
