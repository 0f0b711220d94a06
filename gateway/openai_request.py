"""An OpenAI ``/v1/chat/completions`` or ``/v1/completions`` body, as a ``tandem.v1`` GenerateRequest.

The HTTP front's one edge for client input: it checks the JSON's types and shapes, then builds the same
``GenerateRequest`` a gRPC client would send, so that validation (``GatewayRequest.from_proto``) is one
path for both fronts. ``openai_field`` spells that validation's field names as the OpenAI body does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from common.sampling.params import MAX_LOGPROBS
from tandem.v1 import generate_pb2

# OpenAI fields Tandem does not implement: refused (400) rather than silently ignored.
_UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "suffix", "logit_bias", "guided_json",
                "guided_regex", "guided_choice")


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed body: the GenerateRequest plus what only the HTTP answer needs."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str
    proto: generate_pb2.GenerateRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None  # top alternatives per token in the answer; None: no logprobs
    max_tokens_field: str  # which field set max_tokens, for error messages

    @staticmethod
    def parse(body: Any, chat: bool, request_id: str = "") -> OpenAIRequest:
        if not isinstance(body, dict):
            raise InvalidRequestError("body", "must be a JSON object")
        for name in _UNSUPPORTED:
            if body.get(name) not in (None, [], {}):
                raise InvalidRequestError(name, "is not supported by this server")
        model = _string(body, "model")
        if not model:
            raise InvalidRequestError("model", "is required")
        msg = generate_pb2.GenerateRequest(model=model, request_id=request_id)
        if chat:
            _messages(body, msg)
        else:
            _prompt(body, msg)
        sampling = msg.sampling
        max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, max_tokens_field)
        if max_tokens is not None:
            sampling.max_tokens = _nonnegative(max_tokens_field, max_tokens)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = _number(body, name)
            if value is not None:
                setattr(sampling, name, value)
        top_k = _integer(body, "top_k")
        if top_k is not None and top_k > 0:  # vLLM's convention: 0 or -1 is off
            sampling.top_k = _nonnegative("top_k", top_k)
        seed = _integer(body, "seed")
        if seed is not None:
            sampling.seed = _nonnegative("seed", seed, 2**63)
        min_tokens = _integer(body, "min_tokens")
        if min_tokens is not None:
            sampling.min_tokens = _nonnegative("min_tokens", min_tokens)
        sampling.ignore_eos = bool(_boolean(body, "ignore_eos"))
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None:
            if not isinstance(stop_ids, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in stop_ids):
                raise InvalidRequestError("stop_token_ids", "must be a list of token ids")
            sampling.stop_token_ids.extend(stop_ids)
        logprobs = _logprobs(body, chat)
        if logprobs is not None:
            sampling.logprobs = logprobs
        n = _integer(body, "n")
        if n is not None:
            if n < 1:
                raise InvalidRequestError("n", f"must be >= 1, got {n}")
            msg.n = _nonnegative("n", n)
        msg.stop.extend(_stop(body))
        msg.include_stop_string = bool(_boolean(body, "include_stop_str_in_output"))
        msg.stream.include_token_ids = True  # the answer's logprobs and usage are per token
        stream = bool(_boolean(body, "stream"))
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise InvalidRequestError("stream_options", "must be an object")
        include_usage = bool(_boolean(options or {}, "include_usage", "stream_options.include_usage"))
        return OpenAIRequest(chat=chat, model=model, proto=msg, stream=stream, include_usage=include_usage,
                             logprobs=logprobs, max_tokens_field=max_tokens_field)

    def openai_field(self, field: str) -> str:
        """A validation error's field (``sampling.top_p``, ``chat.messages[1].role``) as the body spells it."""
        if field in ("text", "token_ids", "input"):
            return "messages" if self.chat else "prompt"
        if field == "sampling.max_tokens":
            return self.max_tokens_field
        if field == "sampling.logprobs":
            return "top_logprobs" if self.chat else "logprobs"
        if field == "chat":
            return "messages"
        return field.removeprefix("sampling.").removeprefix("chat.")


def _messages(body: dict[str, Any], msg: generate_pb2.GenerateRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with a string role")
        msg.chat.messages.append(generate_pb2.ChatMessage(role=m["role"], content=_content(m.get("content"), i)))


def _content(content: Any, i: int) -> str:
    """A message's content: a string, null (an assistant turn without text), or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{i}].content[{j}]", "only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")


def _prompt(body: dict[str, Any], msg: generate_pb2.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        msg.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < 2**32 for t in prompt):
            raise InvalidRequestError("prompt", "token ids must be in [0, 2^32)")
        msg.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise InvalidRequestError("prompt", "batches of prompts are not supported; send one request per prompt")
    else:
        raise InvalidRequestError("prompt", "must be a string or a list of token ids")
    if _boolean(body, "echo"):
        raise InvalidRequestError("echo", "is not supported by this server")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Top alternatives per token: chat has ``logprobs: bool`` + ``top_logprobs``, completions ``logprobs: int``."""
    if chat:
        top = _integer(body, "top_logprobs")
        if not _boolean(body, "logprobs"):
            if top:
                raise InvalidRequestError("top_logprobs", "needs logprobs: true")
            return None
        value, field = top or 0, "top_logprobs"
    else:
        given = _integer(body, "logprobs")
        if given is None:
            return None
        value, field = given, "logprobs"
    if not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(field, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _nonnegative(field: str, value: int, limit: int = 2**32) -> int:
    """A value for an unsigned proto field (uint32 unless ``limit`` says otherwise)."""
    if not 0 <= value < limit:
        raise InvalidRequestError(field, f"must be in [0, {limit}), got {value}")
    return value


def _string(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(name, f"must be a string, got {type(value).__name__}")
    return value or ""


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(name, f"must be a number, got {type(value).__name__}")
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {type(value).__name__}")
    if abs(value) >= 2**63:
        raise InvalidRequestError(name, f"out of range: {value}")
    return value


def _boolean(body: dict[str, Any], name: str, label: str = "") -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(label or name, f"must be true or false, got {type(value).__name__}")
    return value

