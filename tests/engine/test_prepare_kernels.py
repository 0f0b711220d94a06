"""Every CPU node builds its kernels before it serves, on the engine thread: oneDNN's bf16 GEMM for every row
bucket a step can reach on each node (a prefill node's steps are the ones that reach them all), the compiled
decode attention kernel only where a node decodes."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from common.config.settings import ModelSettings, NodeSettings
from decode_service.server import serve_decode
from prefill_service.server import serve_prefill


def test_prefill_and_decode_nodes_warm_their_gemm_before_serving(tiny_served_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import common.kernels.cpu as cpu_kernels
    import common.model.gemv as gemv

    warmed: list[tuple[str, int]] = []
    built: list[str] = []
    real_kernel = cpu_kernels.paged_decode_kernel

    def warm(model: object, max_rows: int) -> int:
        warmed.append((threading.current_thread().name, max_rows))
        return 0

    def kernel() -> object:  # (model loading asks too, on the main thread: not counted)
        if threading.current_thread() is not threading.main_thread():
            built.append(threading.current_thread().name)
        return real_kernel()

    monkeypatch.setattr(gemv, "warm_onednn_buckets", warm)
    monkeypatch.setattr(cpu_kernels, "paged_decode_kernel", kernel)
    model = ModelSettings(model=str(tiny_served_model_dir), dtype="float32")
    node = NodeSettings(num_blocks=32, block_size=4, grace_s=0.1, max_num_batched_tokens=96)

    async def main() -> None:
        prefill = await serve_prefill(model, node)
        try:
            assert len(warmed) == 1 and built == []  # no decode kernel on a node that never decodes
            assert warmed[0][1] >= 96  # up to a step's most rows
        finally:
            await prefill.stop(0.1)
        decode = await serve_decode(model, node)
        try:
            assert len(warmed) == 2 and built == ["decode-engine"]
        finally:
            await decode.stop(0.1)
        assert [name for name, _ in warmed] == ["prefill-engine", "decode-engine"]  # the threads that step

    asyncio.run(asyncio.wait_for(main(), 120))
