"""llama.cpp's own OpenAI server, ``llama-server`` (``bash scripts/setup-peer.sh llamacpp-server``), on a GGUF
file: the peer of ``tandem bench serve --peer llamacpp-server``, driven by vLLM's client like every system.

It gets the cores of the Tandem system it is compared with (``taskset``, one thread per core), ``slots``
requests decoded together (``--parallel``, continuous batching) and a context of ``slots x ctx_per_slot``
tokens: with ``--parallel`` given, llama-server splits its KV cache evenly between the slots (no unified
cache), so each slot must hold one whole request. It binds loopback only and serves no web UI.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.server_process import server_process

READY_TIMEOUT_S = 120.0  # it maps the GGUF and warms up with one empty run: seconds for a small model
STOP_GRACE_S = 10.0
# A slot's context is rounded up to this many tokens, as llama.cpp pads it itself (llama-context.cpp).
CTX_ROUNDING = 256


@dataclass(frozen=True)
class LlamaServerConfig:
    gguf: Path
    served_model_name: str  # --alias: the model name the client sends and /v1/models lists
    cpus: tuple[int, ...]
    slots: int  # --parallel: requests decoded together
    ctx_per_slot: int  # tokens one request may reach (prompt + output); rounded up to CTX_ROUNDING

    def __post_init__(self) -> None:
        if not self.cpus:
            raise ValueError("cpus must name at least one core")
        if self.slots < 1 or self.ctx_per_slot < 1:
            raise ValueError(f"slots and ctx_per_slot must be >= 1, got {self.slots} and {self.ctx_per_slot}")

    @property
    def ctx_size(self) -> int:
        """``--ctx-size``: every slot's context, each rounded up to ``CTX_ROUNDING`` tokens."""
        return self.slots * -(-self.ctx_per_slot // CTX_ROUNDING) * CTX_ROUNDING

    def argv(self, program: Path, port: int) -> list[str]:
        cpus = ",".join(map(str, self.cpus))
        # --cont-batching is the default since 2024; given anyway, so an older build batches the same way.
        return ["taskset", "-c", cpus, str(program), "--model", str(self.gguf), "--alias", self.served_model_name,
                "--host", "127.0.0.1", "--port", str(port), "--threads", str(len(self.cpus)),
                "--parallel", str(self.slots), "--cont-batching", "--ctx-size", str(self.ctx_size),
                "--seed", "0", "--no-webui"]

    def env(self) -> dict[str, str]:
        # OpenMP (ggml's thread pool) gets the same count as --threads; no LLAMA_ARG_* from the caller's
        # environment may change the settings above.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        return {**env, "OMP_NUM_THREADS": str(len(self.cpus))}


def llama_server(program: Path, config: LlamaServerConfig, log_path: Path,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> contextlib.AbstractContextManager[tuple[str, float]]:
    """Start llama-server; yield (its base URL, seconds from start to its first healthy answer). Raises
    ``RuntimeError`` naming the log when it exits or is not ready in time; stops it (SIGTERM, then SIGKILL)."""
    return server_process("llama-server", lambda port: config.argv(program, port), config.env(), log_path,
                          ready_timeout_s, STOP_GRACE_S)
