#!/usr/bin/env bash
# One-shot GPU check of the bundled entrypoints on one H100/H200, well within 8 minutes:
# Llama 3.2 1B at 8K tokens in bf16 and FP8 (tokens/s, MFU, peak memory next to the memory
# estimator's prediction) and the context-parallel attention kernel at 32K tokens against
# full attention. Prints a table and writes gpu_check.json to $OUT (else ./out).
#
#   bash scripts/gpu_check.sh                   # on the GPU machine
#   bash scripts/gpu_check.sh --prepare DIR     # where the launcher is installed: configs + estimates
#   bash scripts/gpu_check.sh --prepared DIR    # on a GPU machine with torch (+ torchao) only
#   bash scripts/gpu_check.sh --cpu-smoke       # the same code paths on the CPU, tiny model
#
# PYTHON picks the interpreter; otherwise the repository's .venv if its torch sees a GPU,
# else python3.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

needs_gpu=1
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke | --prepare | --prepare=*) needs_gpu=0 ;;
  esac
done

if [[ $needs_gpu == 1 ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: nvidia-smi not found: this check needs an NVIDIA GPU (use --cpu-smoke to exercise it on a CPU)" >&2
  exit 1
fi

python=${PYTHON:-}
if [[ -z $python ]]; then
  for candidate in .venv/bin/python python3 python; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if [[ $needs_gpu == 0 ]] || "$candidate" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      python=$candidate
      break
    fi
  done
fi
if [[ -z $python ]]; then
  echo "gpu_check: no Python with a CUDA build of torch found; set PYTHON=/path/to/python" >&2
  exit 1
fi

[[ $needs_gpu == 1 ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec "$python" scripts/gpu_check.py "$@"
