"""Moves KV blocks from prefill nodes into decode nodes' reserved blocks; knows nothing about scheduling.

Control plane: protobuf over one gRPC ``KVTransfer.Connect`` stream per prefill/decode pair (never pickle).
Data plane: one 2-rank torch.distributed process group per pair (gloo for CPU tensors, NCCL for CUDA),
made on demand on a TCPStore the decode node hosts.
"""

from kv_transfer.errors import TransferFailed
from kv_transfer.layout import PROTOCOL_VERSION, layout_mismatch, make_layout, model_fingerprint
from kv_transfer.receiver import KVReceiver
from kv_transfer.receiver_transfer import TransferResult
from kv_transfer.sender import KVSender, TransferHandle, TransferStats

__all__ = [
    "PROTOCOL_VERSION",
    "KVReceiver",
    "KVSender",
    "TransferFailed",
    "TransferHandle",
    "TransferResult",
    "TransferStats",
    "layout_mismatch",
    "make_layout",
    "model_fingerprint",
]
