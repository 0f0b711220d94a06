"""A prefill or decode node reduced to its KV-transfer part, driven by JSON lines on stdin (tests' remote control).

    python tests/kv_transfer/harness.py '{"role": "decode", ...config}'

Replies and events are JSON lines on stdout (``{"id": n, "ok": true, ...}``; ``{"event": "send_stalled"}``);
logs go to stderr. JSON rather than multiprocessing pipes because pipes pickle, and the no-pickle test
forbids pickle inside this process. Blocks come from a real KVCacheManager, so tests can check the pool
returns to its starting count after failures.

KV content is a pure function of the token prefix a block ends (random bits, so NaN patterns included):
the prefill writes it, the decode side recomputes it and compares bit for bit.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc
import torch

from common.kv.kv_cache import KVCache, KVCacheSpec
from common.kv.kv_cache_manager import KVCacheManager
from kv_transfer import KVReceiver, KVSender, TransferFailed, make_layout
from kv_transfer.local_plane import LocalPlane
from kv_transfer.pair_group import PairGroup
from kv_transfer.shared_kv_writer import SharedKVWriter
from tandem.v1 import common_pb2, prefill_pb2

_stdout_lock = threading.Lock()
PICKLE_CALLS: list[str] = []


def emit(obj: dict[str, Any]) -> None:
    with _stdout_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def expected_block(spec: KVCacheSpec, seed: int, prefix: list[int]) -> torch.Tensor:
    """The KV of the block that ends ``prefix``: [num_layers, 2, block_size, num_kv_heads, head_dim], random bits."""
    digest = hashlib.sha256(json.dumps([seed, prefix]).encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    dtype = getattr(torch, spec.dtype_name)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(bits)
    shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=bits).view(dtype)


def block_prefixes(tokens: list[int], block_size: int) -> list[list[int]]:
    return [tokens[: min((i + 1) * block_size, len(tokens))] for i in range(math.ceil(len(tokens) / block_size))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def fragment(manager: KVCacheManager, every: int) -> None:
    """Pin every ``every``-th block so that fresh allocations get ids like 1,2,4,5,... (every=3)."""
    for block in range(manager.pool.num_blocks):
        manager.allocate(f"pad-{block}", [0])
    for block in range(manager.pool.num_blocks):
        if block % every:
            manager.free(f"pad-{block}")


def forbid_pickle() -> None:
    """Make every pickle entry point (and torch.distributed's object (de)serialisers) fail loudly."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    def forbidden(name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            PICKLE_CALLS.append(name)
            raise AssertionError(f"{name} called: nothing may be pickled")

        return fail

    class Forbidden:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            PICKLE_CALLS.append(type(self).__name__)
            raise AssertionError("pickle.Pickler/Unpickler used: nothing may be pickled")

    for name in ("dumps", "loads", "dump", "load"):
        setattr(pickle, name, forbidden(f"pickle.{name}"))
    pickle.Pickler = Forbidden  # type: ignore[misc, assignment]
    pickle.Unpickler = Forbidden  # type: ignore[misc, assignment]
    c10d._object_to_tensor = forbidden("_object_to_tensor")  # type: ignore[assignment]
    c10d._tensor_to_object = forbidden("_tensor_to_object")  # type: ignore[assignment]
    torch.save = forbidden("torch.save")  # type: ignore[assignment]
    torch.load = forbidden("torch.load")  # type: ignore[assignment]


def stall_data_op(direction: str, after: int) -> None:
    """From the ``after``-th data op in ``direction`` ("send" | "recv") on, the pair's poster thread blocks
    forever before posting it (a stuck peer), announcing it once."""
    original = PairGroup._post
    calls = itertools.count()

    def stalled(self: PairGroup, posted: Any) -> None:
        op = posted.op
        if op.tensors is not None and op.send == (direction == "send") and next(calls) >= after:
            emit({"event": f"{direction}_stalled"})
            threading.Event().wait()
        original(self, posted)

    PairGroup._post = stalled  # type: ignore[method-assign]


def stall_copy(after: int) -> None:
    """Same-host transport: from the ``after``-th chunk copy on, the copy thread blocks forever inside the
    copy, holding the first run's grant lock (a stuck writer), announcing it once."""
    original = SharedKVWriter.copy
    calls = itertools.count()

    def stalled(self: SharedKVWriter, transfer_id: str, source: Any, runs: Any, ready: Any) -> bool:
        if next(calls) >= after:
            run = runs[0]
            with self.grants.holding(0, run.dst_start, run.num_blocks):
                emit({"event": "copy_stalled"})
                threading.Event().wait()
        return original(self, transfer_id, source, runs, ready)

    SharedKVWriter.copy = stalled  # type: ignore[method-assign]


class Node:
    def __init__(self, cfg: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.spec = KVCacheSpec(cfg.get("num_layers", 2), cfg.get("num_kv_heads", 2), cfg.get("head_dim", 8),
                                cfg.get("block_size", 4), cfg.get("dtype", "bfloat16"))
        self.seed = cfg.get("seed", 0)
        self.kv = KVCache(self.spec, cfg.get("num_blocks", 64), device=cfg.get("device", "cpu"))
        # Garbage, so a block that was never written cannot pass for a transferred one.
        gen = torch.Generator().manual_seed(1234 + os.getpid())
        raw = self.kv.data.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8).to(raw.device))
        self.manager = KVCacheManager(self.kv.num_blocks, self.spec.block_size,
                                      enable_prefix_caching=cfg["role"] == "decode")
        if cfg.get("fragment"):
            fragment(self.manager, cfg["fragment"])
        self.layout = make_layout(self.spec, cfg.get("model", "tiny"), cfg.get("fingerprint", "f0"))
        self.timeout_s = cfg.get("group_timeout_s", 10.0)
        self.tokens: dict[str, list[int]] = {}

    def state(self) -> dict[str, Any]:
        self.manager.check_integrity()
        return {"free_blocks": self.manager.num_free_blocks, "pickle_calls": list(PICKLE_CALLS),
                "transports": self.transports()}

    def transports(self) -> list[str]:
        """The data plane of each live pair ("shm" | "socket")."""
        if isinstance(self, DecodeNode):
            return sorted("shm" if isinstance(p.group, LocalPlane) else "socket" for p in self.receiver._pairs)
        if isinstance(self, PrefillNode) and hasattr(self, "sender"):
            return sorted(p.transport for p in self.sender._all_pairs)
        return []


