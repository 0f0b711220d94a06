"""gRPC plumbing shared by the gateway and the prefill/decode services (grpc only, no torch).

- ``errors``: exceptions that carry a gRPC status (RESOURCE_EXHAUSTED, UNAVAILABLE, ...).
- ``status``: ``StatusInterceptor``, the one interceptor per service that maps exceptions to statuses.
- ``server``: ``start_server`` (health + reflection + graceful stop), signal handling, ``wait_for_health``.
- ``channel``: ``open_channel`` with reconnect/keepalive defaults for calls between services.

Trace-context interceptors live in ``common.telemetry.propagation``; ``start_server`` installs the server one.
"""
