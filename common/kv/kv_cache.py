"""The paged KV tensors of one node.

Layout: one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (2 = K, V).

Why block-major: a block's K and V for every layer are one contiguous region, so a run of consecutive
block ids is one contiguous slice of memory. KV transfer sends such a run with a single
``send`` of a view (no gather copy) and the receiver lands it with a single ``recv`` straight into the
reserved blocks. Attention sees per-layer views ``[num_blocks, block_size, num_kv_heads, head_dim]``
whose block stride is ``num_layers * 2 * block_size * num_kv_heads * head_dim`` elements; every backend
takes strides, so the views are never copied.

Same-host KV transfer: a CPU cache can live in a shared-memory segment (``share_memory``) that prefill
processes on the same machine map and copy blocks into; the segment also holds one grant word per block
(kv_transfer/block_grants.py). The cache owns the segment and unlinks it at ``close``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from common.kv.shared_segment import SharedSegment


@dataclass(frozen=True)
class KVCacheSpec:
    """What a KV block holds; two nodes can exchange blocks only when their specs are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_name: str  # "float32" | "bfloat16" | "float16" ...

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def elements_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    def bytes_per_block(self, element_size: int) -> int:
        return self.elements_per_block * element_size


class KVCache:
    """Owns the paged KV tensor and hands out per-layer views and block runs."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu",
                 shared: bool = False) -> None:
        """``shared``: allocate the tensor in a shared-memory segment right away (CPU only; see ``share_memory``)."""
        import torch

        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        dtype = getattr(torch, spec.dtype_name)
        # data: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.segment: SharedSegment | None = None
        if shared and torch.device(device).type == "cpu":
            # Straight into the segment (zero-filled by the kernel): no private copy zeroed, then copied over.
            from common.kv.shared_segment import SharedSegment

            self.segment = SharedSegment.create(num_blocks * spec.bytes_per_block(dtype.itemsize), num_slots=num_blocks)
            self.data = self.segment.data().view(dtype).view(shape)
            return
        if torch.device(device).type == "cpu" and not shared:
            from common.kernels.host_malloc import huge_pages

            # Huge pages asked for before the zeros are written (common/kernels/host_malloc.py).
            self.data = torch.empty(shape, dtype=dtype, device=device)
            huge_pages(self.data)
            self.data.zero_()
            return
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        if shared:
            self.share_memory()  # raises ValueError: not on CPU

    @classmethod
    def mapped(cls, spec: KVCacheSpec, num_blocks: int, segment: SharedSegment) -> KVCache:
        """The KV cache another process shares in ``segment``, viewed in place (a rank of a parallel node).

        This process does not own the segment: ``close`` leaves it to its owner."""
        import torch

        cache = cls.__new__(cls)
        cache.spec, cache.num_blocks, cache.segment = spec, num_blocks, None
        shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        cache.data = segment.data().view(getattr(torch, spec.dtype_name)).view(shape)
        return cache

    def share_memory(self) -> SharedSegment:
        """Move the KV tensor into a new shared-memory segment (contents kept) and return it; idempotent.

        ``data`` is rebound, so call it before anything keeps a view of ``data`` (``layer`` views are taken
        per forward). Raises SharedMemoryUnavailable (no /dev/shm, too small) or ValueError (not on CPU).
        """
        from common.kv.shared_segment import SharedSegment

        if self.segment is not None:
            return self.segment
        if self.data.device.type != "cpu":
            raise ValueError(f"only a CPU KV cache can live in shared memory, this one is on {self.data.device}")
        segment = SharedSegment.create(self.nbytes, num_slots=self.num_blocks)
        data = segment.data().view(self.data.dtype).view(self.data.shape)
        data.copy_(self.data)
        self.data, self.segment = data, segment
        return segment

    def close(self) -> None:
        """Unlink the shared-memory segment, if any (the tensor stays valid in this process)."""
        if self.segment is not None:
            self.segment.close()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) views, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        views = self.__dict__.get("_layer_views")
        if views is None or views[0] is not self.data:  # made once per tensor: every layer asks every step
            views = (self.data, [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(self.spec.num_layers)])
            self.__dict__["_layer_views"] = views
        return views[1][layer_idx]

    def blocks(self, start: int, stop: int) -> torch.Tensor:
        """The contiguous view of blocks ``start..stop-1`` (all layers): the unit KV transfer moves."""
        assert 0 <= start < stop <= self.num_blocks
        return self.data[start:stop]

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of arbitrary blocks, ``[len(block_ids), num_layers, 2, ...]``."""
        import torch

        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.index_select(0, index)

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write ``blocks`` (as returned by ``gather``) into ``block_ids``."""
        import torch

        assert blocks.shape[0] == len(block_ids) and blocks.shape[1:] == self.data.shape[1:]
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(0, index, blocks.to(self.data.dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write support: for each (src, dst) copy block src into block dst."""
        for src, dst in pairs:
            self.data[dst].copy_(self.data[src])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V into their cache slots.

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (strided views)
    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64
    """
    block_size = key_cache.shape[1]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Advanced indexing on two leading dims writes in place through the strided view.
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)
