"""Find the peer systems' Pythons and run their offline scripts in them, one subprocess per run; find the
peers that are programs of their own (llama.cpp's ``llama-server``).

Peers live in their own venvs (``scripts/setup-peer.sh``), never in Tandem's: their pins conflict with
ours. So Tandem never imports a peer; it writes the workload to a request file, runs
``benchmarks/peers/<peer>_offline.py`` with the peer's Python and reads back one JSON result.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS_DIR = ".peers"
IMPORT_TIMEOUT_S = 120.0  # `import vllm` alone takes several seconds, far more on a busy machine
RESULT_KEYS = ("system", "dtype", "setting", "output_tokens", "seconds", "tokens_per_s", "init_seconds",
               "prompts_measured", "prompts_total", "note")
# What vLLM needs in a Hugging Face directory to load it by path; weights are checked apart (*.safetensors).
VLLM_REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class PeerSpec:
    """A peer system: the module its venv must import and the script that benchmarks it."""

    name: str  # as given to scripts/setup-peer.sh
    module: str
    script: str  # beside this file
    env_var: str  # overrides <repo>/.peers/<name>/bin/python

    @property
    def script_path(self) -> Path:
        return Path(__file__).resolve().parent / self.script

    @property
    def setup_hint(self) -> str:
        return _setup_hint(self.name)


PEERS = {spec.name: spec for spec in (
    PeerSpec("vllm", "vllm", "vllm_offline.py", "TANDEM_PEER_VLLM_PYTHON"),
    PeerSpec("llamacpp", "llama_cpp", "llamacpp_offline.py", "TANDEM_PEER_LLAMACPP_PYTHON"),
)}


@dataclass(frozen=True)
class PeerProgramSpec:
    """A peer that is a program, not a Python module: installed as ``.peers/<name>/bin/<program>``."""

    name: str  # as given to scripts/setup-peer.sh
    program: str
    env_var: str  # overrides <repo>/.peers/<name>/bin/<program>

    @property
    def setup_hint(self) -> str:
        return _setup_hint(self.name)


PEER_PROGRAMS = {spec.name: spec for spec in (
    PeerProgramSpec("llamacpp-server", "llama-server", "TANDEM_PEER_LLAMACPP_SERVER_BIN"),
)}


@dataclass(frozen=True)
class PeerPython:
    """A Python interpreter that imports a peer system."""

    name: str
    python: Path
    version: str  # the peer module's __version__


@dataclass(frozen=True)
class PeerProgram:
    """A peer program that runs here."""

    name: str
    path: Path
    version: str  # what its ``--version`` says after "version: "


class PeerError(RuntimeError):
    """A peer run failed; the message ends with the tail of its log."""


def peer_spec(name: str) -> PeerSpec:
    if name in PEER_PROGRAMS:
        raise ValueError(f"peer {name!r} is a program, not a Python module: find it with find_peer_program")
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return PEERS[name]


def find_peer(name: str, root: Path) -> tuple[PeerPython | None, str]:
    """The peer's Python and "" when it imports the peer module, else None and why (for the report).

    ``TANDEM_PEER_<NAME>_PYTHON`` wins over ``<root>/.peers/<name>/bin/python``; when it is set, it is the
    only place looked at, so a wrong value is reported rather than silently replaced.
    """
    spec = peer_spec(name)
    python, where = _installed_path(spec.env_var, root / PEERS_DIR / spec.name / "bin" / "python")
    if not python.exists():
        return None, f"not installed ({where} does not exist): {spec.setup_hint}"
    probe = f"import {spec.module}; print(getattr({spec.module}, '__version__', '?'))"
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=_peer_env(None),
                              timeout=IMPORT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"`import {spec.module}` with {where} took over {IMPORT_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"{where} cannot run ({exc}): {spec.setup_hint}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"not installed: {where} cannot import {spec.module} ({last}); {spec.setup_hint}"
    return PeerPython(spec.name, python, done.stdout.strip().splitlines()[-1]), ""


def find_peer_program(name: str, root: Path) -> tuple[PeerProgram | None, str]:
    """The peer program and "" when its ``--version`` answers, else None and why (for the report).

    Its ``env_var`` (``TANDEM_PEER_LLAMACPP_SERVER_BIN``) wins over ``<root>/.peers/<name>/bin/<program>``,
    as ``find_peer``'s does.
    """
    if name not in PEER_PROGRAMS:
        raise ValueError(f"unknown peer program {name!r}; known: {', '.join(PEER_PROGRAMS)}")
    spec = PEER_PROGRAMS[name]
    program, where = _installed_path(spec.env_var, root / PEERS_DIR / spec.name / "bin" / spec.program)
    if not program.exists():
        return None, f"not installed ({where} does not exist): {spec.setup_hint}"
    try:
        done = subprocess.run([str(program), "--version"], capture_output=True, text=True, env=_peer_env(None),
                              timeout=IMPORT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"`{where} --version` took over {IMPORT_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"{where} cannot run ({exc}): {spec.setup_hint}"
    # llama.cpp prints its build info on stderr, after any backend messages.
    lines = (done.stdout + done.stderr).strip().splitlines()
    version = next((line.removeprefix("version: ") for line in lines if line.startswith("version: ")), None)
    if done.returncode != 0 or version is None:
        return None, (f"not installed: `{where} --version` exited with {done.returncode} "
                      f"({(lines or ['no output'])[-1]}); {spec.setup_hint}")
    return PeerProgram(spec.name, program, version), ""


def write_requests(path: Path, prompts: list[list[int]], output_len: int) -> None:
    """The request file every peer script reads: ``{"prompts": [[token ids]], "output_len": n}``."""
    if output_len <= 0 or not prompts or not all(prompts):
        raise ValueError(f"need at least one non-empty prompt and output_len > 0, got {len(prompts)} prompts, "
                         f"output_len={output_len}")
    path.write_text(json.dumps({"prompts": prompts, "output_len": output_len}))


def run_peer(name: str, python: Path, request_file: Path, out_file: Path, model_path: Path, threads: int,
             dtype: str, budget_s: float | None, timeout_s: float) -> dict[str, Any]:
    """Run the peer's offline script and return its result (``RESULT_KEYS``).

    The script's stdout and stderr go to ``out_file`` with a ``.log`` suffix. Raises ``PeerError`` with the
    log's tail when the script fails, exceeds ``timeout_s`` (its whole process group is killed: vLLM
    starts an engine process of its own) or writes no valid result.
    """
    spec = peer_spec(name)
    out_file.unlink(missing_ok=True)
    log_path = out_file.with_suffix(".log")
    command = [str(python), str(spec.script_path), "--requests", str(request_file), "--model", str(model_path),
               "--threads", str(threads), "--dtype", dtype, "--out", str(out_file)]
    if budget_s is not None:
        command += ["--budget-s", str(budget_s)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_peer_env(threads),
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            raise PeerError(f"{name} peer ran past {timeout_s:.0f} s; {_log_tail(log_path)}") from None
        except BaseException:
            # Ctrl-C reaches only our session: the peer's own session (and vLLM's engine) must go with us.
            _kill_group(process)
            raise
    if returncode != 0:
        raise PeerError(f"{name} peer exited with status {returncode}; {_log_tail(log_path)}")
    try:
        result: dict[str, Any] = json.loads(out_file.read_text())
    except (OSError, ValueError) as exc:
        raise PeerError(f"{name} peer wrote no readable result to {out_file} ({exc}); {_log_tail(log_path)}") from None
    missing = [key for key in RESULT_KEYS if key not in result]
    if missing:
        raise PeerError(f"{name} peer result {out_file} lacks {', '.join(missing)}")
    return result


def bundled_gguf() -> Path:
    """The Q4_1 GGUF file of SmolLM2-135M-Instruct that Tandem converts; llama.cpp runs it as is."""
    from common.model.model_store import find_bundled_gguf

    return find_bundled_gguf()


def missing_vllm_files(model_dir: Path) -> list[str]:
    """Files vLLM needs that ``model_dir`` lacks ([] when it can be loaded by path)."""
    missing = [name for name in VLLM_REQUIRED_FILES if not (model_dir / name).is_file()]
    if not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def _setup_hint(name: str) -> str:
    return f"run `bash scripts/setup-peer.sh {name}`"


def _installed_path(env_var: str, default: Path) -> tuple[Path, str]:
    """``env_var``'s path when it is set, else ``default``; and how to name it in a message."""
    override = os.environ.get(env_var)
    return (Path(override), f"{env_var}={override}") if override else (default, str(default))


def _peer_env(threads: int | None) -> dict[str, str]:
    # Tandem's own venv must not leak into the peer's interpreter.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(threads)
    return env


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _log_tail(log_path: Path, lines: int = 30) -> str:
    try:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return f"no log at {log_path}"
    return f"last lines of {log_path}:\n" + "\n".join(tail)
