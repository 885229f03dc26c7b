#!/usr/bin/env bash
# The CTranslate2 side of benchmark/peers/benchmark_peers.py, in a virtualenv of its own (.venv-peers by default):
# CTranslate2 and its Hugging Face converter (torch + transformers). torch goes in first, alone, with its exact
# pin: that takes the CPU build (an open range would pull a multi-GB CUDA build).
#   bash benchmark/peers/setup_peers.sh            # or: VENV=/elsewhere PYTHON=python3.12 bash benchmark/peers/setup_peers.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv-peers}"
PYTHON="${PYTHON:-python3.11}"
TORCH_PIN="$(grep -E '^torch==' requirements-peers.txt)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_PIN"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-peers.txt
"$VENV/bin/python" -c "import ctranslate2, transformers, torch; print('ready:', '$VENV', 'ctranslate2', ctranslate2.__version__, 'torch', torch.__version__)"
