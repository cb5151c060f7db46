#!/usr/bin/env bash
# The whole suite: unit tests on tiny models, then the marked integration tests
# (SmolLM2, vLLM) which are part of CI too.
set -euo pipefail
VENV="${1:-.venv}"
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests
