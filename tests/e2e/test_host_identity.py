"""Nodes standing in for different machines on one box (``--host-id``): the KV data plane is chosen by the
handshake's host identity, so a prefill and a decode node with different identities pair over sockets (gloo
over TCP on loopback), the same identity over shared memory; greedy output is the colocated engine's either way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem_cli.launcher import Launcher, Topology
from tests.e2e.test_disaggregated import generate, prompts, reference, request

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("prefill_host", "decode_host", "transport"), [
    ("machine-a", "machine-b", "socket"), ("machine-a", "machine-a", "shm"),
])
def test_host_identity_picks_the_kv_transport(tiny_served_model_dir: Path, tmp_path: Path, prefill_host: str,
                                              decode_host: str, transport: str) -> None:
    topology = Topology(free_ports=True, model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "128", "--kv-timeout-s", "20", "--grace-s", "1"),
                        prefill_args=("--host-id", prefill_host), decode_args=("--host-id", decode_host),
                        gateway_args=("--local-prefill-max-tokens", "0", "--shutdown-grace-s", "1"))
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    batch = prompts(3, seed=5)
    expected = reference(tiny_served_model_dir, batch, 6)
    with Launcher(topology, log_dir=tmp_path, env=env) as launcher:
        got = [generate(launcher.gateway.target, request(p, 6))[0] for p in batch]
    assert got == expected
    logs = "\n".join(f.read_text(errors="replace") for f in tmp_path.glob("prefill*"))
    assert f"formed over {transport}" in logs, logs[-2000:]
