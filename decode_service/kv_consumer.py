"""The decode node's role: a prompt's KV arrives from a prefill node into blocks reserved for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.kv_connector import KVConnector

if TYPE_CHECKING:
    from common.engine.request import Request


class KVConsumer(KVConnector):
    """Decode role (vLLM's ``kv_consumer``): a ``remote_prefill`` request's uncached prompt KV comes from a
    prefill node.

    Until its first token (sampled by the prefill) is appended, a remote request has never had its KV land,
    so all its uncached prompt tokens are remote; after that a preempted request is recomputed here. A
    request without ``remote_prefill`` (conditional disaggregation: a short prompt) is computed here.
    """

    role = "decode"

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not request.remote_prefill or request.output_token_ids:
            return 0
        return request.num_prompt_tokens - num_computed_tokens
