"""Chained content hashes of full KV blocks, shared by the engines' prefix cache and the gateway's router.

The hash of block ``i`` covers the hash of block ``i - 1``, the block's token ids and an optional salt, so one
digest names a whole prefix: two prompts share a block hash exactly when they share every token up to the end
of that block (and the salt). The digest is deterministic across processes, hosts and Python runs (blake2b
over a fixed byte layout, never Python's randomised ``hash()``), because the gateway routes on hashes that the
prefill and decode nodes compute independently. This module imports only the standard library.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
"""A 16-byte blake2b digest naming one full block and, through chaining, the whole prefix before it."""

DIGEST_SIZE = 16

# Domain-separation tags: every variable-length part is tagged or length-prefixed, so no two different
# (parent, tokens, salt) triples can serialise to the same bytes.
_ROOT = b"\x00"
_CHILD = b"\x01"
_NO_SALT = b"\x00"
_SALT = b"\x01"
_U64 = struct.Struct("<Q")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # int64 little-endian regardless of the host byte order; array raises OverflowError outside int64.
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes | None = None) -> BlockHash:
    """Return the hash of one block given the hash of the block before it (``None`` for the first block).

    ``salt`` (e.g. a per-tenant cache salt or a LoRA name) is mixed into every block, so prefixes with
    different salts never share blocks.
    """
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    if parent is None:
        h.update(_ROOT)
    else:
        assert len(parent) == DIGEST_SIZE, f"parent hash must be {DIGEST_SIZE} bytes, got {len(parent)}"
        h.update(_CHILD)
        h.update(parent)
    h.update(_U64.pack(len(token_ids)))
    h.update(_token_bytes(token_ids))
    if salt is None:
        h.update(_NO_SALT)
    else:
        h.update(_SALT)
        h.update(_U64.pack(len(salt)))
        h.update(salt)
    return h.digest()


def tail_key(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes | None = None) -> BlockHash:
    """The key of a partly filled block (1 .. block_size - 1 tokens after the block ``parent`` names) in an
    offload tier: ``hash_block`` over those tokens, which a full block's hash never equals (the token count is
    hashed). Never a prefix-cache entry, so never in KV events or a router's index."""
    return hash_block(parent, token_ids, salt)


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, salt: bytes | None = None) -> list[BlockHash]:
    """Return the chained hashes of every full block of ``token_ids``; a trailing partial block has none."""
    assert block_size > 0, f"block_size must be positive, got {block_size}"
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
