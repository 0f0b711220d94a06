"""The public gRPC front door: tokenize, validate, route, relay streams, cancel. Imports no torch.

Entry points: ``gateway.server.serve_gateway`` / ``run_gateway`` with ``gateway.settings.GatewaySettings``.
"""
