"""The fused decode ops (common/model/fused_ops.py) against the eager reference, and the whole model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.engine_core import ColocatedEngine
from common.kernels.cpu import cpu_kernels
from common.kernels.isa import runnable_isas
from common.model.fused_ops import CppOps, EagerOps, fused_ops_for
from common.model.loader import load_model
from common.sampling.params import SamplingParams

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=runnable_isas()[:2])
def cpp(request: pytest.FixtureRequest) -> CppOps:
    module = cpu_kernels(request.param)
    if module is None:
        pytest.skip("no C++ compiler / ninja here")
    return CppOps(module)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "h"), [(1, 96), (3, 96), (64, 96), (40, 100), (5, 7)])  # vector rows, tails, none
def test_add_rms_norm_matches_eager(cpp: CppOps, dtype: torch.dtype, n: int, h: int) -> None:
    g = torch.Generator().manual_seed(n)
    x, res = (torch.randn(n, h, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    want_out, want_res = EagerOps().add_rms_norm(x, res, w, 1e-5)
    got_out, got_res = cpp.add_rms_norm(x, res.clone(), w, 1e-5)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)  # one rounding, either way
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])
    first_out, first_res = cpp.add_rms_norm(x, None, w, 1e-5)  # first layer: no residual yet
    torch.testing.assert_close(first_out, EagerOps().add_rms_norm(x, None, w, 1e-5)[0], **TOL[dtype])
    assert torch.equal(first_res, x) and first_res.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "inter"), [(1, 40), (5, 40), (64, 40), (33, 1536), (2, 7)])
def test_silu_mul_matches_eager(cpp: CppOps, dtype: torch.dtype, n: int, inter: int) -> None:
    gate_up = (3 * torch.randn(n, 2 * inter, generator=torch.Generator().manual_seed(n))).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamp at both ends
    torch.testing.assert_close(cpp.silu_mul(gate_up), EagerOps().silu_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_rows_keep_nan_and_round_bf16_as_torch(cpp: CppOps, dtype: torch.dtype) -> None:
    # The vector loops' own bf16 rounding (nearest even) and NaN: a NaN stays NaN through norm and MLP rows; in
    # bf16 the residual's add is torch's own rounding exactly.
    x, res = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    x[1, 5] = float("nan")
    out, got_res = cpp.add_rms_norm(x, res.clone(), torch.ones(64, dtype=dtype), 1e-5)
    torch.testing.assert_close(got_res, x + res, atol=0, rtol=0, equal_nan=True)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    gate_up = torch.randn(2, 64).to(dtype)
    gate_up[1, 3] = float("nan")
    got = cpp.silu_mul(gate_up)
    assert got[1, 3].isnan() and got.isnan().sum() == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64, 80])  # half 8: AVX2's vector; 32: both; 40: AVX-512's vectors and a tail
def test_rotary_in_place_on_qkv_views_matches_eager(cpp: CppOps, dtype: torch.dtype, d: int) -> None:
    from common.config.model_config import RopeScaling
    from common.model.layers import RotaryEmbedding

    n, heads, kv_heads = 7, 6, 2
    rope = RotaryEmbedding(d, 10000.0, 64, RopeScaling())
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(0)).to(dtype)
    positions = torch.tensor([0, 3, 9, 1, 40, 63, 2])
    table = rope.table(qkv.device, dtype, 64)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[:, : heads * d].view(n, heads, d), t[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)

    want_q, want_k = rope(positions, *views(qkv.clone()))  # the layer's own rotary: the reference
    got = qkv.clone()
    cpp.rotary_(*views(got), table, positions)
    torch.testing.assert_close(views(got)[0], want_q, **TOL[dtype])
    torch.testing.assert_close(views(got)[1], want_k, **TOL[dtype])
    assert torch.equal(got[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])  # v untouched
    eager = qkv.clone()
    EagerOps().rotary_(*views(eager), table, positions)
    torch.testing.assert_close(views(eager)[0], want_q, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7])
def test_rms_norm_of_heads_on_qkv_views_matches_the_layer_norm(cpp: CppOps, dtype: torch.dtype, n: int) -> None:
    """Qwen3's q/k norms: RMSNorm over head_dim of each head of the qkv projection's (strided) views."""
    from common.model.layers import RMSNorm

    heads, kv_heads, d = 6, 2, 16
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    norm = RMSNorm(d, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    q = qkv[:, : heads * d].view(n, heads, d)
    with torch.no_grad():
        want = norm(q)  # the layer's own RMSNorm over the last dim: the reference
    eager = EagerOps().rms_norm(q, norm.weight, norm.eps)
    torch.testing.assert_close(eager, want, atol=0, rtol=0)
    got = cpp.rms_norm(q, norm.weight, norm.eps)
    assert got.shape == (n, heads, d) and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(qkv[:, : heads * d].view(n, heads, d), q)  # the projection's output is left as it was


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7])
def test_unit_offset_norms_match_gemmas_rms_norm(cpp: CppOps, dtype: torch.dtype, n: int) -> None:
    """Gemma's (1 + weight) RMSNorm, scaled in fp32 and rounded once: the layer's module, transformers' own
    Gemma3RMSNorm, and both ops (C++ in fp32; in bf16 it declines to the reference, whose single rounding the
    kernel's norm-then-scale would not give), over whole rows and over heads of a strided view."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from common.model.layers import RMSNorm

    g = torch.Generator().manual_seed(n)
    d = 48
    x, res = (torch.randn(n, d, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(d, 1e-6, unit_offset=True).to(dtype)
    norm.weight.data = (0.3 * torch.randn(d, generator=g)).to(dtype)  # the offset from 1, as Gemma stores it
    theirs = Gemma3RMSNorm(d, 1e-6).to(dtype)
    theirs.weight.data = norm.weight.data.clone()
    with torch.no_grad():
        want = theirs(x + res)
        torch.testing.assert_close(norm(x + res), want, atol=0, rtol=0)
    eager_out, eager_res = EagerOps().add_rms_norm(x, res, norm.weight, norm.eps, unit_offset=True)
    torch.testing.assert_close(eager_out, want, atol=0, rtol=0)
    got_out, got_res = cpp.add_rms_norm(x, res.clone(), norm.weight, norm.eps, unit_offset=True)
    torch.testing.assert_close(got_res, eager_res, atol=0, rtol=0)
    torch.testing.assert_close(got_out, want, **(TOL[dtype] if dtype == torch.float32 else {"atol": 0, "rtol": 0}))
    first, _ = cpp.add_rms_norm(x, None, norm.weight, norm.eps, unit_offset=True)
    torch.testing.assert_close(first, EagerOps().add_rms_norm(x, None, norm.weight, norm.eps, True)[0], **TOL[dtype])
    heads = torch.randn(n, 3 * d, generator=g).to(dtype)[:, : 2 * d].view(n, 2, d)  # Gemma 3's q/k norms
    with torch.no_grad():
        want_heads = theirs(heads)
    torch.testing.assert_close(EagerOps().rms_norm(heads, norm.weight, norm.eps, True), want_heads, atol=0, rtol=0)
    torch.testing.assert_close(cpp.rms_norm(heads, norm.weight, norm.eps, True), want_heads, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_is_transformers_gelu_pytorch_tanh(cpp: CppOps, dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    gate_up = (3 * torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(0))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    torch.testing.assert_close(EagerOps().gelu_tanh_mul(gate_up), want, atol=0, rtol=0)
    torch.testing.assert_close(cpp.gelu_tanh_mul(gate_up), want, atol=0, rtol=0)  # no kernel: the reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_write_kv_matches_rotary_then_write(cpp: CppOps, dtype: torch.dtype) -> None:
    from common.config.model_config import RopeScaling
    from common.kv.kv_cache import write_kv
    from common.model.layers import RotaryEmbedding

    n, heads, kv_heads, d, block_size = 5, 6, 2, 16, 4
    rope = RotaryEmbedding(d, 10000.0, 64, RopeScaling())
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 9, 40, 63])
    slots = torch.tensor([0, 7, 13, 2, 30])  # scattered over blocks 0, 1, 3, 0, 7
    table = rope.table(qkv.device, dtype, 64)
    # The caches as a layer sees them: strided views of one [blocks, layers, 2, block_size, Hkv, D] tensor.
    data = torch.full((8, 2, 2, block_size, kv_heads, d), float("nan"), dtype=dtype)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = t[:, : heads * d], t[:, heads * d : (heads + kv_heads) * d]
        return (q.view(n, heads, d), k.view(n, kv_heads, d), t[:, (heads + kv_heads) * d :].view(n, kv_heads, d))

    want, want_cache = qkv.clone(), data.clone()
    q, k, v = views(want)
    cpp.rotary_(q, k, table, positions)
    write_kv(want_cache[:, 1, 0], want_cache[:, 1, 1], k, v, slots)
    got, got_cache = qkv.clone(), data.clone()
    cpp.rotary_write_kv_(*views(got), table, positions, (got_cache[:, 1, 0], got_cache[:, 1, 1]), slots)
    assert torch.equal(got, want)  # q and k rotated in place exactly as rotary_ does, v untouched
    torch.testing.assert_close(got_cache, want_cache, atol=0, rtol=0, equal_nan=True)  # only the 5 slots
    eager, eager_cache = qkv.clone(), data.clone()
    EagerOps().rotary_write_kv_(*views(eager), table, positions, (eager_cache[:, 1, 0], eager_cache[:, 1, 1]), slots)
    torch.testing.assert_close(eager_cache, want_cache, equal_nan=True, **TOL[dtype])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpp.rotary_write_kv_(*views(qkv.clone()), table, positions, (got_cache[:, 1, 0], got_cache[:, 1, 1]),
                             torch.tensor([0, 1, 2, 3, 8 * block_size]))


@pytest.mark.parametrize("vocab", [1, 63, 64, 1000, 49152])
def test_argmax_rows_matches_torch_max(cpp: CppOps, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=g)
    last = vocab - 1
    x[1, last] = 1e9  # the last element
    x[2, 0] = 1e9
    if vocab > 3:
        x[3, [1, last]] = 1e9  # a tie: the first
        x[4, [2, 3]] = float("nan")  # a NaN wins, the first one
        x[6, 1:] = -1.0
        x[6, 0] = -0.0
    x[5] = 0.0
    x[7] = -float("inf")  # all -inf: index 0
    x[8, last] = float("inf")
    x[9, 0] = float("nan")
    for t in (x, x[:, : max(1, vocab // 2)], x[::3], x[:1]):
        assert torch.equal(cpp.argmax_rows(t), t.max(dim=-1).indices)
        assert torch.equal(EagerOps().argmax_rows(t), t.max(dim=-1).indices)
    assert torch.equal(cpp.argmax_rows(x.bfloat16()), x.bfloat16().max(dim=-1).indices)  # other dtypes: torch's


@pytest.mark.parametrize("vocab", [1, 7, 64, 1000, 49152])
def test_sample_rows_draws_the_references_tokens(cpp: CppOps, vocab: int) -> None:
    """The fused draw inverts the same CDF as target_probs + sample_from: the same token for the same uniform
    (greedy rows, temperatures, rows fed as views), and never a token of weight 0."""
    g = torch.Generator().manual_seed(vocab)
    for trial in range(5):
        x = torch.randn(16, vocab, generator=g) * (1 + 3 * trial)
        temps = torch.tensor([0.0, 0.5, 1.0, 1.7] * 4)
        u = torch.rand(16, generator=g, dtype=torch.float64)
        u[0], u[1] = 0.0, 1.0 - 1e-12  # the ends of the CDF
        want = EagerOps().sample_rows(x, temps, u)
        assert torch.equal(cpp.sample_rows(x, temps, u), want)
        assert torch.equal(want[temps == 0], x[temps == 0].max(dim=-1).indices)
        assert torch.equal(cpp.sample_rows(x[::2], temps[::2], u[::2]), want[::2])
    if vocab > 3:
        x = torch.zeros(3, vocab)
        x[:, ::2] = -float("inf")  # zero weight: never drawn, at any uniform
        drawn = cpp.sample_rows(x, torch.ones(3), torch.tensor([0.0, 0.5, 1.0 - 1e-15], dtype=torch.float64))
        assert all(int(t) % 2 == 1 for t in drawn)
        x = torch.randn(2, vocab)
        x[0, 2] = float("nan")  # no finite mass: the first maximum (the NaN), as greedy
        x[1, 3] = float("inf")
        assert cpp.sample_rows(x, torch.ones(2), torch.full((2,), 0.5, dtype=torch.float64)).tolist() == [2, 3]


def test_sample_rows_follows_the_softmax(cpp: CppOps) -> None:
    """Drawn with many uniforms, each token's share is its softmax probability at the row's temperature."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    for temp in (0.7, 1.0, 2.0):
        u = torch.rand(20000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        drawn = cpp.sample_rows(x.repeat(len(u), 1), torch.full((len(u),), temp), u)
        share = torch.bincount(drawn, minlength=5).double() / len(u)
        assert torch.allclose(share, torch.softmax(x[0].double() / temp, dim=0), atol=0.015)


def test_mode_off_and_cuda_use_the_eager_reference_ops() -> None:
    assert isinstance(fused_ops_for(torch.device("cpu"), "off"), EagerOps)
    assert isinstance(fused_ops_for(torch.device("cuda"), "on"), EagerOps)
    with pytest.raises(ValueError, match="TANDEM_FUSED_OPS"):
        import os

        os.environ["TANDEM_FUSED_OPS"] = "fast"
        try:
            fused_ops_for(torch.device("cpu"))
        finally:
            del os.environ["TANDEM_FUSED_OPS"]


def _greedy(model: torch.nn.Module, prompt_sets: list[list[int]], n: int) -> dict[str, list[int]]:
    engine = ColocatedEngine(model, CacheConfig(block_size=4, num_blocks=128),  # type: ignore[arg-type]
                             SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=16))
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompt_sets):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def test_fused_model_matches_the_reference_forward(tiny_model_factory: Callable[..., Path]) -> None:
    # the reference: the same forward with the eager ops (tests/model/test_llama_parity.py holds it to
    # transformers' outputs)
    model_dir = tiny_model_factory("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    model = load_model(model_dir, dtype="float32")
    ops = fused_ops_for(torch.device("cpu"), "auto")
    if not isinstance(ops, CppOps):
        pytest.skip("no C++ compiler / ninja here")
    lengths = [5, 1, 17]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    meta = AttentionMetadata.build(lengths, [0] * len(lengths))
    with torch.inference_mode():
        model.fused_ops = EagerOps()
        want = model(ids, positions, meta)
        model.fused_ops = ops
        got = model(ids, positions, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    prompt_sets = [ids[:5].tolist(), ids[5:6].tolist(), ids[6:].tolist()]
    model.fused_ops = EagerOps()
    reference = _greedy(model, prompt_sets, 12)
    model.fused_ops = ops
    assert _greedy(model, prompt_sets, 12) == reference  # greedy output unchanged in fp32


def test_kernels_release_the_gil_while_they_run() -> None:
    """A node's gRPC threads share its process with the engine: while a kernel runs, Python threads run too."""
    import threading
    import time


    module = cpu_kernels()
    if module is None:
        pytest.skip("no C++ toolchain: the fused ops are not built")
    rows = torch.randn(2048, 49152)
    module.argmax_rows(rows)  # warm
    started = time.perf_counter()
    module.argmax_rows(rows)
    one_call = time.perf_counter() - started
    calls = max(1, int(0.3 / max(one_call, 1e-4)))  # about 0.3 s of kernel time in all
    done = threading.Event()
    ticks = 0

    def count() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.0005)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.01)
    before = ticks
    for _ in range(calls):
        module.argmax_rows(rows)
    during = ticks - before
    done.set()
    counter.join()
    # Holding the GIL, each call would let the counter run only between calls (about `calls` ticks at most).
    assert during > 2 * calls + 20, (during, calls, one_call)
