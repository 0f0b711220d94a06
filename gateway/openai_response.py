"""The OpenAI answers (JSON objects) built from a request's output chunks: the HTTP front's ``to_json`` edge.

``Completion`` follows one request's choices (its ``n`` samples): ``stream_chunk`` turns one output chunk
into a ``chat.completion.chunk`` / streamed ``text_completion`` object, ``response`` the collected
choices into a whole ``chat.completion`` / ``text_completion``, ``usage_chunk`` the stream's last chunk
when ``stream_options.include_usage`` asks for it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.tokenizer import Tokenizer
from gateway.openai_request import OpenAIRequest
from gateway.output import OutputChunk, Usage
from gateway.request import GatewayRequest
from gateway.request_runner import finish_reason_name
from tandem.v1 import common_pb2

Json = dict[str, Any]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    started: bool = False  # a streamed chat choice's first chunk carries the role


class Completion:
    """One request's answer, in the OpenAI shape the request asked for."""

    def __init__(self, request: OpenAIRequest, tokenizer: Tokenizer, model: str) -> None:
        self._request = request
        self._tokenizer = tokenizer
        self._model = model
        self.id = f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._choices: dict[int, _Choice] = {}
        self._token_text: dict[int, str] = {}

    def add(self, chunk: OutputChunk, req: GatewayRequest) -> _Choice:
        """Record ``chunk`` of sample ``req.index``; return its choice."""
        choice = self._choices.setdefault(req.index, _Choice())
        choice.text.append(chunk.text)
        choice.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            choice.finish_reason = finish_reason_name(chunk.finish_reason)
            choice.usage = chunk.usage
        return choice

    def stream_chunk(self, chunk: OutputChunk, req: GatewayRequest) -> Json:
        choice = self.add(chunk, req)
        out: Json = {"index": req.index, "logprobs": self._logprobs(chunk.logprobs),
                     "finish_reason": finish_reason_name(chunk.finish_reason) if chunk.finish_reason else None}
        if self._request.chat:
            delta: Json = {"content": chunk.text} if chunk.text or not choice.started else {}
            if not choice.started:
                delta = {"role": "assistant", **delta}
                choice.started = True
            out["delta"] = delta
        else:
            out["text"] = chunk.text
        return self._envelope([out], stream=True, usage=None)

    def usage_chunk(self) -> Json:
        return self._envelope([], stream=True, usage=self.usage())

    def response(self) -> Json:
        choices = []
        for index in sorted(self._choices):
            c = self._choices[index]
            text = "".join(c.text)
            out: Json = {"index": index, "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason}
            if self._request.chat:
                out["message"] = {"role": "assistant", "content": text}
            else:
                out["text"] = text
            choices.append(out)
        return self._envelope(choices, stream=False, usage=self.usage())

    def usage(self) -> Json:
        """The prompt counts once for all ``n`` samples; the completions add up."""
        usages = [c.usage for c in self._choices.values() if c.usage is not None]
        prompt = usages[0].prompt_tokens if usages else 0
        completion = sum(u.completion_tokens for u in usages)
        cached = max((u.cached_tokens for u in usages), default=0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _envelope(self, choices: list[Json], stream: bool, usage: Json | None) -> Json:
        if self._request.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        out: Json = {"id": self.id, "object": kind, "created": self._created, "model": self._model,
                     "choices": choices}
        if not stream or self._request.include_usage:
            out["usage"] = usage
        return out

    def _logprobs(self, logprobs: list[common_pb2.TokenLogprob]) -> Json | None:
        if self._request.logprobs is None:
            return None
        if self._request.chat:
            return {"content": [self._chat_logprob(lp) for lp in logprobs]}
        return {"tokens": [self._text(lp.token_id) for lp in logprobs],
                "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._text(t.token_id): t.logprob for t in lp.top} for lp in logprobs]}

    def _chat_logprob(self, lp: common_pb2.TokenLogprob) -> Json:
        text = self._text(lp.token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._text(top.token_id)), "logprob": top.logprob,
                                  "bytes": list(t.encode())} for top in lp.top]}

    def _text(self, token_id: int) -> str:
        """A token as text (its own decoding, special tokens kept); cached, as a vocabulary is small."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text
