"""The decode engine: reserves blocks for remote prefills, then decodes with continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.engine_core import EngineCore
from common.engine.request import Request, RequestOutput

if TYPE_CHECKING:
    from common.kv.kv_cache_manager import Allocation
    from common.sampling.params import SamplingParams


class DecodeEngine(EngineCore):
    """Requests enter through ``reserve`` (blocks for the prompt) and ``start_decoding`` (KV has landed)."""

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                eos_token_ids: tuple[int, ...] = ()) -> Allocation | None:
        """Reserve blocks for the prompt, reusing this node's prefix cache. None: no room right now."""
        self.validate(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, tuple(eos_token_ids))
        return self.scheduler.reserve(request)

    def start_decoding(self, request_id: str, first_token: int) -> RequestOutput:
        return self.scheduler.start_decoding(request_id, first_token)
