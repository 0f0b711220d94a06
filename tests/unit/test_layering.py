"""Dependencies point one way, over the whole import graph (``tests/unit/import_graph.py``, parsed with ast).

gateway -> common; prefill_service, decode_service -> kv_transfer -> common; tandem_cli above them all;
benchmarks above the product. Each rule is checked on the *transitive* runtime closure: the gateway's whole
import graph has no torch, whichever module the torch import would hide in. And no module imports itself
through others.
"""

from __future__ import annotations

import pytest

from tests.unit.import_graph import ImportGraph, build, find_cycles

PRODUCT = ("common", "kv_transfer", "prefill_service", "decode_service", "gateway", "tandem_cli", "tandem")
GPU_AND_MODEL_LIBS = {"torch", "triton", "flash_attn", "flashinfer", "transformers", "numpy", "safetensors"}


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build()


def _reached(graph: ImportGraph, package: str, forbidden: tuple[str, ...]) -> list[str]:
    reached = graph.closure(graph.in_package(package))
    return sorted(m for m in reached if m.split(".")[0] in forbidden)


def test_no_import_cycles(graph: ImportGraph) -> None:
    assert graph.cycles() == []


def test_gateway_closure_has_no_torch_and_no_node_code(graph: ImportGraph) -> None:
    assert graph.external_closure(graph.in_package("gateway")) & GPU_AND_MODEL_LIBS == set()
    assert _reached(graph, "gateway", ("prefill_service", "decode_service", "kv_transfer", "tandem_cli",
                                       "benchmarks")) == []


def test_common_reaches_no_service(graph: ImportGraph) -> None:
    assert _reached(graph, "common", ("gateway", "prefill_service", "decode_service", "kv_transfer", "tandem_cli",
                                      "benchmarks")) == []


def test_kv_transfer_reaches_no_service(graph: ImportGraph) -> None:
    assert _reached(graph, "kv_transfer", ("gateway", "prefill_service", "decode_service", "tandem_cli",
                                           "benchmarks")) == []


def test_services_do_not_reach_each_other(graph: ImportGraph) -> None:
    assert _reached(graph, "prefill_service", ("decode_service", "gateway", "tandem_cli", "benchmarks")) == []
    assert _reached(graph, "decode_service", ("prefill_service", "gateway", "tandem_cli", "benchmarks")) == []


def test_no_product_package_imports_benchmarks(graph: ImportGraph) -> None:
    """Benchmarks sit above the product: not even a lazy import points down into them."""
    for package in PRODUCT:
        importers = sorted(m for m in graph.in_package(package)
                           if any(t.split(".")[0] == "benchmarks" for t in graph.edges[m]))
        assert importers == [], f"{package} imports benchmarks"


def test_pure_python_scheduling_reaches_no_torch(graph: ImportGraph) -> None:
    """The block pool, prefix cache, scheduler and its connectors are pure Python, all the way down."""
    pure = {"common.kv.block_pool", "common.kv.kv_cache_manager", "common.kv.block_hash", "common.tokenizer",
            "common.config.settings", "common.config.model_config", "common.engine.scheduler",
            "common.engine.scheduling_policy",
            "common.engine.kv_connector", "common.engine.commands", "prefill_service.kv_producer",
            "decode_service.kv_consumer"}
    assert pure <= graph.modules
    for module in sorted(pure):
        assert "torch" not in graph.external_closure({module}), module


def test_the_graph_sees_what_it_checks(graph: ImportGraph) -> None:
    """Guards against a checker that passes by seeing nothing: known edges and imports are found."""
    assert "common.engine.kv_connector" in graph.runtime["common.engine.scheduler"]
    assert "torch" in graph.external_closure({"common.engine.engine_core"})
    assert "common.kv.kv_cache_manager" in graph.closure({"decode_service.server"})
    # a TYPE_CHECKING-only import is an edge for cycles but not a runtime import
    assert "common.engine.scheduler_output" in graph.edges["common.engine.kv_connector"]
    assert "common.engine.scheduler_output" not in graph.runtime["common.engine.kv_connector"]


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_kernels_are_a_leaf_of_common(graph: ImportGraph) -> None:
    """The kernels package (build, ISA detection, CPU and Triton kernels) stands on the settings alone: the
    model, attention and quantization code call down into it, never the other way."""
    kernels = graph.in_package("common.kernels")
    assert "common.kernels.cpu" in kernels and "common.kernels.triton.attention" in kernels
    settings = graph.closure({"common.config.settings"})  # torch-free: the settings and their enums
    assert {m for m in graph.closure(kernels) - kernels - settings if m.startswith("common")} == set()
