"""What two nodes must agree on before KV blocks move between them, and the handshake's checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.v1 import kv_transfer_pb2

if TYPE_CHECKING:
    from common.kv.kv_cache import KVCacheSpec

# Bumped on any change to the meaning or order of the control messages or data ops.
PROTOCOL_VERSION = 1

# Checked in this order; every differing field is named in the refusal.
_LAYOUT_FIELDS = ("model", "model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


def make_layout(spec: KVCacheSpec, model_name: str, model_fingerprint: str) -> kv_transfer_pb2.KVLayout:
    """The handshake's description of this node's KV blocks."""
    return kv_transfer_pb2.KVLayout(
        model=model_name,
        model_fingerprint=model_fingerprint,
        dtype=spec.dtype_name,
        block_size=spec.block_size,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
    )


def layout_mismatch(
    ours: kv_transfer_pb2.KVLayout,
    theirs: kv_transfer_pb2.KVLayout,
    ours_role: str = "decode",
    theirs_role: str = "prefill",
) -> str | None:
    """None when the layouts match, else e.g. ``"block_size differs: prefill 16, decode 32"``.

    The receiver (decode) checks the sender's (prefill) layout, hence the default roles.
    """
    problems = []
    for name in _LAYOUT_FIELDS:
        mine, other = getattr(ours, name), getattr(theirs, name)
        if mine != other:
            problems.append(f"{name} differs: {theirs_role} {other!r}, {ours_role} {mine!r}")
    return "; ".join(problems) or None


def model_fingerprint(model_dir: Path) -> str:
    """A short digest of ``config.json`` (parsed and re-serialised with sorted keys, so formatting is moot)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
