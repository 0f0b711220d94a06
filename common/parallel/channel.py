"""Frames between a parallel node and its rank processes: a 4-byte little-endian length, then a protobuf.

The node writes ``WorkerInit`` then ``WorkerCommand`` frames to a rank's stdin; the rank answers each with a
``WorkerReply`` on its stdout (protos/tandem/v1/worker.proto). Typed messages, no pickle. A reply is far
smaller than a pipe's atomic write size (PIPE_BUF), so once the node's ``select`` sees a rank's stdout
readable, the whole frame is there.
"""

from __future__ import annotations

import struct
from typing import IO, TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from google.protobuf.message import Message

M = TypeVar("M", bound="Message")
_LEN = struct.Struct("<I")
MAX_FRAME = 256 * 2**20  # a step of 64k tokens with their block tables is a few MB


class ChannelClosed(EOFError):
    """The other side closed the channel (its process exited)."""


def write_frame(stream: IO[bytes], message: Message) -> None:
    data = message.SerializeToString()
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def read_exactly(stream: IO[bytes], n: int) -> bytes:
    parts: list[bytes] = []
    while n:
        chunk = stream.read(n)
        if not chunk:
            raise ChannelClosed("the channel closed mid-frame" if parts else "the channel closed")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def read_frame(stream: IO[bytes], message_type: type[M]) -> M:
    """The next message (raises ChannelClosed at end of stream, ValueError for a frame too big)."""
    (length,) = _LEN.unpack(read_exactly(stream, _LEN.size))
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length} bytes exceeds the limit of {MAX_FRAME}")
    message = message_type()
    message.ParseFromString(read_exactly(stream, length))
    return message
