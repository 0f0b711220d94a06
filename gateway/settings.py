"""The gateway's configuration: one frozen dataclass, filled by ``load_settings`` from flags and ``TANDEM_*``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from common.config.settings import env_name
from common.serving.channel import format_address
from gateway.prefill_policy import DEFAULT_LOCAL_PREFILL_MAX_TOKENS

DEFAULT_MIGRATION_LIMIT = 3


def _targets(value: tuple[str, ...] | str, field: str) -> tuple[str, ...]:
    """Accept a tuple or a comma-separated string (as environment variables carry it)."""
    items = value.split(",") if isinstance(value, str) else value
    targets = tuple(t.strip() for t in items if t.strip())
    for target in targets:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{field}: {target!r} is not host:port ({env_name(field)} takes a comma-separated list)")
    if len(set(targets)) != len(targets):
        raise ValueError(f"{field}: duplicate targets in {list(targets)}")
    return targets


@dataclass(frozen=True)
class GatewaySettings:
    """Where the gateway listens, what it serves, which nodes it routes to, and its limits.

    ``queue_timeout_s`` and ``kv_timeout_s`` mean other things to a node (``NodeSettings``), and ``tandem up``
    hands one environment to every process: the gateway's are ``TANDEM_GATEWAY_QUEUE_TIMEOUT_S`` and
    ``TANDEM_GATEWAY_KV_TIMEOUT_S``."""

    ENV_ROLE: ClassVar[str] = "GATEWAY"
    ROLE_FIELDS: ClassVar[tuple[str, ...]] = ("queue_timeout_s", "kv_timeout_s")

    model_dir: Path | None = None  # the model's Hugging Face directory (tokenizer, config); required
    model_name: str = ""  # the name clients may send in ``model``; default: the directory's name
    host: str = "127.0.0.1"  # loopback by default; listening on other interfaces is an explicit choice
    port: int = 50051
    prefill_targets: tuple[str, ...] = ()  # host:port of each prefill node (env: comma-separated); fixed members
    decode_targets: tuple[str, ...] = ()
    # The internal gRPC port (Membership: nodes started with --gateway register on it, `tandem drain` calls it),
    # guarded like the nodes' services (mutual TLS with --tls-ca, the cluster token); 0: off (static nodes only).
    internal_port: int = 0
    node_drop_after_s: float = 10.0  # a registered node whose Stats polls fail this long leaves routing
    max_inflight: int = 256  # samples in progress (both fronts); beyond it new requests queue for a slot
    # Load the system can serve is queued, not refused (as vLLM's scheduler queues it): a burst of thousands waits
    # for slots until its own deadline. Both limits are there to bound a gateway under a flood, not a burst.
    max_queued: int = 16384  # requests waiting for a slot; one more gets RESOURCE_EXHAUSTED (HTTP 429); 0: no queue
    queue_timeout_s: float = 600.0  # the longest a request waits for a slot (within its own deadline)
    request_timeout_s: float = 600.0  # per Generate, or the client's deadline when that is sooner
    kv_timeout_s: float = 60.0  # a decode node frees a reservation whose KV has not arrived by then
    stats_interval_s: float = 1.0  # how often each node's Stats is polled for routing
    max_model_len: int = 0  # prompt + generated tokens; 0 = the model's max_position_embeddings
    affinity_capacity: int = 100_000  # block hashes remembered for prefix-affinity routing (LRU)
    affinity_load_slack: int = 4  # keep a prefix on its node unless that node has this many more requests
    shutdown_grace_s: float = 10.0  # in-flight streams get this long to finish on SIGTERM
    dtype: str = "auto"  # what ModelInfo reports; auto = config.json's torch_dtype
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0: off
    http_port: int = 0  # the OpenAI-compatible HTTP API on host:http_port; 0: off (`tandem up`: 8000)
    # Conditional disaggregation (gateway/prefill_policy.py): prompts up to this many tokens prefill on their
    # decode node, no KV transfer (unless it is busy prefilling long ones); longer ones too while the prefill
    # nodes' backlog would give their first token later. 0: never (every prompt to a prefill node).
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    # When a prompt's KV never reaches its decode node (the prefill node or the transfer failed before the
    # first token): fail the request, or recompute (the decode node prefills the prompt itself).
    kv_load_failure_policy: str = "fail"
    # Request migration: a stream whose decode node dies (or whose prefill node fails before its first token)
    # continues on other nodes from the prompt plus the tokens already streamed, at most this many times per
    # request; past it the request ends UNAVAILABLE. 0: never (every such request fails).
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    # Bearer token of the public API (gRPC Tandem service and HTTP /v1): "" = open (the loopback default).
    # Prefer the environment variable to the flag: a flag shows in `ps`.
    api_key: str = ""

    def __post_init__(self) -> None:
        # Environment variables arrive as strings; the dataclass is frozen, hence object.__setattr__.
        if isinstance(self.model_dir, str):
            object.__setattr__(self, "model_dir", Path(self.model_dir).expanduser())
        object.__setattr__(self, "prefill_targets", _targets(self.prefill_targets, "prefill_targets"))
        object.__setattr__(self, "decode_targets", _targets(self.decode_targets, "decode_targets"))
        if self.model_dir is None:
            raise ValueError(f"model_dir is required (--model-dir or {env_name('model_dir')})")
        for role in ("prefill", "decode"):
            if not getattr(self, f"{role}_targets") and not self.internal_port:
                raise ValueError(f"{role}_targets: at least one {role} node is required "
                                 f"({env_name(role + '_targets')}), or an internal_port "
                                 f"({env_name('internal_port')}) for nodes that register")
        for name in ("port", "metrics_port", "http_port", "internal_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(f"kv_load_failure_policy must be fail or recompute, got {self.kv_load_failure_policy!r}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.queue_timeout_s <= 0 or self.max_queued < 0:
            raise ValueError(f"queue_timeout_s must be > 0 and max_queued >= 0, got {self.queue_timeout_s}, "
                             f"{self.max_queued}")
        for name in ("max_inflight", "affinity_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "kv_timeout_s", "stats_interval_s", "node_drop_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0 (0: no migration), got {self.migration_limit}")
        if self.max_model_len < 0 or self.affinity_load_slack < 0 or self.shutdown_grace_s < 0:
            raise ValueError("max_model_len, affinity_load_slack and shutdown_grace_s must be >= 0")

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @property
    def internal_address(self) -> str:
        return format_address(self.host, self.internal_port)

    @property
    def served_model_name(self) -> str:
        assert self.model_dir is not None
        return self.model_name or self.model_dir.name
