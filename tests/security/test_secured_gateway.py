"""A secured gateway in front of scripted nodes, all real gRPC servers on 127.0.0.1: TLS on the public port
(gRPC and HTTPS), the API key on both fronts, mutual TLS and the cluster token between the gateway and the
nodes. Plaintext, anonymous or token-less callers are refused with the status each front promises."""

from __future__ import annotations

import contextlib
import functools
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gateway"))  # scripted_nodes

from scripted_nodes import KVBoard, Script, ScriptedDecode, ScriptedPrefill, free_port, run_async

from common.config.settings import SecuritySettings
from common.serving.channel import open_channel
from common.serving.security import (
    ChannelFactory,
    bearer_metadata,
    channel_credentials,
    internal_auth,
    server_credentials,
)
from common.serving.server import RunningServer, start_server
from common.serving.status import StatusInterceptor
from decode_service.server import INTERNAL_SERVICES
from gateway.model import ServedModel
from gateway.server import serve_gateway
from gateway.settings import GatewaySettings
from prefill_service.server import PREFILL_SERVICE
from tandem.v1 import (
    common_pb2,
    decode_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    membership_pb2,
    membership_pb2_grpc,
    prefill_pb2_grpc,
)
from tests.security.certs import Pki

pytestmark = pytest.mark.real_model  # the bundled model's tokenizer

API_KEY = "sk-tandem-test"
TOKEN = "cluster-secret"
TEXT = " The quick brown fox jumps over the lazy dog."


@dataclass
class Secured:
    gateway: RunningServer
    nodes: dict[str, RunningServer]
    public_tls: grpc.ChannelCredentials  # what a client that trusts the CA uses


@contextlib.asynccontextmanager
async def secured_cluster(model: ServedModel, model_dir: Path, pki: Pki) -> AsyncIterator[Secured]:
    node_security = SecuritySettings(pki.server.cert, pki.server.key, pki.ca, internal_token=TOKEN)
    board, script = KVBoard(), Script(model.tokenizer.encode(TEXT, add_special_tokens=False))
    prefill, decode = ScriptedPrefill("prefill-0", board, script), ScriptedDecode("decode-0", board, script)
    credentials = server_credentials(node_security, internal=True)
    nodes = {
        "prefill-0": await start_server(
            [functools.partial(prefill_pb2_grpc.add_PrefillServicer_to_server, prefill)], [PREFILL_SERVICE],
            "127.0.0.1", 0, interceptors=[*internal_auth(node_security, [PREFILL_SERVICE]), StatusInterceptor()],
            credentials=credentials),
        "decode-0": await start_server(
            [functools.partial(decode_pb2_grpc.add_DecodeServicer_to_server, decode)], list(INTERNAL_SERVICES[:1]),
            "127.0.0.1", 0, interceptors=[*internal_auth(node_security, INTERNAL_SERVICES), StatusInterceptor()],
            credentials=credentials),
    }
    settings = GatewaySettings(model_dir=model_dir, model_name=model.name, port=0, http_port=free_port(),
                               prefill_targets=(nodes["prefill-0"].address,),
                               decode_targets=(nodes["decode-0"].address,), api_key=API_KEY,
                               local_prefill_max_tokens=0,  # scripted nodes: the decode node only reserves
                               internal_port=free_port())  # Membership, guarded like the nodes' services
    gateway_security = SecuritySettings(pki.client.cert, pki.client.key, pki.ca, internal_token=TOKEN)
    gateway = await serve_gateway(settings, model, gateway_security)
    try:
        yield Secured(gateway, nodes, channel_credentials(SecuritySettings(tls_ca=pki.ca)))  # type: ignore[arg-type]
    finally:
        await gateway.stop(0)
        for node in nodes.values():
            await node.stop(0)


def _request() -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(max_tokens=4))