class DecodeNode(Node):
    async def start(self) -> dict[str, Any]:
        self.server = grpc.aio.server()
        port = self.server.add_insecure_port(f"127.0.0.1:{self.cfg.get('grpc_port', 0)}")
        self.receiver = KVReceiver(self.kv, self.layout, self.cfg.get("node_id", "decode-0"),
                                   group_timeout_s=self.timeout_s, transport=self.cfg.get("transport", "auto"))
        self.receiver.add_to_server(self.server)
        await self.server.start()
        return {"kv_endpoint": f"127.0.0.1:{port}", "node_id": self.receiver.node_id,
                "segment": self.receiver.shared_segment, **self.state()}

    async def reserve(self, request_id: str, token_ids: list[int]) -> dict[str, Any]:
        allocation = self.manager.allocate(request_id, token_ids)
        assert allocation is not None, "out of blocks"
        self.tokens[request_id] = token_ids
        self.receiver.expect(request_id, allocation.block_ids, allocation.num_cached_tokens)
        return {"block_ids": allocation.block_ids, "num_cached_tokens": allocation.num_cached_tokens, **self.state()}

    async def wait(self, request_id: str, timeout_s: float, free: bool = True) -> dict[str, Any]:
        started = time.monotonic()
        try:
            result = await self.receiver.wait(request_id, timeout_s)
        except TransferFailed as exc:
            self.manager.free(request_id)
            return {"failed": str(exc), "elapsed_s": time.monotonic() - started, **self.state()}
        tokens = self.tokens[request_id]
        table = self.manager.block_table(request_id)
        mismatched = [block for block, prefix in zip(table, block_prefixes(tokens, self.spec.block_size), strict=True)
                      if not same_bits(self.kv.data[block].cpu(), expected_block(self.spec, self.seed, prefix))]
        self.manager.commit(request_id, tokens)
        if free:
            self.manager.free(request_id)
        logprob = result.first_logprob
        return {"first_token": result.first_token, "bytes": result.bytes, "mismatched_blocks": mismatched,
                "trace_context": result.trace_context, "elapsed_s": time.monotonic() - started,
                "prefill_cached_tokens": result.prefill_cached_tokens,
                "first_logprob": None if logprob is None else [logprob.token_id, logprob.logprob], **self.state()}

    async def abandon(self, request_id: str, reason: str) -> dict[str, Any]:
        await self.receiver.abandon(request_id, reason)
        self.manager.free(request_id)
        return self.state()


