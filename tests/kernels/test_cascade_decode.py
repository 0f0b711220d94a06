"""Cascade decode attention (common/kernels/cpu/cpu_decode.cpp's PrefixState, cpu_prefill_attn.cpp's cascade_prefix):
sequences whose block tables share a prefix go over it once, in the prefill kernel's GEMM-shaped loops, and over
their own rows after it as before, the two softmax states merged. Against a float64 oracle, beside the same call
with the cascade off: bf16 where the CPU has AVX512-BF16, fp32 on this CPU's two widest vector builds (AVX-512 and
AVX2 on an AVX-512 machine)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from common.kernels.cpu import _DECODE, paged_decode_kernel
from common.kernels.isa import ISA_FLAGS, runnable_isas

_module: ModuleType | None = paged_decode_kernel()
BF16_DOT = _module is not None and bool(_module.prefill_bf16dot_ready())
_VECTOR_ISAS = [isa for isa in runnable_isas()[:2] if isa != "generic"]
# (dtype, build): None is the module every node loads (the widest build)
KERNELS = [pytest.param(torch.bfloat16, None, id="bf16",
                        marks=pytest.mark.skipif(not BF16_DOT, reason="bf16 cascade needs AVX512-BF16")),
           *(pytest.param(torch.float32, isa, id=f"fp32-{isa}") for isa in _VECTOR_ISAS)]
pytestmark = pytest.mark.skipif(_module is None or not _VECTOR_ISAS, reason="no vector build of the kernels here")


def _kernel(isa: str | None) -> ModuleType:
    module = _module if isa is None else _DECODE.get(isa, ISA_FLAGS[isa])
    if module is None:
        pytest.skip("the compiled attention module does not build here")
    return module


def _batch(num_seqs: int, shared_blocks: int, suffixes: list[int], heads: int, kv_heads: int, dim: int, bs: int,
           seed: int = 0, distinct_first: bool = False, dtype: torch.dtype = torch.bfloat16
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, heads, dim]; caches [blocks, bs, kv_heads, dim] as views of an engine-shaped cache (two layers, K and V
    side by side in a block); tables whose first ``shared_blocks`` are the same blocks; seq_lens."""
    g = torch.Generator().manual_seed(seed)
    lens = [shared_blocks * bs + suffixes[i % len(suffixes)] for i in range(num_seqs)]
    own = [-(-n // bs) - shared_blocks for n in lens]
    blocks = shared_blocks + sum(own) + 1
    data = torch.randn(blocks, 2, 2, bs, kv_heads, dim, generator=g).to(dtype)
    perm = (torch.randperm(blocks - shared_blocks, generator=g) + shared_blocks).tolist()
    tables = torch.zeros(num_seqs, max(shared_blocks + o for o in own), dtype=torch.int32)
    used = 0
    for s in range(num_seqs):
        tables[s, :shared_blocks] = torch.arange(shared_blocks)
        tables[s, shared_blocks : shared_blocks + own[s]] = torch.tensor(perm[used : used + own[s]], dtype=torch.int32)
        used += own[s]
    if distinct_first:  # one sequence's prefix lives in other blocks (the same values): nothing is shared by all
        tables[0, 0] = blocks - 1
        data[blocks - 1] = data[0]
    query = torch.randn(num_seqs, heads, dim, generator=g).to(dtype)
    return query, data[:, 1, 0], data[:, 1, 1], tables, torch.tensor(lens, dtype=torch.int32)


def _oracle(query: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor) -> torch.Tensor:
    bs, kv_heads, dim = kc.shape[1:]
    group = query.shape[1] // kv_heads
    out = []
    for s in range(query.shape[0]):
        pos = torch.arange(int(lens[s]))
        rows = tables[s, pos // bs].long() * bs + pos % bs
        k = kc.reshape(-1, kv_heads, dim)[rows].double()
        v = vc.reshape(-1, kv_heads, dim)[rows].double()
        q = query[s].double().view(kv_heads, group, dim)
        p = (torch.einsum("hgd,thd->hgt", q, k) * dim**-0.5).softmax(-1)
        out.append(torch.einsum("hgt,thd->hgd", p, v).reshape(-1, dim))
    return torch.stack(out)


def _decode(on: bool, *args: torch.Tensor, module: ModuleType | None = None) -> torch.Tensor:
    module = module or _module
    assert module is not None
    module.set_cascade(on)
    try:
        query, kc, vc, tables, lens = args
        return module.paged_decode(query, kc, vc, tables, lens, query.shape[-1] ** -0.5, 0)  # type: ignore[no-any-return]
    finally:
        module.set_cascade(True)


@pytest.mark.parametrize(("num_seqs", "shared_blocks", "suffixes", "heads", "kv_heads", "dim", "bs"), [
    (48, 32, [1, 64, 130, 17, 2], 9, 3, 64, 16),  # SmolLM2: a 512-token system prompt, 48 requests
    (17, 5, [1, 40], 8, 2, 128, 16),  # 80 shared tokens: 64 in the cascade, 16 left to each sweep; a tile of one
    (8, 4, [1, 3, 9], 4, 4, 64, 16),  # the fewest sequences, the shortest prefix, a suffix of the row itself
    (12, 3, [5, 33], 9, 3, 64, 32),  # 32-token blocks
    (10, 13, [2, 7], 9, 3, 64, 5),  # blocks of 5: the pack element by element; 65 shared tokens -> 64
    (9, 40, [1, 300], 16, 2, 256, 16),  # a prefix over two 512-key softmax chunks, head_dim 256
])
@pytest.mark.parametrize(("dtype", "isa"), KERNELS)
def test_a_shared_prefix_goes_through_the_cascade_and_matches_the_oracle(
        num_seqs: int, shared_blocks: int, suffixes: list[int], heads: int, kv_heads: int, dim: int, bs: int,
        dtype: torch.dtype, isa: str | None) -> None:
    module = _kernel(isa)
    args = _batch(num_seqs, shared_blocks, suffixes, heads, kv_heads, dim, bs, dtype=dtype)
    want = _oracle(*args)
    on, off = _decode(True, *args, module=module), _decode(False, *args, module=module)
    err, off_err = (on.double() - want).abs().max().item(), (off.double() - want).abs().max().item()
    if dtype == torch.float32:  # the same sums in another order
        torch.testing.assert_close(on.double(), want, atol=2e-5, rtol=2e-5)
    else:  # the prefix's probabilities in bf16 (as the prefill kernel has them) and the output rounded to bf16 once
        assert err <= max(2 * off_err, 1e-2), (err, off_err)
        torch.testing.assert_close(on.double(), want, atol=2e-2, rtol=2e-2)
    if module.decode_splits_heads(dim):  # it ran: the prefix's sums went another way
        assert not torch.equal(on, off)
    else:  # a head size off the build's register-blocked path (256 on AVX2) is swept whole
        assert torch.equal(on, off)


@pytest.mark.parametrize(("dtype", "isa"), KERNELS)
@pytest.mark.parametrize("case", ["too-few", "short-prefix", "not-shared"])
def test_no_cascade_where_it_does_not_pay_or_nothing_is_shared(case: str, dtype: torch.dtype, isa: str | None) -> None:
    """Fewer than 8 sequences, a prefix under 64 tokens, or a table that does not share the first block: the
    sequences are swept whole, the same floats as with the cascade off."""
    module = _kernel(isa)
    num_seqs, shared_blocks = (7, 32) if case == "too-few" else (16, 3) if case == "short-prefix" else (16, 32)
    args = _batch(num_seqs, shared_blocks, [1, 20], 9, 3, 64, 16, distinct_first=case == "not-shared", dtype=dtype)
    on = _decode(True, *args, module=module)
    assert torch.equal(on, _decode(False, *args, module=module))
    torch.testing.assert_close(on.double(), _oracle(*args), atol=2e-2, rtol=2e-2)


def test_cascade_can_be_turned_off_by_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _batch(16, 8, [1, 9], 9, 3, 64, 16)
    assert _module is not None
    monkeypatch.setenv("TANDEM_CPU_CASCADE", "off")
    module = paged_decode_kernel()
    assert module is not None
    off = module.paged_decode(*args[:4], args[4], 64**-0.5, 0)
    monkeypatch.setenv("TANDEM_CPU_CASCADE", "auto")
    module = paged_decode_kernel()
    assert module is not None
    on = module.paged_decode(*args[:4], args[4], 64**-0.5, 0)
    assert torch.equal(off, _decode(False, *args)) and torch.equal(on, _decode(True, *args))
    assert not torch.equal(on, off)
    monkeypatch.setenv("TANDEM_CPU_CASCADE", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_CASCADE"):
        paged_decode_kernel()
