#!/usr/bin/env bash
# Create .venv and install launcher with the given extras (default: train).
#   scripts/setup.sh                      # the CLI and the training entrypoints
#   scripts/setup.sh train,dev,sagemaker  # everything the test suite needs
# torch is pinned first so pip takes the 2.13.0 build already on disk (a CPU build on
# machines without a GPU) instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-train}"
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[${extras}]"
