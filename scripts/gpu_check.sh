#!/usr/bin/env bash
# One-shot GPU check on one H100/H200, well within 8 minutes:
# 1. scripts/gpu_check.py: Llama 3.2 1B at 8K tokens in bf16, FP8 and compiled FP8 (tokens/s,
#    MFU, peak memory next to the memory estimator's prediction) and the context-parallel
#    attention kernel at 32K tokens against full attention (errors), and its speed: one rank's
#    LSE-merged kernel at cp 2/4/8 against plain causal attention / cp at 32K and 128K, per SDPA
#    backend (cuDNN, flash), with kernel names (about 45 s of the 8 minutes) -> gpu_check.json;
# 2. scripts/estimator_gpu.py: the estimator against torch.cuda.max_memory_allocated/reserved on
#    single-GPU configs (1B-8B, 4K-32K tokens, each AC mode) -> estimator_gpu.json.
# Prints tables and writes both JSON files to $OUT (else ./out).
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
export OUT=${OUT:-out}

# The estimator check has its own prepared configs beside the training check's.
prepare_dir="" prepared_dir="" cpu_smoke=0 expect=""
for arg in "$@"; do
  case "$expect" in
    prepare) prepare_dir=$arg ;;
    prepared) prepared_dir=$arg ;;
  esac
  expect=""
  case "$arg" in
    --prepare) expect=prepare ;;
    --prepare=*) prepare_dir=${arg#--prepare=} ;;
    --prepared) expect=prepared ;;
    --prepared=*) prepared_dir=${arg#--prepared=} ;;
    --cpu-smoke) cpu_smoke=1 ;;
  esac
done

status=0
"$python" scripts/gpu_check.py "$@" || status=$?
if [[ $cpu_smoke == 1 ]]; then
  exit $status  # the estimator check measures CUDA memory; there is nothing to compare on a CPU
fi
if [[ -n $prepare_dir ]]; then
  "$python" scripts/estimator_gpu.py --prepare "$prepare_dir/estimator" || status=$?
  exit $status
fi
estimator_dir=${prepared_dir:+$prepared_dir/estimator}
if [[ -z $estimator_dir ]]; then
  estimator_dir=$OUT/estimator
  "$python" scripts/estimator_gpu.py --prepare "$estimator_dir" || status=$?
fi
"$python" scripts/estimator_gpu.py --run "$estimator_dir" || status=$?
exit $status
