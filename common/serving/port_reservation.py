"""Loopback ports for servers that another process binds later (a node the launcher starts, a rank's
rendezvous), chosen so that nothing else takes them in between.

The usual trick — bind port 0, read the port, close — draws from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the range that every outgoing connection and every other
``bind(0)`` draws from too: between the close and the server's own bind, a gloo connection, a gRPC client or
another test's ``bind(0)`` may take the port (CI saw it, in tests/parallel). Ports here come from outside
that range, where the kernel never hands ports out by itself, and a registry shared by every process on the
machine (a JSON file under the temp directory, guarded by ``flock``) keeps two processes — two tests, two
pytest workers, two launchers — from choosing the same port while the first has not bound it yet.

A reservation lasts ``RESERVATION_S``; by then its server has bound the port (or died), and a bound port is
never chosen again because choosing tries to bind it first.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path

RESERVATION_S = 900.0
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range
_LOWEST = 10000  # below this live the well-known and registered ports of services a machine may run


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def candidate_ranges() -> list[range]:
    """Where reserved ports come from: the non-ephemeral ports from 10000 up, below then above the range."""
    low, high = ephemeral_range()
    ranges = [range(max(_LOWEST, 1024), low), range(max(high + 1, _LOWEST), 65536)]
    return [r for r in ranges if len(r) > 0]


def _registry_path() -> Path:
    return Path(tempfile.gettempdir()) / "tandem-ports.json"


def _random_port(rng: random.Random, ranges: list[range]) -> int:
    k = rng.randrange(sum(len(r) for r in ranges))
    for r in ranges:
        if k < len(r):
            return r[k]
        k -= len(r)
    raise AssertionError("unreachable")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reserve_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now and reserved for ``RESERVATION_S`` against every other caller.

    Falls back to the kernel's choice (``bind`` to port 0) only when the machine has no port outside its
    ephemeral range, which a racing process could then take (the old behaviour)."""
    ranges = candidate_ranges()
    if not ranges:
        return [_kernel_port() for _ in range(n)]
    path = _registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            now = time.time()
            try:
                held = {int(p): float(t) for p, t in json.loads(path.read_text()).items() if float(t) > now}
            except (OSError, ValueError, AttributeError):
                held = {}
            rng = random.SystemRandom()
            chosen: list[int] = []
            for _ in range(100 * n + 1000):
                if len(chosen) == n:
                    break
                port = _random_port(rng, ranges)
                if port not in held and port not in chosen and _bindable(port):
                    chosen.append(port)
            if len(chosen) < n:
                raise OSError(f"could not find {n} free loopback ports outside the ephemeral range")
            held.update(dict.fromkeys(chosen, now + RESERVATION_S))
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({str(p): t for p, t in held.items()}))
            os.replace(tmp, path)
            return chosen
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def reserve_port() -> int:
    """One port, as ``reserve_ports(1)``."""
    return reserve_ports(1)[0]
