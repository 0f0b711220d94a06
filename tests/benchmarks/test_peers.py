"""Finding peer Pythons, the request file their scripts read, and run_peer against a fake peer library.

No peer install is needed (CI has none): stand-in interpreters are ours with a fake module on the path.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks.peers import (
    PEERS,
    PeerError,
    find_peer,
    llamacpp_offline,
    missing_vllm_files,
    run_peer,
    vllm_offline,
    write_requests,
)
from benchmarks.peers.registry import RESULT_KEYS, peer_spec

PEER_SCRIPTS: dict[str, ModuleType] = {"vllm": vllm_offline, "llamacpp": llamacpp_offline}


@pytest.fixture(autouse=True)
def _no_peer_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for spec in PEERS.values():
        monkeypatch.delenv(spec.env_var, raising=False)


@pytest.mark.parametrize("name", ["vllm", "llamacpp"])
def test_missing_python_is_none_with_the_setup_command(tmp_path: Path, name: str) -> None:
    peer, reason = find_peer(name, tmp_path)  # an empty repo root: no .peers/
    assert peer is None
    assert reason.startswith("not installed") and f"bash scripts/setup-peer.sh {name}" in reason


def test_env_override_that_does_not_exist_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PEER_LLAMACPP_PYTHON", str(tmp_path / "nowhere" / "python"))
    peer, reason = find_peer("llamacpp", tmp_path)
    assert peer is None and "TANDEM_PEER_LLAMACPP_PYTHON=" in reason


def test_python_that_cannot_import_the_peer_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tandem's own interpreter has no vLLM. The override is the only place looked at, so a real install
    # under <root>/.peers would not hide the mistake either.
    monkeypatch.setenv("TANDEM_PEER_VLLM_PYTHON", sys.executable)
    peer, reason = find_peer("vllm", tmp_path)
    assert peer is None
    assert "cannot import vllm" in reason and "ModuleNotFoundError" in reason


def _fake_peer_python(tmp_path: Path, module: str, source: str) -> Path:
    """A stand-in peer interpreter: ours, with a fake ``module`` on its path. The wrapper sets PYTHONPATH
    itself because find_peer and run_peer strip ours from the environment they pass on."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / f"{module}.py").write_text(source)
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


# Yields token 7 forever, as llama_cpp.Llama.generate never stops at EOS by itself.
FAKE_LLAMA_CPP = """
__version__ = "0.0-fake"
class Llama:
    def __init__(self, model_path, **kwargs):
        pass
    def reset(self):
        pass
    def generate(self, tokens, **kwargs):
        while True:
            yield 7
"""


def test_python_that_imports_the_module_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = _fake_peer_python(tmp_path, "vllm", "__version__ = '9.9.9'\n")
    monkeypatch.setenv("TANDEM_PEER_VLLM_PYTHON", str(wrapper))
    peer, reason = find_peer("vllm", tmp_path)
    assert reason == ""
    assert peer is not None and (peer.name, peer.python, peer.version) == ("vllm", wrapper, "9.9.9")


def test_unknown_peer_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vllm, llamacpp"):
        find_peer("sglang", tmp_path)


@pytest.mark.parametrize("name", ["vllm", "llamacpp"])
def test_request_file_round_trips_through_each_peer_reader(tmp_path: Path, name: str) -> None:
    prompts = [[101, 102, 103], [49151, 100]]
    path = tmp_path / "requests.json"
    write_requests(path, prompts, output_len=7)
    assert PEER_SCRIPTS[name].read_requests(path) == (prompts, 7)


def test_request_writer_rejects_an_empty_workload(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="output_len"):
        write_requests(tmp_path / "r.json", [[1, 2]], output_len=0)
    with pytest.raises(ValueError, match="non-empty prompt"):
        write_requests(tmp_path / "r.json", [[]], output_len=4)


@pytest.mark.parametrize("name", ["vllm", "llamacpp"])
def test_peer_scripts_import_only_stdlib_and_their_library(name: str) -> None:
    # They run in the peer's venv, which has no Tandem, torch (llama.cpp) or numpy guarantees.
    spec = peer_spec(name)
    tree = ast.parse(spec.script_path.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported - {spec.module} - {"__future__"} <= set(sys.stdlib_module_names)


def test_vllm_needs_config_tokenizer_and_safetensors(tmp_path: Path) -> None:
    assert missing_vllm_files(tmp_path) == ["config.json", "generation_config.json", "tokenizer.json",
                                            "tokenizer_config.json", "*.safetensors"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        (tmp_path / name).write_text("{}")
    assert missing_vllm_files(tmp_path) == []


def test_vllm_binds_the_first_cores_it_may_use() -> None:
    first = sorted(os.sched_getaffinity(0))
    assert vllm_offline.cpu_bind_list(2) == ",".join(str(cpu) for cpu in first[:2])


@pytest.mark.parametrize(("budget_s", "measured"), [(None, 3), (0.0, 1)])
def test_run_peer_returns_the_script_result(tmp_path: Path, budget_s: float | None, measured: int) -> None:
    python = _fake_peer_python(tmp_path, "llama_cpp", FAKE_LLAMA_CPP)
    write_requests(tmp_path / "requests.json", [[101, 102], [103, 104], [105, 106]], output_len=5)
    result = run_peer("llamacpp", python, tmp_path / "requests.json", tmp_path / "out.json", tmp_path / "m.gguf",
                      threads=1, dtype="bfloat16", budget_s=budget_s, timeout_s=60)
    assert set(RESULT_KEYS) <= set(result)
    assert result["system"] == "llama.cpp (llama-cpp-python 0.0-fake)"
    # Exactly output_len tokens per prompt although the generator never ends; a zero budget still runs one.
    assert (result["prompts_measured"], result["prompts_total"], result["output_tokens"]) == (measured, 3, 5 * measured)
    assert ("measured 1 of 3 prompts" in result["note"]) == (measured == 1)


def test_run_peer_failure_carries_the_log_tail(tmp_path: Path) -> None:
    write_requests(tmp_path / "requests.json", [[101, 102]], output_len=2)
    with pytest.raises(PeerError, match=r"(?s)exited with status 1.*ModuleNotFoundError.*vllm"):
        run_peer("vllm", Path(sys.executable), tmp_path / "requests.json", tmp_path / "out.json", tmp_path,
                 threads=1, dtype="bfloat16", budget_s=None, timeout_s=60)
