"""Which data plane a prefill/decode pair uses: same-host shared memory, or sockets (a pair group).

Both ends are on one host when their host ids (boot id + hostname) match; the sender then offers "shm"
first. The decode node picks the first offered transport it allows, and the sender still proves the
choice by mapping the segment and checking its nonce (a container with its own /dev/shm fails that and
pairs again over sockets when its setting is ``auto``).
"""

from __future__ import annotations

import socket
from pathlib import Path

from common.config.settings import KV_TRANSPORTS

SHM, SOCKET = "shm", "socket"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def check_transport(setting: str) -> str:
    if setting not in KV_TRANSPORTS:
        raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}; got {setting!r}")
    return setting


def host_id() -> str:
    """``<boot id>/<hostname>``; "" where there is no boot id (not Linux): such hosts never share memory."""
    try:
        boot_id = _BOOT_ID.read_text().strip()
    except OSError:
        return ""
    return f"{boot_id}/{socket.gethostname()}"


def offered_transports(setting: str) -> list[str]:
    """What a sender with this ``kv_transport`` setting offers, preferred first."""
    return {"auto": [SHM, SOCKET], "shm": [SHM], "socket": [SOCKET]}[check_transport(setting)]


def choose_transport(setting: str, offered: list[str], sender_host: str, our_host: str,
                     shm_ready: bool) -> tuple[str | None, str | None]:
    """The decode node's pick: (transport, None), or (None, why no transport both sides allow)."""
    offered = offered or [SOCKET]  # a sender from before same-host transport
    same_host = bool(our_host) and sender_host == our_host
    for transport in offered:
        if transport == SHM and setting != SOCKET and shm_ready and same_host:
            return SHM, None
        if transport == SOCKET and setting != SHM:
            return SOCKET, None
    if setting == SHM and SOCKET in offered and SHM not in offered:
        return None, "kv_transport differs: prefill 'socket', decode 'shm'"
    if not same_host:
        return None, (f"kv_transport shm needs both nodes on one host: prefill host {sender_host or '?'!r}, "
                      f"decode host {our_host or '?'!r}")
    if setting == SOCKET:
        return None, "kv_transport differs: prefill 'shm', decode 'socket'"
    return None, "the decode node has no shared-memory KV (see its start-up log)"
