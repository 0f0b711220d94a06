"""Peer systems (vLLM-CPU, llama.cpp) benchmarked beside Tandem on the same workload and machine.

``registry`` runs on Tandem's side; ``vllm_offline.py`` and ``llamacpp_offline.py`` are standalone
scripts run by each peer's own Python (stdlib + the peer library only: the peer venvs lack Tandem).
``vllm_server`` and ``llamacpp_server`` start the peers' own OpenAI servers (``server_process``).
"""

from benchmarks.peers.registry import (
    PEER_PROGRAMS,
    PEERS,
    PeerError,
    PeerProgram,
    PeerPython,
    bundled_gguf,
    find_peer,
    find_peer_program,
    missing_vllm_files,
    run_peer,
    write_requests,
)

__all__ = ["PEERS", "PEER_PROGRAMS", "PeerError", "PeerProgram", "PeerPython", "bundled_gguf", "find_peer",
           "find_peer_program", "missing_vllm_files", "run_peer", "write_requests"]
