"""A CUDA KV tensor shared with a same-host process by IPC handle, as protobuf fields (never pickled).

One GPU cannot hold both ranks of an NCCL pair, so a prefill and a decode node on one device (or one host)
share the decode node's KV tensor instead: ``export`` turns torch's own IPC description of the tensor's
storage (``UntypedStorage._share_cuda_``: allocation handle, offsets, ref-counter file, event) into a
``CudaIpcHandle`` message, and ``open_tensor`` rebuilds a tensor over the same device memory in the peer
(``UntypedStorage._new_shared_cuda``). The exporter's storage stays alive while peers hold it (torch's
ref counter), and the decode node keeps its KV tensor for its whole life anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.v1 import kv_transfer_pb2

if TYPE_CHECKING:
    import torch


def export(tensor: torch.Tensor) -> kv_transfer_pb2.CudaIpcHandle:
    """The IPC description of a contiguous CUDA tensor's memory."""
    assert tensor.is_cuda and tensor.is_contiguous()
    (device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = tensor.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    return kv_transfer_pb2.CudaIpcHandle(
        device=device, handle=handle, storage_bytes=storage_bytes, storage_offset_bytes=storage_offset_bytes,
        ref_counter_handle=ref_counter_handle, ref_counter_offset=ref_counter_offset,
        event_handle=event_handle or b"", event_sync_required=event_sync_required,
        tensor_offset=int(tensor.storage_offset()),
    )


def open_tensor(ipc: kv_transfer_pb2.CudaIpcHandle, dtype: torch.dtype,
                shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous ``shape`` tensor over the exporter's memory (on the exporter's device ordinal)."""
    import torch

    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        ipc.device, ipc.handle, ipc.storage_bytes, ipc.storage_offset_bytes, ipc.ref_counter_handle,
        ipc.ref_counter_offset, ipc.event_handle or None, ipc.event_sync_required,
    )
    numel = 1
    for size in shape:
        numel *= size
    if (ipc.tensor_offset + numel) * dtype.itemsize > ipc.storage_bytes:
        raise ValueError(f"CUDA IPC storage of {ipc.storage_bytes} bytes cannot hold a {shape} {dtype} tensor")
    stride = torch.empty(shape, device="meta").stride()
    return torch.empty(0, dtype=dtype, device=f"cuda:{ipc.device}").set_(storage, ipc.tensor_offset, shape, stride)