class PrefillNode(Node):
    async def start(self) -> dict[str, Any]:
        self.sender = KVSender(self.kv, self.layout, self.cfg.get("node_id", "prefill-0"),
                               group_timeout_s=self.timeout_s, transport=self.cfg.get("transport", "auto"))
        return self.state()

    async def transfer(self, transfer_id: str, destination: dict[str, Any], token_ids: list[int],
                       blocks_per_push: int = 2, timeout_s: float = 20.0, trace_context: dict[str, str] | None = None,
                       push_interval_s: float = 0.0) -> dict[str, Any]:
        bs = self.spec.block_size
        allocation = self.manager.allocate(transfer_id, token_ids)
        assert allocation is not None, "out of blocks"
        src = allocation.block_ids
        for block, prefix in zip(src, block_prefixes(token_ids, bs), strict=True):
            self.kv.data[block].copy_(expected_block(self.spec, self.seed, prefix).to(self.kv.data.device))
        dst = destination["block_ids"]
        skip = destination.get("num_cached_tokens", 0) // bs
        started = time.monotonic()
        try:
            handle = await self.sender.open(transfer_id, prefill_pb2.KVDestination(**destination), trace_context)

            def engine() -> None:  # the prefill engine's thread: push as chunks are "computed"
                for start in range(skip, len(src), blocks_per_push):
                    handle.push(src[start : start + blocks_per_push], dst[start : start + blocks_per_push])
                    time.sleep(push_interval_s)
                first = common_pb2.TokenLogprob(token_id=sum(token_ids) % 97, logprob=-0.25)
                handle.complete(first.token_id, first, prefill_cached_tokens=0)

            await asyncio.to_thread(engine)
            stats = await handle.wait(timeout_s)
        except TransferFailed as exc:
            self.manager.free(transfer_id)
            return {"failed": str(exc), "elapsed_s": time.monotonic() - started, **self.state()}
        self.manager.free(transfer_id)
        return {"bytes": stats.bytes, "num_chunks": stats.num_chunks, "num_sends": stats.num_sends,
                "elapsed_s": time.monotonic() - started, **self.state()}


async def serve(cfg: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    node: DecodeNode | PrefillNode = DecodeNode(cfg) if cfg["role"] == "decode" else PrefillNode(cfg)
    if cfg.get("forbid_pickle"):
        forbid_pickle()
    for method in ("send", "recv"):
        if cfg.get(f"stall_{method}_after") is not None:
            stall_data_op(method, cfg[f"stall_{method}_after"])
    if cfg.get("stall_copy_after") is not None:
        stall_copy(cfg["stall_copy_after"])
    emit({"ready": True, **await node.start()})
    lines: asyncio.Queue[str] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, "")

    threading.Thread(target=read_stdin, daemon=True).start()
    tasks = set()

    async def run(request: dict[str, Any]) -> None:
        cmd = request.pop("cmd")
        rid = request.pop("id")
        try:
            if cmd == "state":
                reply = node.state()
            elif cmd == "try_pickle":
                import pickle

                try:
                    pickle.dumps(1)
                    reply = {"pickle_works": True}
                except AssertionError:
                    reply = {"pickle_works": False}
            else:
                reply = await getattr(node, cmd)(**request)
            emit({"id": rid, "ok": True, **reply})
        except Exception as exc:
            logging.exception("command %s failed", cmd)
            emit({"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    while line := await lines.get():
        task = asyncio.create_task(run(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if isinstance(node, DecodeNode):
        await node.receiver.close()
        await node.server.stop(0)
    else:
        await node.sender.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(serve(json.loads(sys.argv[1])))
