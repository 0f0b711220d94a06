# One image for every Tandem role (gateway, prefill, decode, colocated): the command picks the role.
#
#   docker build -t tandem:cpu .                                   CPU torch (the default)
#   docker build -t tandem:gpu --build-arg TORCH_FLAVOUR=cuda .    CUDA torch (+ triton, its dependency)
#   docker build -t tandem:cpu --build-arg BASE_IMAGE=my-python:3.11 .   another Debian-based Python 3.11 base
#                                                                  (a locally made one where no registry is reachable)
#
# Offline or behind a TLS-inspecting proxy: put wheels (the CPU torch wheel) and/or a CA bundle named
# ca-certificates.crt into docker/local/ (git ignores them): pip then finds the wheels there first and
# trusts that bundle. tests/deploy/test_compose_docker.py does this with the host's own.
# No `# syntax=` line and no RUN --mount: the file builds with BuildKit, the legacy builder and buildah.
#
# The CUDA image carries the CUDA runtime inside torch's wheels; the driver comes from the host through
# the NVIDIA Container Toolkit (compose.yaml's gpu profile). flash-attn has no wheel for every torch/CUDA
# pair and builds from source only where nvcc exists, which this slim base lacks: setup-venv.sh then says
# so and the triton attention backend serves instead.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# gcc + libc headers: triton compiles its small launcher stubs at run time; g++ + ninja: the CPU decode
# attention kernel (common/kernels/cpu/cpu_decode.cpp) builds on a node's first start, for the CPU it runs
# on (without them the PyTorch path serves); make: the Makefile's targets.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ ninja-build libc6-dev make \
    && rm -rf /var/lib/apt/lists/*

# An unprivileged user owns the virtualenv and the converted model.
RUN useradd --create-home --uid 10001 tandem && install -d -o tandem -g tandem /opt/tandem
USER tandem
WORKDIR /opt/tandem

ARG TORCH_FLAVOUR=cpu
# The pinned CPU build (torch==X+cpu, requirements/constraints-cpu.txt) is on PyTorch's own index, not on
# PyPI; the CUDA build is PyPI's default wheel, so the cuda flavour installs from PyPI alone.
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV TANDEM_HOME=/opt/tandem/cache \
    PATH=/opt/tandem/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

# Dependencies first, from only the files that pin them, so that a code change does not reinstall torch.
# The one install path is scripts/setup-venv.sh (the same pins as `make test`, CI and every developer).
COPY --chown=tandem:tandem pyproject.toml README.md ./
COPY --chown=tandem:tandem requirements/ requirements/
COPY --chown=tandem:tandem scripts/ scripts/
COPY --chown=tandem:tandem protos/ protos/
COPY --chown=tandem:tandem tandem/ tandem/
COPY --chown=tandem:tandem docker/local/ docker/local/
RUN if ls docker/local/*.whl >/dev/null 2>&1; then export PIP_FIND_LINKS="$PWD/docker/local"; fi \
    && if [ -f docker/local/ca-certificates.crt ]; then export PIP_CERT="$PWD/docker/local/ca-certificates.crt"; fi \
    && if [ "$TORCH_FLAVOUR" = cpu ] && [ -n "$CPU_TORCH_INDEX" ]; then export PIP_EXTRA_INDEX_URL="$CPU_TORCH_INDEX"; fi \
    && TORCH_FLAVOUR="$TORCH_FLAVOUR" bash scripts/setup-venv.sh \
    && rm -f docker/local/*.whl

# The code, installed in place (editable, as setup-venv.sh does); then the bundled SmolLM2 is converted
# into TANDEM_HOME once, at build time, so that containers start in seconds.
COPY --chown=tandem:tandem . .
# The CPU image compiles its kernels here too, for the build machine's instruction set (a container on a CPU
# with another one builds its own at start-up, within the nodes' health start period).
RUN python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e . \
    && tandem model prepare \
    && if [ "$TORCH_FLAVOUR" = cpu ]; then python -m common.kernels.prebuild; fi

# gRPC: gateway / colocated 50051, prefill nodes 50061+, decode nodes 50071+ (+ their KV store port).
EXPOSE 50051
ENTRYPOINT ["tandem"]
CMD ["--help"]
