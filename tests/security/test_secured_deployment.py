"""A secured deployment as real processes (``tandem serve`` under the launcher): TLS everywhere, mutual TLS
and the cluster token between the gateway and the nodes and for the prefill node's KV control plane, the
API key on the public API; the ``tandem`` client commands reach it with ``--api-key`` and ``--tls-ca``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc
from tandem_cli.launcher import Launcher, Topology
from tests.security.certs import CertificateAuthority

pytestmark = pytest.mark.e2e
API_KEY = "sk-e2e"
TOKEN = "e2e-cluster-token"


@pytest.fixture(scope="module")
def secured(tiny_served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Launcher, Path]]:
    pki_dir = tmp_path_factory.mktemp("pki")
    authority = CertificateAuthority(pki_dir)
    member = authority.issue("member")  # one certificate for every process of this local deployment
    env = {"TANDEM_TLS_CERT": str(member.cert), "TANDEM_TLS_KEY": str(member.key), "TANDEM_TLS_CA": str(authority.ca),
           "TANDEM_INTERNAL_TOKEN": TOKEN}
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True, http_port=None,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "64", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    launcher = Launcher(topology, log_dir=tmp_path_factory.mktemp("logs"), env=env,
                        role_env={"gateway": {"TANDEM_API_KEY": API_KEY}})
    with launcher:
        yield launcher, pki_dir


def _tls(pki_dir: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials((pki_dir / "tandem-test-ca.pem").read_bytes())


def test_generation_over_tls_with_the_api_key(secured: tuple[Launcher, Path]) -> None:
    launcher, pki_dir = secured
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=list(range(100, 140))),  # 40 tokens: a real KV transfer
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        stream=generate_pb2.StreamOptions(include_token_ids=True))
    with grpc.secure_channel(launcher.gateway.target, _tls(pki_dir)) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        responses = list(stub.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {API_KEY}"),)))
        assert sum(len(r.token_ids) for r in responses) == 5
        assert responses[-1].timings.prefill_node == "prefill-0"
        assert responses[-1].timings.kv_transfer_bytes > 0
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(launcher.gateway.target) as plaintext, pytest.raises(grpc.RpcError) as info:
        list(generate_pb2_grpc.TandemStub(plaintext).Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_node_refuses_a_caller_with_only_the_ca(secured: tuple[Launcher, Path]) -> None:
    launcher, pki_dir = secured
    decode = next(s for s in launcher.specs if s.role == "decode")
    with grpc.secure_channel(decode.target, _tls(pki_dir)) as channel, pytest.raises(grpc.RpcError) as info:
        decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no client certificate: no handshake


def _tandem(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_TLS", "TANDEM_API_KEY"))}
    return subprocess.run([sys.executable, "-m", "tandem_cli", *args], capture_output=True, text=True, timeout=120,
                          env=env, check=False)


def test_cli_generate_and_health_take_the_credentials(secured: tuple[Launcher, Path]) -> None:
    launcher, pki_dir = secured
    ca = str(pki_dir / "tandem-test-ca.pem")
    url = launcher.gateway.target
    ok = _tandem("generate", "--url", url, "--prompt", "Hi", "--max-tokens", "3", "--ignore-eos",
                 "--api-key", API_KEY, "--tls-ca", ca)
    assert ok.returncode == 0, ok.stderr
    assert "[3 tokens" in ok.stderr
    refused = _tandem("generate", "--url", url, "--prompt", "Hi", "--max-tokens", "3", "--tls-ca", ca)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "API key" in refused.stderr
    decode = next(s for s in launcher.specs if s.role == "decode")
    health = _tandem("health", "--target", decode.target, "--tls-ca", ca,
                     "--tls-cert", str(pki_dir / "member.pem"), "--tls-key", str(pki_dir / "member.key"))
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
