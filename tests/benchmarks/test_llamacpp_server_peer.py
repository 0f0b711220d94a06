"""llama.cpp's own server as a serving peer (``tandem bench serve --peer llamacpp-server``): its command line
(same cores, loopback, 8 slots, a context that holds every slot's request), finding the program and why it is
skipped when missing, the report's ratio against it; and, when ``scripts/setup-peer.sh llamacpp-server`` has
built it, a real server on the bundled GGUF answering two completions."""

from __future__ import annotations

import argparse
import math
import os
import stat
from pathlib import Path

import pytest

from benchmarks.peers import PEER_PROGRAMS, find_peer_program
from benchmarks.peers.llamacpp_server import LlamaServerConfig, llama_server
from benchmarks.peers.server_process import healthy
from benchmarks.serve_peer import COMPARISONS, PROMPT_SLACK, Row, client_workloads, report
from benchmarks.suite import SuiteConfig, serve_llamacpp_command

REPO = Path(__file__).resolve().parents[2]
INSTALLED = REPO / ".peers" / "llamacpp-server" / "bin" / "llama-server"


@pytest.fixture(autouse=True)
def _no_peer_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for spec in PEER_PROGRAMS.values():
        monkeypatch.delenv(spec.env_var, raising=False)


def test_the_server_gets_the_cores_loopback_and_a_slot_per_stream(tmp_path: Path) -> None:
    workloads = client_workloads(48)
    longest = max(workloads[w].max_request_tokens for w in ("random-384-128", "random-128-256"))
    config = LlamaServerConfig(tmp_path / "m.gguf", "SmolLM2-135M-Instruct", (2, 3), slots=8,
                               ctx_per_slot=longest + PROMPT_SLACK)
    argv = config.argv(Path("/peer/bin/llama-server"), 12345)
    assert argv[:4] == ["taskset", "-c", "2,3", "/peer/bin/llama-server"]
    assert "--cont-batching" in argv and "--no-webui" in argv
    flags = {a: b for a, b in zip(argv, [*argv[1:], ""], strict=True) if a.startswith("--") and not b.startswith("--")}
    assert flags["--model"] == str(tmp_path / "m.gguf") and flags["--alias"] == "SmolLM2-135M-Instruct"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "12345"
    assert flags["--threads"] == "2" and flags["--parallel"] == "8"
    # llama-server splits the context evenly between its slots: each holds 384 + 128 tokens and the slack,
    # rounded up to llama.cpp's own 256-token padding.
    assert config.ctx_size == 8 * 768 and flags["--ctx-size"] == "6144"


def test_the_environment_cannot_change_the_server_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ARG_N_PARALLEL", "1")
    env = LlamaServerConfig(tmp_path / "m.gguf", "m", (0, 1, 2), slots=8, ctx_per_slot=512).env()
    assert "LLAMA_ARG_N_PARALLEL" not in env and env["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(("cpus", "slots", "ctx_per_slot"), [((), 8, 512), ((0,), 0, 512), ((0,), 8, 0)])
def test_a_config_without_cores_slots_or_context_is_refused(tmp_path: Path, cpus: tuple[int, ...], slots: int,
                                                            ctx_per_slot: int) -> None:
    with pytest.raises(ValueError):
        LlamaServerConfig(tmp_path / "m.gguf", "m", cpus, slots, ctx_per_slot)


def test_missing_program_is_none_with_the_setup_command(tmp_path: Path) -> None:
    program, reason = find_peer_program("llamacpp-server", tmp_path)  # an empty repo root: no .peers/
    assert program is None
    assert reason.startswith("not installed") and "bash scripts/setup-peer.sh llamacpp-server" in reason


def test_env_override_is_the_only_place_looked_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PEER_LLAMACPP_SERVER_BIN", str(tmp_path / "nowhere" / "llama-server"))
    program, reason = find_peer_program("llamacpp-server", REPO)  # even where it is installed
    assert program is None and "TANDEM_PEER_LLAMACPP_SERVER_BIN=" in reason


def _fake_program(path: Path, script: str) -> Path:
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_version_comes_from_the_build_info_on_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_program(tmp_path / "llama-server", "echo 'load_backend: CPU' >&2; "
                         "echo 'version: 0.5.0 (build 0, commit 0c1e57098)' >&2; echo 'built with cc' >&2")
    monkeypatch.setenv("TANDEM_PEER_LLAMACPP_SERVER_BIN", str(fake))
    program, reason = find_peer_program("llamacpp-server", tmp_path)
    assert reason == "" and program is not None
    assert (program.path, program.version) == (fake, "0.5.0 (build 0, commit 0c1e57098)")


def test_program_that_fails_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_program(tmp_path / "llama-server", "echo 'Illegal instruction' >&2; exit 132")
    monkeypatch.setenv("TANDEM_PEER_LLAMACPP_SERVER_BIN", str(fake))
    program, reason = find_peer_program("llamacpp-server", tmp_path)
    assert program is None and "exited with 132" in reason and "Illegal instruction" in reason


def test_suite_section_is_skipped_without_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PEER_LLAMACPP_SERVER_BIN", str(tmp_path / "no-such-program"))
    cfg = SuiteConfig(tmp_path, "m", "float32", 1, True, tmp_path / "run", tmp_path / "m.gguf", repo_root=tmp_path)
    skip = serve_llamacpp_command(cfg)
    assert not isinstance(skip, list) and "setup-peer.sh llamacpp-server" in skip.reason


def test_report_puts_tandem_int4_beside_llama_server() -> None:
    result = {"completed": 48, "num_prompts": 48, "output_throughput": 100.0, "p50_ttft_ms": 1000,
              "p99_ttft_ms": 2000, "p50_tpot_ms": 300, "p99_tpot_ms": 400, "p50_itl_ms": 290, "p99_itl_ms": 500}
    rows = [Row("llamacpp-server", "random-128-256", math.inf, "vllm bench serve", result),
            Row("colocated", "random-128-256", math.inf, "vllm bench serve", {**result, "output_throughput": 160.0})]
    text = report(rows, {"llamacpp-server": 1.5, "colocated": 6.0}, argparse.Namespace(cpus=(0, 1)),
                  "SmolLM2-135M-Instruct", "float32", "0.5.0", COMPARISONS["llamacpp-server"], " on m.gguf")
    assert "Tandem --quantization int4" in text and "At most 8 requests in flight" in text
    assert "| vs llama-server |" in text
    assert "| colocated | vllm bench serve | inf | 48/48 | 160.0 | 1.60x |" in text


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(not INSTALLED.exists(), reason="run `bash scripts/setup-peer.sh llamacpp-server`")
def test_llama_server_on_the_bundled_gguf_answers_two_completions(tmp_path: Path) -> None:
    import openai

    from benchmarks.peers import bundled_gguf

    cpus = tuple(sorted(os.sched_getaffinity(0)))
    config = LlamaServerConfig(bundled_gguf(), "smollm2", cpus, slots=2, ctx_per_slot=256)
    log = tmp_path / "llama-server.log"
    with llama_server(INSTALLED, config, log) as (url, seconds):
        assert url.startswith("http://127.0.0.1:") and seconds > 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120.0)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        for prompt in ("The capital of France is", "Once upon a time"):
            done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                             extra_body={"ignore_eos": True})
            assert done.choices[0].text.strip()
            assert done.usage is not None and done.usage.completion_tokens == 8
    assert not healthy(url)  # stopped
    assert "127.0.0.1" in log.read_text(errors="replace")
