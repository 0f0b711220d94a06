"""The decode node's role: a prompt's KV arrives from a prefill node into blocks reserved for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.kv_connector import KVConnector

if TYPE_CHECKING:
    from common.engine.request import Request


class KVConsumer(KVConnector):
    """Decode role (vLLM's ``kv_consumer``): a new request's uncached prompt KV comes from a prefill node.

    A request with no output yet has never had its KV land, so all its uncached prompt tokens are remote;
    once the first token (sampled by the prefill) is appended, a preempted request is recomputed here.
    """

    role = "decode"

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if request.output_token_ids:
            return 0
        return request.num_prompt_tokens - num_computed_tokens
