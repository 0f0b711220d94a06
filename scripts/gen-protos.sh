#!/usr/bin/env bash
# Generate Python stubs for protos/tandem/v1/*.proto into the package tandem.v1 (never edit them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p tandem/v1
"$PY" -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/tandem/v1/*.proto
