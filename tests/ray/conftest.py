"""A real Ray cluster of three raylets on this box, every Ray and Tandem server on loopback (`make test-ray`).

The head and two workers are started with `ray start` through scripts/ray-loopback.sh (which keeps Ray on
127.0.0.1), each with its own custom resource standing for a machine (host_a, host_b, host_c; 2 of each: room for two
nodes' ranks). `make test`
skips this directory: CI does not install Ray (about 1.5 minutes) and its budget is taken; `make test-ray`
installs the `ray` extra and sets TANDEM_RAY_TESTS=1.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("host_a", "host_b", "host_c")

if os.environ.get("TANDEM_RAY_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]  # `make test-ray` runs them (Ray installed, TANDEM_RAY_TESTS=1)


def listeners() -> set[tuple[str, str]]:
    """(local address, process) of every listening TCP socket on this machine."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            found.add((fields[3], fields[5] if len(fields) > 5 else ""))
    return found


def on_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]").removeprefix("::ffff:")  # an IPv4-mapped IPv6 address too
    return host.startswith("127.") or host == "::1"


@dataclass(frozen=True)
class RayCluster:
    address: str  # the head's GCS, host:port
    temp_dir: Path
    env: dict[str, str]
    before: frozenset[tuple[str, str]]  # the machine's listening sockets before the cluster started


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    pytest.importorskip("ray", reason="make test-ray installs the ray extra")
    from benchmarks.bench_ray import loopback_cluster

    before = listeners()
    with loopback_cluster(HOSTS, units=2) as (address, env, temp_dir):
        time.sleep(1.0)
        yield RayCluster(address, temp_dir, env, frozenset(before))
