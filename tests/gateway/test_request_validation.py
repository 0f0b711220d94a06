"""Generate input validation: every rejection names the wire field and states the limit."""

from __future__ import annotations

import dataclasses

import pytest

from common.errors import InvalidRequestError
from common.sampling.params import SamplingParams
from gateway.model import ServedModel
from gateway.request import GatewayRequest
from tandem.v1 import common_pb2, generate_pb2

pytestmark = pytest.mark.real_model

S = common_pb2.SamplingParams
G = generate_pb2.GenerateRequest


def reject(msg: generate_pb2.GenerateRequest, model: ServedModel) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        GatewayRequest.from_proto(msg, model)
    return err.value


@pytest.mark.parametrize(("msg", "field", "fragment"), [
    (G(), "input", "one of text, token_ids or chat"),
    (G(text=""), "text", "must not be empty"),
    (G(token_ids=generate_pb2.TokenIds()), "token_ids", "must not be empty"),
    (G(token_ids=generate_pb2.TokenIds(ids=[5, 49152])), "token_ids", "vocab_size=49152"),
    (G(chat=generate_pb2.ChatInput()), "chat.messages", "must not be empty"),
    (G(chat=generate_pb2.ChatInput(messages=[generate_pb2.ChatMessage(content="hi")])), "chat.messages[0].role", ""),
    (G(text="hi", model="gpt-4"), "model", "unknown model 'gpt-4'"),
    (G(text="hi", sampling=S(max_tokens=0)), "sampling.max_tokens", "must be >= 1, got 0"),
    (G(text="hi", sampling=S(top_p=1.5)), "sampling.top_p", "must be in (0, 1], got 1.5"),
    (G(text="hi", sampling=S(temperature=-0.5)), "sampling.temperature", "got -0.5"),
    (G(text="hi", sampling=S(logprobs=21)), "sampling.logprobs", "[0, 20]"),
    (G(text="hi", sampling=S(stop_token_ids=[60000])), "sampling.stop_token_ids", "vocab_size=49152"),
    (G(text="hi", stop=["ok", ""]), "stop[1]", "1 to 256 characters"),
    (G(text="hi", stop=[str(i) for i in range(17)]), "stop", "at most 16"),
    (G(text="hi", request_id="x" * 129), "request_id", "at most 128"),
])
def test_bad_input_names_the_field(served_model: ServedModel, msg: generate_pb2.GenerateRequest, field: str,
                                   fragment: str) -> None:
    err = reject(msg, served_model)
    assert err.field == field
    assert str(err).startswith(f"{field}: ") and fragment in str(err)


def test_prompt_length_limit_and_max_tokens_room(served_model: ServedModel) -> None:
    model = dataclasses.replace(served_model, max_model_len=40)
    err = reject(G(token_ids=generate_pb2.TokenIds(ids=[7] * 40)), model)
    assert str(err) == "token_ids: prompt has 40 tokens, limit 39 (max_model_len 40 minus 1 token to generate)"
    # Unset max_tokens shrinks to the room left (as vLLM does); an explicit one that does not fit fails.
    assert GatewayRequest.from_proto(G(token_ids=generate_pb2.TokenIds(ids=[7] * 39)), model).sampling.max_tokens == 1
    assert GatewayRequest.from_proto(G(token_ids=generate_pb2.TokenIds(ids=[7] * 10)), model).sampling.max_tokens == 16
    err = reject(G(token_ids=generate_pb2.TokenIds(ids=[7] * 30), sampling=S(max_tokens=11)), model)
    assert err.field == "sampling.max_tokens" and "at most 10" in str(err)


def test_good_requests(served_model: ServedModel) -> None:
    tok = served_model.tokenizer
    req = GatewayRequest.from_proto(G(text="Hello there", model=served_model.name, stop=["a", "a", "b"],
                                      sampling=S(temperature=0.5, top_k=0, max_tokens=5)), served_model)
    assert req.prompt_token_ids == tuple(tok.encode("Hello there"))
    assert req.sampling == SamplingParams(temperature=0.5, max_tokens=5)  # top_k 0 = off
    assert req.stop == ("a", "b") and len(req.request_id) == 32
    chat = GatewayRequest.from_proto(G(chat=generate_pb2.ChatInput(messages=[
        generate_pb2.ChatMessage(role="user", content="Hi")]), request_id="r-1"), served_model)
    assert chat.prompt_token_ids == tuple(tok.encode_chat([{"role": "user", "content": "Hi"}]))
    assert chat.request_id == "r-1"
