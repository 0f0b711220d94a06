"""The FlashInfer backend: its page lists (CPU, exact), its refusal on CPU (the registry and the CLI), and on a
GPU its kernels against the dense oracle, the paged reference and the Triton kernels (its reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.attention.backend import get_backend
from common.attention.flashinfer_backend import paged_kv_pages
from common.kernels.triton import attention as triton_kernels
from tests.kernels.test_attention_backends import BATCHES, HAS_CUDA, assert_close, check_backend, make_batch


def test_block_tables_become_csr_page_lists() -> None:
    tables = torch.tensor([[7, 3, 9, 0], [4, 0, 0, 0], [1, 2, 5, 6]], dtype=torch.int32)
    seq_lens = torch.tensor([33, 16, 64], dtype=torch.int32)  # 3 blocks (1 token in the last), 1 full, 4 full
    indptr, indices, last = paged_kv_pages(tables, seq_lens, block_size=16)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 3, 9, 4, 1, 2, 5, 6]
    assert last.tolist() == [1, 16, 16]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_flashinfer_without_cuda_refuses_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--attention-backend flashinfer .* needs a CUDA GPU") as info:
        get_backend("flashinfer")
    assert "--attention-backend torch" in str(info.value)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_cli_refuses_flashinfer_on_cpu_without_a_traceback(tiny_served_model_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from tandem_cli.cli import main

    code = main(["generate", "--model", str(tiny_served_model_dir), "--attention-backend", "flashinfer",
                 "--prompt", "hello", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--attention-backend flashinfer" in err and "needs a CUDA GPU" in err
    assert "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 4])
def test_flashinfer_backend_against_dense_reference_and_triton(kind: str, block_size: int, gqa: int) -> None:
    pytest.importorskip("flashinfer")
    batch = make_batch(*BATCHES[kind], gqa=gqa, block_size=block_size, dtype=torch.bfloat16, head_dim=64,
                       device="cuda")
    meta = batch.meta
    backend = get_backend("flashinfer")
    check_backend(backend, batch, torch.bfloat16)  # writes the new K/V, checks dense + paged reference
    # The Triton kernels over the same (now written) cache: FlashInfer must agree with its reference.
    scale = batch.query.shape[-1] ** -0.5
    assert meta.block_tables is not None
    if meta.is_decode_only:
        triton = triton_kernels.paged_decode(batch.query, *batch.kv_cache, meta.block_tables, meta.seq_lens, scale,
                                             max_seq_len=meta.max_seq_len)
    else:
        triton = triton_kernels.paged_extend(batch.query, *batch.kv_cache, meta.block_tables, meta.query_start_loc,
                                             meta.seq_lens, scale, max_query_len=meta.max_query_len)
    again = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, meta, scale)
    assert_close(again, triton, torch.bfloat16)


@pytest.mark.gpu
def test_flashinfer_cacheless_prefill() -> None:
    pytest.importorskip("flashinfer")
    batch = make_batch(*BATCHES["prefill"], gqa=4, dtype=torch.bfloat16, head_dim=64, device="cuda")
    from tests.kernels.test_attention_backends import dense_expected

    out = get_backend("flashinfer").forward(batch.query, batch.key, batch.value, None, batch.meta, 0.125)
    assert_close(out, dense_expected(batch, 0.125), torch.bfloat16)
