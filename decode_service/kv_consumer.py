"""The decode node's role: a prompt's KV arrives from a prefill node into blocks reserved for it."""

from __future__ import annotations

import threading
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

    Each reserved request's transfer is tracked from its reservation (``track_load``) to its end, which the
    KV receiver reports (``load_finished``, from its own thread, once no recv is in flight and the blocks are
    this node's again): the engine's next step starts the request, or aborts it.
    """

    role = "decode"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._requests: dict[str, str] = {}  # transfer id -> request id
        self._transfers: dict[str, str] = {}  # request id -> transfer id

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not request.remote_prefill or request.output_token_ids:
            return 0
        return request.num_prompt_tokens - num_computed_tokens

    def track_load(self, request_id: str, transfer_id: str) -> None:
        with self._lock:
            self._requests[transfer_id] = request_id
            self._transfers[request_id] = transfer_id

    def load_finished(self, transfer_id: str, first_token: int | None, error: str | None) -> None:
        """The transfer ended: landed with the prefill's ``first_token``, or failed (``error``). Thread-safe;
        a transfer no request waits for any more (aborted, or already reported) is ignored."""
        with self._lock:
            request_id = self._requests.pop(transfer_id, None)
            if request_id is not None:
                del self._transfers[request_id]
        if request_id is None:
            return
        if error is None and first_token is not None:
            self.finished.loaded(request_id, first_token)
        else:
            self.finished.failed(request_id, error or "the transfer ended without its first token")

    def forget(self, request_id: str) -> None:
        with self._lock:
            transfer_id = self._transfers.pop(request_id, None)
            if transfer_id is not None:
                del self._requests[transfer_id]
