"""A Generate request, validated and tokenized: the gateway's one ``from_proto`` edge for client input.

Every rejection is an ``InvalidRequestError`` whose field is spelled as on the wire (``text``,
``sampling.top_p``, ``stop[2]``) and whose message states the limit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace

from jinja2 import TemplateError

from common.errors import InvalidRequestError
from common.protocol import sampling_from_proto
from common.sampling.params import SamplingParams, SamplingParamsError
from gateway.model import ServedModel
from tandem.v1 import common_pb2, generate_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_SAMPLES = 16  # n: samples of one prompt
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens


@dataclass(frozen=True)
class GatewayRequest:
    """What the gateway needs to run one generation."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    include_stop_string: bool = False
    include_token_ids: bool = False
    skip_text: bool = False
    n: int = 1  # samples of this prompt; ``samples()`` makes one request per sample
    index: int = 0  # this sample's position among them (a sample has n == 1)
    sample_of: str = ""  # a sample's parent request id: what the client sees as its id

    @property
    def want_logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    @property
    def client_request_id(self) -> str:
        return self.sample_of or self.request_id

    def samples(self) -> tuple[GatewayRequest, ...]:
        """One request per sample, each with its own id (``<id>-<i>``) and, when seeded, seed ``seed + i``
        (so that the samples differ yet are reproducible); ``n == 1`` is its own only sample."""
        if self.n == 1:
            return (self,)
        seed = self.sampling.seed
        return tuple(
            replace(self, request_id=f"{self.request_id}-{i}", n=1, index=i, sample_of=self.request_id,
                    sampling=self.sampling if seed is None else replace(self.sampling, seed=(seed + i) % 2**63))
            for i in range(self.n))

    @staticmethod
    def from_proto(msg: generate_pb2.GenerateRequest, model: ServedModel,
                   default_max_tokens: int = DEFAULT_MAX_TOKENS) -> GatewayRequest:
        """Validate ``msg`` against ``model``; tokenize text and chat input.

        An unset ``sampling.max_tokens`` is ``default_max_tokens``, shrunk to what fits the model.
        """
        if msg.model and msg.model != model.name:
            raise InvalidRequestError("model", f"unknown model {msg.model!r}; this server serves {model.name!r}")
        request_id = _request_id(msg.request_id)
        field, prompt = _prompt_token_ids(msg, model)
        limit = model.max_model_len - 1  # room for at least the first generated token
        if len(prompt) > limit:
            raise InvalidRequestError(field, f"prompt has {len(prompt)} tokens, limit {limit} "
                                             f"(max_model_len {model.max_model_len} minus 1 token to generate)")
        room = model.max_model_len - len(prompt)
        # An unset max_tokens shrinks to fit the model (as vLLM does); an explicit one that cannot fit fails.
        sampling = _sampling(msg.sampling, min(default_max_tokens, room), model.vocab_size)
        if sampling.max_tokens > room:
            raise InvalidRequestError("sampling.max_tokens",
                                      f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                                      f"max_model_len {model.max_model_len}; at most {room}")
        return GatewayRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt),
            sampling=sampling,
            stop=_stop_strings(msg.stop),
            include_stop_string=msg.include_stop_string,
            include_token_ids=msg.stream.include_token_ids,
            skip_text=msg.stream.skip_text,
            n=_num_samples(msg.n),
        )


def _num_samples(n: int) -> int:
    if n > MAX_SAMPLES:
        raise InvalidRequestError("n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    return n or 1  # unset (0) is one sample


def _request_id(given: str) -> str:
    if not given:
        return uuid.uuid4().hex
    if len(given) > MAX_REQUEST_ID_CHARS or not given.isprintable():
        raise InvalidRequestError("request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
    return given


def _sampling(msg: common_pb2.SamplingParams, default_max_tokens: int, vocab_size: int) -> SamplingParams:
    try:
        params = sampling_from_proto(msg, default_max_tokens)
        params.check_vocab(vocab_size)
        return params
    except SamplingParamsError as exc:
        # Name the field as the client spells it: inside the request's ``sampling`` message.
        raise InvalidRequestError(f"sampling.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None


def _prompt_token_ids(msg: generate_pb2.GenerateRequest, model: ServedModel) -> tuple[str, list[int]]:
    """The input's field name and its token ids."""
    kind = msg.WhichOneof("input")
    tokenizer = model.tokenizer
    if kind == "text":
        if not msg.text:
            raise InvalidRequestError("text", "must not be empty")
        ids = tokenizer.encode(msg.text)
    elif kind == "token_ids":
        ids = list(msg.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids", "must not be empty")
        bad = [i for i in ids if i >= model.vocab_size]
        if bad:
            raise InvalidRequestError("token_ids", f"ids must be < vocab_size={model.vocab_size}, got {bad[:4]}")
    elif kind == "chat":
        ids = chat_token_ids(msg.chat, model)
    else:
        raise InvalidRequestError("input", "one of text, token_ids or chat is required")
    if not ids:
        raise InvalidRequestError(kind, "encodes to no tokens")
    return kind, ids


def chat_token_ids(chat: generate_pb2.ChatInput, model: ServedModel) -> list[int]:
    """Render ``chat`` with the model's template and tokenize it (Generate and Tokenize share this)."""
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "must not be empty")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidRequestError(f"chat.messages[{i}].role", "must not be empty")
    if model.tokenizer.chat_template is None:
        raise InvalidRequestError("chat", f"model {model.name!r} has no chat template; send text or token_ids")
    try:
        return model.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in chat.messages])
    except TemplateError as exc:
        raise InvalidRequestError("chat", f"the model's chat template rejected the messages: {exc}") from None


def _stop_strings(stop: Iterable[str]) -> tuple[str, ...]:
    strings = tuple(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    for i, s in enumerate(strings):
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"stop[{i}]", f"must be 1 to {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
    return tuple(dict.fromkeys(strings))  # duplicates change nothing
