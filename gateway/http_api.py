"""The OpenAI-compatible HTTP API: the second public front of ``RequestRunner``, as a Starlette app.

    POST /v1/chat/completions, POST /v1/completions   (JSON, or server-sent events with "stream": true)
    GET  /v1/models, GET /health

A body becomes the same ``GenerateRequest`` a gRPC client sends (``gateway/openai_request.py``) and runs
through the same runner and backend; only the wire format differs. Errors are OpenAI error objects with
the HTTP status of the gRPC code the gRPC front would answer (``HTTP_STATUS``). A client that disconnects,
streaming or not, cancels its request (and so both nodes' legs) at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from common.errors import InvalidRequestError
from gateway.openai_request import OpenAIRequest
from gateway.openai_response import Completion
from gateway.output import OutputChunk
from gateway.request import GatewayRequest
from gateway.request_runner import RequestRunner

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.CANCELLED: 499,  # aborted (the nginx convention: no standard code says it)
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error",
               499: "cancelled", 503: "service_unavailable", 504: "timeout"}

# Why the server cannot take requests now (GET /health answers 503 with it), or None when it can.
Readiness = Callable[[], str | None]


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "internal_error"), "param": param,
                      "code": code}}


class HttpApi:
    """The routes over one runner; ``app`` is the ASGI application uvicorn serves."""

    def __init__(self, runner: RequestRunner, readiness: Readiness | None = None, api_key: str = "") -> None:
        """``api_key``: every route but GET /health requires ``Authorization: Bearer <api_key>``; "" = open."""
        self._runner = runner
        self._readiness = readiness or (lambda: None)
        self._created = int(time.time())
        routes = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ])
        self.app: ASGIApp = _BearerAuth(routes, api_key) if api_key else routes

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse(error_body(400, f"the body is not JSON: {exc}", "body"), 400)
        try:
            parsed = OpenAIRequest.parse(body, chat, request.headers.get("x-request-id", ""))
        except InvalidRequestError as exc:
            return JSONResponse(error_body(400, str(exc), exc.field), 400)
        model = self._runner.model
        if parsed.model != model.name:
            return JSONResponse(error_body(404, f"the model {parsed.model!r} does not exist; this server serves "
                                                f"{model.name!r}", "model", "model_not_found"), 404)
        return _GenerationResponse(self._runner, parsed)

    async def _models(self, request: Request) -> Response:
        m = self._runner.model
        return JSONResponse({"object": "list", "data": [{
            "id": m.name, "object": "model", "created": self._created, "owned_by": "tandem",
            "root": m.name, "max_model_len": m.max_model_len}]})

    async def _health(self, request: Request) -> Response:
        why = self._readiness()
        if why is not None:
            return JSONResponse(error_body(503, why), 503)
        return Response(status_code=200)


class _BearerAuth:
    """The HTTP front's one authentication check: ``Authorization: Bearer <api_key>`` on every request but
    the health check, else 401 with an OpenAI error object (as OpenAI answers a missing or wrong key)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self._app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):  # constant time
            await self._app(scope, receive, send)
            return
        message = ("Incorrect API key provided" if given is not None else
                   "Missing API key: send the header 'Authorization: Bearer <key>' (the gateway's --api-key)")
        response = JSONResponse(error_body(401, message, code="invalid_api_key"), 401,
                                headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)


class _GenerationResponse(Response):
    """Runs the request while it answers, and cancels it when the client disconnects first.

    Streaming, the status line waits for the first chunk, so that a request refused before it started
    (validation, admission, no node) still gets its HTTP status; a failure after that is sent as an
    ``error`` event before ``[DONE]``.
    """

    def __init__(self, runner: RequestRunner, request: OpenAIRequest) -> None:
        super().__init__()
        self._runner = runner
        self._request = request
        self._completion = Completion(request, runner.model.tokenizer, runner.model.name)
        self._send: Send | None = None
        self._started = False
        self._lock = asyncio.Lock()  # the n samples write concurrently

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        work = asyncio.create_task(self._answer(), name=f"http-{self._completion.id}")
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                log.info("%s: the client disconnected; cancelling", self._completion.id)
        finally:
            for task in (work, gone):
                task.cancel()
            for task in (work, gone):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _answer(self) -> None:
        r, runner = self._request, self._runner
        model = runner.model
        # Chat answers may run to the context's end when max_tokens is unset (as OpenAI's and vLLM's do);
        # completions keep the legacy default of 16 tokens.
        default_max_tokens = model.max_model_len if r.chat else None

        def build() -> GatewayRequest:
            if default_max_tokens is None:
                return GatewayRequest.from_proto(r.proto, model)
            return GatewayRequest.from_proto(r.proto, model, default_max_tokens)

        write = self._stream_chunk if r.stream else self._collect
        try:
            await runner.run(build, write, None, r.proto.request_id)
        except Exception as exc:
            status, body = self._error(exc)
            if self._started:
                await self._event(body)
                await self._end_stream()
            else:
                await self._start(status, "application/json")
                await self._body(json.dumps(body).encode(), more=False)
            return
        if r.stream:
            if not self._started:  # nothing was written (cannot happen: every request yields a first chunk)
                await self._start(200, "text/event-stream")
            if r.include_usage:
                await self._event(self._completion.usage_chunk())
            await self._end_stream()
        else:
            await self._start(200, "application/json")
            await self._body(json.dumps(self._completion.response()).encode(), more=False)

    def _error(self, exc: Exception) -> tuple[int, dict[str, Any]]:
        code, details = self._runner.status_for(exc)
        status = HTTP_STATUS.get(code, 500)
        if isinstance(exc, InvalidRequestError):
            field = self._request.openai_field(exc.field)
            return status, error_body(status, f"{field}: {str(exc).removeprefix(f'{exc.field}: ')}", field)
        return status, error_body(status, details)

    async def _collect(self, chunk: OutputChunk, req: GatewayRequest) -> None:
        self._completion.add(chunk, req)

    async def _stream_chunk(self, chunk: OutputChunk, req: GatewayRequest) -> None:
        async with self._lock:
            if not self._started:
                await self._start(200, "text/event-stream")
            await self._event(self._completion.stream_chunk(chunk, req))

    async def _start(self, status: int, content_type: str) -> None:
        assert self._send is not None and not self._started
        self._started = True
        headers = [(b"content-type", content_type.encode())]
        if content_type == "text/event-stream":
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def _event(self, data: dict[str, Any]) -> None:
        await self._body(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

    async def _end_stream(self) -> None:
        await self._body(b"data: [DONE]\n\n", more=False)

    async def _body(self, data: bytes, more: bool = True) -> None:
        assert self._send is not None
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


async def _disconnected(receive: Receive) -> None:
    """Return when the client goes away (the body was read already, so nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        pass