async def _generate(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> str:
    stub = generate_pb2_grpc.TandemStub(channel)
    return "".join([r.text async for r in stub.Generate(_request(), metadata=metadata, timeout=10)])


def test_grpc_front_wants_tls_and_the_api_key(served_model: ServedModel, smollm2_dir: Path, pki: Pki) -> None:
    async def scenario() -> None:
        async with secured_cluster(served_model, smollm2_dir, pki) as c:
            address = c.gateway.address
            async with open_channel(address, credentials=c.public_tls) as channel:
                # Through TLS to the gateway, mutual TLS + the cluster token to both nodes.
                text = await _generate(channel, bearer_metadata(API_KEY))
                assert text == served_model.tokenizer.decode(
                    served_model.tokenizer.encode(TEXT, add_special_tokens=False)[:4])
                for metadata, why in (((), "missing the API key"), (bearer_metadata("sk-wrong"), "API key is wrong")):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _generate(channel, metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert why in (info.value.details() or "")
                # Health checking stays open (load balancers and `tandem health` carry no key).
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with open_channel(address) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _generate(plaintext, bearer_metadata(API_KEY))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    run_async(scenario(), 60)


def test_http_front_answers_401_with_an_openai_error(served_model: ServedModel, smollm2_dir: Path,
                                                     pki: Pki) -> None:
    async def scenario() -> None:
        async with secured_cluster(served_model, smollm2_dir, pki) as c:
            url = c.gateway.http_url
            assert url.startswith("https://")
            verify = ssl.create_default_context(cafile=str(pki.ca))
            body = {"model": served_model.name, "prompt": "Hi", "max_tokens": 4}
            async with httpx.AsyncClient(verify=verify, timeout=10) as http:
                assert (await http.get(f"{url}/health")).status_code == 200  # open
                for headers in ({}, {"authorization": "Bearer sk-wrong"}):
                    response = await http.post(f"{url}/v1/completions", json=body, headers=headers)
                    assert response.status_code == 401
                    assert response.headers["www-authenticate"] == "Bearer"
                    error = response.json()["error"]
                    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
                    assert (await http.get(f"{url}/v1/models", headers=headers)).status_code == 401
                ok = await http.post(f"{url}/v1/completions", json=body,
                                     headers={"authorization": f"Bearer {API_KEY}"})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            async with httpx.AsyncClient(timeout=10) as http:  # the system's roots do not know the test CA
                with pytest.raises(httpx.ConnectError):
                    await http.get(f"{url}/health")

    run_async(scenario(), 60)


def test_internal_services_refuse_callers_without_the_cluster_credential(served_model: ServedModel,
                                                                         smollm2_dir: Path, pki: Pki) -> None:
    async def scenario() -> None:
        async with secured_cluster(served_model, smollm2_dir, pki) as c:
            target = c.nodes["decode-0"].address
            member_no_token = SecuritySettings(pki.client.cert, pki.client.key, pki.ca)
            async with ChannelFactory(member_no_token)(target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "TANDEM_INTERNAL_TOKEN" in (info.value.details() or "")
            for stranger in (SecuritySettings(pki.rogue.cert, pki.rogue.key, pki.ca, internal_token=TOKEN),
                             SecuritySettings(tls_ca=pki.ca, internal_token=TOKEN)):
                async with ChannelFactory(stranger)(target) as channel:  # the token alone is not enough
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # refused in the TLS handshake
            member = SecuritySettings(pki.client.cert, pki.client.key, pki.ca, internal_token=TOKEN)
            async with ChannelFactory(member)(c.nodes["prefill-0"].address) as channel:
                stats = await prefill_pb2_grpc.PrefillStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
                assert stats.node_id == "prefill-0"

    run_async(scenario(), 60)


def test_the_gateways_membership_port_wants_the_cluster_credential(served_model: ServedModel, smollm2_dir: Path,
                                                                   pki: Pki) -> None:
    """Registering or draining nodes is the cluster's business: mutual TLS and the token, as on the nodes."""

    async def drain(security: SecuritySettings, target: str) -> grpc.StatusCode:
        async with ChannelFactory(security)(target) as channel:
            try:
                await membership_pb2_grpc.MembershipStub(channel).Drain(
                    membership_pb2.DrainRequest(node_id="decode-9"), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    async def scenario() -> None:
        async with secured_cluster(served_model, smollm2_dir, pki) as c:
            internal = c.gateway.internal_address
            member = SecuritySettings(pki.client.cert, pki.client.key, pki.ca, internal_token=TOKEN)
            assert await drain(member, internal) == grpc.StatusCode.NOT_FOUND  # let in: the node is unknown
            assert await drain(SecuritySettings(pki.client.cert, pki.client.key, pki.ca),
                               internal) == grpc.StatusCode.UNAUTHENTICATED
            for stranger in (SecuritySettings(pki.rogue.cert, pki.rogue.key, pki.ca, internal_token=TOKEN),
                             SecuritySettings(tls_ca=pki.ca, internal_token=TOKEN)):
                assert await drain(stranger, internal) == grpc.StatusCode.UNAVAILABLE  # the TLS handshake
            assert await drain(member, c.gateway.address) == grpc.StatusCode.UNIMPLEMENTED  # not on the public port

    run_async(scenario(), 60)
