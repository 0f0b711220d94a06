"""Tensor- and pipeline-parallel shards of a tiny Llama (and a Qwen3, a Phi-3, a Gemma 2 and a Gemma 3 at T=2, the
Gemma 2 at P=2 too) give the unsharded model's hidden states and logits.

Real processes ("spawn", torch.distributed gloo on loopback): one world of 2 ranks runs T=2 and P=2, one of 4
runs T=2 x P=2 and T=4 over 2 KV heads (replicated) writing one shared-memory KV cache. Each case prefills
three sequences, decodes three steps and runs a mixed step (one sequence extends by 3 tokens beside two
decodes) through the paged cache, with the eager reference ops and the fused C++ ones, teacher-forced with the unsharded
model's greedy tokens. Pipeline stages hand hidden states on with gloo send/recv, as the node's workers do.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.attention.torch_backend import TorchAttentionBackend
from common.config.model_config import ModelConfig
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.model.fused_ops import EagerOps, FusedOps, fused_ops_for
from common.model.loader import load_model
from common.parallel.comm import GlooComm, SingleRank
from common.parallel.layout import ParallelLayout
from common.parallel.spawn import run_ranks
from common.parallel.tp_model import KVCacheShard, gather_logits, prepare_shard, shard_model, stage_forward
from common.quant.config import QuantConfig, QuantizationError
from common.serving.port_reservation import reserve_port

BLOCK_SIZE, NUM_BLOCKS = 4, 24
TABLES = [[5, 0, 9, 13], [2, 7, 11, 14], [1, 3, 8, 20]]  # scattered blocks, 16 slots per sequence
PROMPT_LENS = (5, 3, 7)
DECODE_STEPS, EXTEND = 3, 3
SENTINEL = 1234.5  # what the cache holds before anyone writes
# Model A: tied embeddings, biases on q/k/v/o and the MLP (row-parallel biases must be added once), a vocabulary
# that T=2 and T=4 must pad. Model B: untied, 4 query heads over 2 KV heads (T=4 replicates them).
MODEL_A: dict[str, Any] = {"vocab_size": 125, "intermediate_size": 128, "tie_word_embeddings": True,
                           "attention_bias": True, "mlp_bias": True}
MODEL_B: dict[str, Any] = {"intermediate_size": 128}
# Qwen3: q/k norms (one [head_dim] weight each, whole on every rank), head_dim 32 apart from hidden / heads.
QWEN3: dict[str, Any] = {"intermediate_size": 128, "head_dim": 32}
# Mixtures of experts: each expert's columns split (T=2), or whole experts per rank (--expert-parallel); Qwen3-MoE
# with a dense first layer (its MLP split as a dense model's) and q/k norms.
MIXTRAL: dict[str, Any] = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}
# gpt-oss: sinks per query head (split with the heads), biased experts (the down bias added once), a window
GPT_OSS: dict[str, Any] = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16,
                           "sliding_window": 6, "max_position_embeddings": 256}
QWEN3_MOE: dict[str, Any] = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                             "intermediate_size": 128, "mlp_only_layers": [0], "head_dim": 16, "norm_topk_prob": True}
# Gemma 2 / 3: sandwich norms, (1 + w) norms and Gemma 3's q/k norms whole on every rank, GELU-tanh over each
# rank's MLP columns, the attention soft-cap over each rank's heads and the final one over its logit columns,
# sliding layers (window 4, shorter than the prompts) beside global ones, Gemma 3's local rotary base.
GEMMA: dict[str, Any] = {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 24, "vocab_size": 125}
Step = tuple[list[int], list[int], list[int], list[int]]  # query_lens, context_lens, input_ids, positions


@dataclass(frozen=True)
class Case:
    name: str
    model_dir: str
    tp: int
    pp: int
    fused: bool
    quantization: str
    schedule: list[Step]
    shared_kv: tuple[str, bytes] | None  # a segment the parent owns, or None: a private cache per rank
    expert_parallel: bool = False


@dataclass
class Reference:
    schedule: list[Step]
    hidden: list[torch.Tensor]
    logits: list[torch.Tensor]
    cache: torch.Tensor


def _fused_ops(fused: bool) -> FusedOps:
    """The C++ fused ops (where they build), or the eager reference ops."""
    return fused_ops_for(torch.device("cpu"), "auto") if fused else EagerOps()


def _spec(config: ModelConfig) -> KVCacheSpec:
    return KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, "float32")


def _reference(model_dir: Path, fused: bool, quantization: str = "none") -> Reference:
    """The unsharded model through the same steps; its greedy tokens become the schedule."""
    model = load_model(model_dir, "float32", quantization=quantization)
    model.fused_ops = _fused_ops(fused)
    cache = KVCache(_spec(model.config), NUM_BLOCKS)
    cache.data.fill_(SENTINEL)
    gen = torch.Generator().manual_seed(3)
    pending = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    lens = [0] * len(pending)
    ref = Reference([], [], [], cache.data)
    for step in range(2 + DECODE_STEPS):
        q = [len(p) for p in pending]
        positions = [p for c, n in zip(lens, q, strict=True) for p in range(c, c + n)]
        ids = [t for p in pending for t in p]
        meta = AttentionMetadata.build(q, lens, TABLES, BLOCK_SIZE)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions), meta, cache)
            logits = model.compute_logits(hidden)
        ref.schedule.append((q, list(lens), ids, positions))
        ref.hidden.append(hidden)
        ref.logits.append(logits)
        lens = [c + n for c, n in zip(lens, q, strict=True)]
        ends = torch.tensor(q).cumsum(0) - 1
        pending = [[int(t)] for t in logits[ends].argmax(-1)]
        if step == DECODE_STEPS:  # the last step: sequence 0 extends by several tokens
            pending[0] += torch.randint(3, model.config.vocab_size, (EXTEND - 1,), generator=gen).tolist()
    return ref


def _run_case(case: Case, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from common.kv.shared_segment import SharedSegment

    config = ModelConfig.from_pretrained(case.model_dir)
    placement = ParallelLayout(case.tp, case.pp, case.expert_parallel).placement(rank, config)
    groups = [dist.new_group(list(range(s * case.tp, (s + 1) * case.tp))) for s in range(case.pp)]
    comm = GlooComm(groups[placement.pp_rank], list(placement.tp_group))
    model = load_model(case.model_dir, "float32", prepare=False)
    shard_model(model, placement, comm)
    prepare_shard(model, QuantConfig.parse(case.quantization))
    model.fused_ops = _fused_ops(case.fused)
    cache = KVCache(_spec(config), NUM_BLOCKS)
    segment = None
    if case.shared_kv is None:
        cache.data.fill_(SENTINEL)
    else:  # the node's one KV tensor, mapped by every rank
        segment = SharedSegment.open(*case.shared_kv)
        cache.data = segment.data().view(torch.float32).view(cache.data.shape)
    kv = KVCacheShard.for_rank(cache, placement)
    out: dict[str, Any] = {"hidden": [], "logits": [], "cache": None}
    for q, c, ids, positions in case.schedule:
        meta = AttentionMetadata.build(q, c, TABLES, BLOCK_SIZE)
        x, residual = torch.tensor(ids), None
        if placement.prev_stage_rank is not None:
            buf = torch.empty(2, len(ids), config.hidden_size)  # hidden and the residual stream
            dist.recv(buf, placement.prev_stage_rank)
            x, residual = buf[0], buf[1]
        hidden, residual = stage_forward(model, x, torch.tensor(positions), meta, kv, residual)
        if placement.next_stage_rank is not None:
            dist.send(torch.stack([hidden] if residual is None else [hidden, residual]), placement.next_stage_rank)
        else:
            out["hidden"].append(hidden.clone())
            out["logits"].append(gather_logits(model, hidden, comm))
    if segment is None:
        out["cache"] = cache.data.clone()
    dist.barrier()  # every rank is done with the shared cache before the parent reads it
    return out


def _worker(rank: int, world: int, init_method: str, cases: list[Case], out_dir: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        with torch.no_grad():
            for case in cases:
                torch.save(_run_case(case, rank), Path(out_dir) / f"{case.name}-{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def _run_world(world: int, cases: list[Case], out_dir: Path, timeout: float = 150.0) -> None:
    """Start ``world`` rank processes, wait for all of them, and fail (killing the rest) at the first error."""
    port = reserve_port()
    codes = run_ranks(_worker, [(r, world, f"tcp://127.0.0.1:{port}", cases, str(out_dir)) for r in range(world)],
                      timeout)
    if any(code != 0 for code in codes):
        errors = "\n".join(f.read_text() for f in sorted(out_dir.glob("error-*.txt")))
        pytest.fail(f"rank processes failed or timed out (exit codes {codes}):\n{errors}")


@dataclass
class World:
    refs: dict[str, Reference] = field(repr=False)
    configs: dict[str, ModelConfig] = field(repr=False)
    # case -> per rank: hidden and logits per step (last stage only), its private cache after the run
    results: dict[str, list[dict[str, Any]]] = field(repr=False)
    shared: dict[str, torch.Tensor] = field(repr=False)  # case -> the shared KV tensor after the run


def _world(tmp_path_factory: pytest.TempPathFactory, world: int, specs: list[tuple[Any, ...]],
           shared: bool) -> Iterator[World]:
    """specs: (case, model, T, P, fused ops, quantization[, expert parallel])."""
    refs: dict[str, Reference] = {}
    caches: dict[str, KVCache] = {}
    cases: list[Case] = []
    for name, model_dir, tp, pp, fused, quant, *ep in specs:
        ref = refs[name] = _reference(model_dir, fused, quant)
        kv = None
        if shared:
            cache = caches[name] = KVCache(_spec(ModelConfig.from_pretrained(model_dir)), NUM_BLOCKS, shared=True)
            cache.data.fill_(SENTINEL)
            assert cache.segment is not None
            kv = (cache.segment.name, cache.segment.nonce)
        cases.append(Case(name, str(model_dir), tp, pp, fused, quant, ref.schedule, kv, bool(ep and ep[0])))
    out_dir = tmp_path_factory.mktemp(f"world{world}")
    try:
        _run_world(world, cases, out_dir)
        results = {c.name: [torch.load(out_dir / f"{c.name}-{r}.pt") for r in range(world)] for c in cases}
        configs = {c.name: ModelConfig.from_pretrained(c.model_dir) for c in cases}
        yield World(refs, configs, results, {name: c.data.clone() for name, c in caches.items()})
    finally:
        for cache in caches.values():
            cache.close()


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Callable[..., Path]) -> Iterator[World]:
    a = tiny_model_factory("llama", seed=5, **MODEL_A)
    qwen3 = tiny_model_factory("qwen3", seed=5, **QWEN3)
    # Phi-3 (its checkpoint's fused projections) with a window shorter than the prompts, on every layer
    phi3 = tiny_model_factory("phi3", seed=5, sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    mixtral = tiny_model_factory("mixtral", seed=6, **MIXTRAL)
    qwen3_moe = tiny_model_factory("qwen3_moe", seed=6, **QWEN3_MOE)
    gpt_oss = tiny_model_factory("gpt_oss", seed=6, **GPT_OSS)
    gemma2 = tiny_model_factory("gemma2", seed=5, attn_logit_softcapping=0.01, final_logit_softcapping=1.0, **GEMMA)
    gemma3 = tiny_model_factory("gemma3_text", seed=5, num_hidden_layers=4, sliding_window_pattern=2,
                                final_logit_softcapping=1.0, **GEMMA)
    yield from _world(tmp_path_factory, 2, [
        ("tp2-gptoss", gpt_oss, 2, 1, True, "none"), ("ep2-gptoss", gpt_oss, 2, 1, False, "none", True),
        ("tp2-mixtral", mixtral, 2, 1, True, "none"), ("ep2-mixtral", mixtral, 2, 1, True, "none", True),
        ("ep2-qwen3moe", qwen3_moe, 2, 1, False, "none", True), ("pp2-qwen3moe", qwen3_moe, 1, 2, True, "none"),
        ("tp2", a, 2, 1, False, "none"), ("tp2-fused", a, 2, 1, True, "none"),
        ("pp2", a, 1, 2, False, "none"), ("pp2-fused", a, 1, 2, True, "none"),
        ("tp2-int8", a, 2, 1, True, "int8"), ("tp2-qwen3-fused", qwen3, 2, 1, True, "none"),
        ("tp2-phi3-window-fused", phi3, 2, 1, True, "none"),
        ("tp2-gemma2-fused", gemma2, 2, 1, True, "none"), ("tp2-gemma3-fused", gemma3, 2, 1, True, "none"),
        ("pp2-gemma2", gemma2, 1, 2, False, "none"),
    ], shared=False)


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Callable[..., Path]) -> Iterator[World]:
    a = tiny_model_factory("llama", seed=5, **MODEL_A)
    b = tiny_model_factory("llama", seed=6, **MODEL_B)
    yield from _world(tmp_path_factory, 4, [
        ("tp2pp2", a, 2, 2, False, "none"), ("tp2pp2-fused", a, 2, 2, True, "none"),
        ("tp4-kv2", b, 4, 1, False, "none"), ("tp4-kv2-fused", b, 4, 1, True, "none"),
    ], shared=True)


def _check_outputs(w: World, case: str, last_stage: list[int], atol: float = 1e-5) -> None:
    ref = w.refs[case]
    for rank in last_stage:
        out = w.results[case][rank]
        assert len(out["logits"]) == len(ref.logits)
        for step, (hidden, logits) in enumerate(zip(out["hidden"], out["logits"], strict=True)):
            where = f"{case}, rank {rank}, step {step}"
            for got, expected in ((hidden, ref.hidden[step]), (logits, ref.logits[step])):
                assert got.shape == expected.shape, where
                diff = (got - expected).abs().max().item()
                assert diff <= atol, f"{where}: max abs difference {diff:.2e} > {atol:.0e}"
            assert torch.equal(logits.argmax(-1), ref.logits[step].argmax(-1)), f"{where}: greedy tokens differ"


@pytest.mark.parametrize("case", ["tp2", "tp2-fused", "tp2-qwen3-fused", "tp2-phi3-window-fused", "tp2-mixtral",
                                  "ep2-mixtral", "ep2-qwen3moe", "tp2-gptoss", "ep2-gptoss", "tp2-gemma2-fused",
                                  "tp2-gemma3-fused"])
def test_tp2_matches_unsharded(world2: World, case: str) -> None:
    _check_outputs(world2, case, [0, 1])


@pytest.mark.parametrize("case", ["pp2", "pp2-fused", "pp2-qwen3moe", "pp2-gemma2"])
def test_pp2_matches_unsharded(world2: World, case: str) -> None:
    _check_outputs(world2, case, [1])


@pytest.mark.parametrize("case", ["tp2pp2", "tp2pp2-fused", "tp4-kv2", "tp4-kv2-fused"])
def test_four_ranks_match_unsharded_and_fill_one_shared_cache(world4: World, case: str) -> None:
    _check_outputs(world4, case, [2, 3] if case.startswith("tp2pp2") else [0, 1, 2, 3])
    # Every rank wrote its heads (replicated KV heads: two ranks each) and layers into the one segment.
    torch.testing.assert_close(world4.shared[case], world4.refs[case].cache, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("case", "tp", "pp"), [("tp2", 2, 1), ("pp2-fused", 1, 2)])
def test_each_rank_writes_only_its_heads_and_layers(world2: World, case: str, tp: int, pp: int) -> None:
    ref = world2.refs[case].cache  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    union = torch.full_like(ref, SENTINEL)
    for rank in range(tp * pp):
        cache = world2.results[case][rank]["cache"]
        placement = ParallelLayout(tp, pp).placement(rank, world2.configs[case])
        (h0, h1), (l0, l1) = placement.kv_heads, placement.layers
        mine = torch.zeros(ref.shape, dtype=torch.bool)
        mine[:, l0:l1, :, :, h0:h1] = True
        assert torch.all(cache[~mine] == SENTINEL), f"rank {rank} wrote outside its heads/layers"
        union[mine] = cache[mine]
    torch.testing.assert_close(union, ref, atol=1e-5, rtol=0)


def test_int8_shards_stay_close_to_int8_unsharded(world2: World) -> None:
    # o_proj / down_proj scales are per output channel over each rank's half of the row: close, not equal.
    ref = world2.refs["tp2-int8"]
    out = world2.results["tp2-int8"][0]
    for step, logits in enumerate(out["logits"]):
        torch.testing.assert_close(logits, ref.logits[step], atol=2e-3, rtol=0.05)
        q = ref.schedule[step][0]
        ends = torch.tensor(q).cumsum(0) - 1  # the rows a sampler reads
        assert torch.equal(logits[ends].argmax(-1), ref.logits[step][ends].argmax(-1))


# --- in-process checks ---


def test_single_rank_shard_is_the_model(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, "float32", prepare=False)
    before = dict(model.named_parameters())
    placement = ParallelLayout().placement(0, model.config)
    assert shard_model(model, placement, SingleRank()) is model
    assert dict(model.named_parameters()).keys() == before.keys()
    assert all(p is before[n] for n, p in model.named_parameters())


class _PairStub:
    """A communicator of two ranks for building a shard (no forward is run)."""

    rank, world_size = 0, 2


def test_prepare_shard_names_the_slice_that_does_not_fit(tiny_model_factory: Callable[..., Path]) -> None:
    model = load_model(tiny_model_factory("llama", seed=5, intermediate_size=96), "float32", prepare=False)
    shard_model(model, ParallelLayout(2).placement(0, model.config), _PairStub())  # type: ignore[arg-type]
    with pytest.raises(QuantizationError, match=r"mlp.down_proj has 48 input features.*tensor-parallel"):
        prepare_shard(model, QuantConfig.parse("int8"))


def test_pipeline_stages_quantized_in_one_process_match_int8_unsharded(tiny_model_factory: Callable[..., Path]
                                                                       ) -> None:
    # T = 1: no row-parallel split, so int8 stages quantize exactly as the whole model does (the stage without
    # the LM head holds an empty one; the last stage's head is the tied embedding's rows).
    model_dir = tiny_model_factory("llama", seed=5, **MODEL_A)
    ref = _reference(model_dir, fused=True, quantization="int8")
    layout = ParallelLayout(1, 2)
    stages = []
    for rank in range(2):
        model = load_model(model_dir, "float32", prepare=False)
        shard_model(model, layout.placement(rank, model.config), SingleRank())
        prepare_shard(model, QuantConfig.parse("int8"))
        model.fused_ops = _fused_ops(True)
        stages.append(model)
    assert stages[0].lm_head is not None and stages[0].lm_head.out_features == 0
    cache = KVCache(_spec(stages[0].config), NUM_BLOCKS)
    with torch.no_grad():
        for step, (q, c, ids, positions) in enumerate(ref.schedule):
            meta = AttentionMetadata.build(q, c, TABLES, BLOCK_SIZE)
            x, residual = torch.tensor(ids), None
            for model in stages:
                x, residual = stage_forward(model, x, torch.tensor(positions), meta, cache, residual)
            torch.testing.assert_close(gather_logits(stages[1], x, SingleRank()), ref.logits[step], atol=1e-5, rtol=0)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_shard_model_refuses_prepared_weights(tiny_model_factory: Callable[..., Path], quantization: str) -> None:
    model = load_model(tiny_model_factory("llama", seed=5, **MODEL_A), "float32", quantization=quantization)
    with pytest.raises(TypeError, match="needs float weights as loaded"):
        shard_model(model, ParallelLayout(2).placement(0, model.config), _PairStub())  # type: ignore[arg-type]


@pytest.mark.parametrize("compiled", [True, False], ids=["cpp-decode", "torch-decode"])
def test_attention_reads_and_writes_head_sliced_cache_views(compiled: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4, dtype_name="float32")
    cache = KVCache(spec, 8)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    shard = KVCacheShard(cache, 1, 3, layers=(1, 2))
    backend = TorchAttentionBackend(compiled_decode=compiled)
    tables = [[3, 5], [1, 6], [7, 0]]
    for query_lens in ([1, 1, 1], [3, 1, 1]):  # decode only, then an extend beside two decodes
        meta = AttentionMetadata.build(query_lens, [4, 2, 5], tables, 4)
        n = meta.num_tokens
        q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
        before = cache.data.clone()
        view = shard.layer(1)
        assert not view[0].is_contiguous()
        dense = (view[0].contiguous(), view[1].contiguous())
        expected = backend.forward(q, k, v, dense, meta, 0.25)
        got = backend.forward(q, k, v, view, meta, 0.25)
        torch.testing.assert_close(got, expected)
        changed = (cache.data != before).nonzero()
        assert changed.numel() and set(changed[:, 1].tolist()) == {1} and set(changed[:, 4].tolist()) <= {1, 2}
        torch.testing.assert_close(cache.data[:, 1, 0, :, 1:3], dense[0])


def test_expert_placements_split_experts_or_their_columns(tiny_model_factory: Callable[..., Path]) -> None:
    config = ModelConfig.from_pretrained(tiny_model_factory("qwen3_moe", seed=6, **QWEN3_MOE))
    columns = [ParallelLayout(2).placement(r, config) for r in range(2)]
    assert [(p.experts, p.expert_intermediate) for p in columns] == [((0, 6), (0, 16)), ((0, 6), (16, 32))]
    whole = [ParallelLayout(2, 1, expert_parallel=True).placement(r, config) for r in range(2)]
    assert [(p.experts, p.expert_intermediate) for p in whole] == [((0, 3), (0, 32)), ((3, 6), (0, 32))]
    assert whole[1].intermediate == (64, 128)  # the dense first layer splits as a dense model's MLP


@pytest.mark.parametrize(("layout", "message"), [
    ((4, 1, True), r"--tensor-parallel-size 4 must divide num_experts \(6\) with --expert-parallel"),
    ((1, 1, True), r"--expert-parallel splits the experts over the --tensor-parallel-size ranks; "
                   r"--tensor-parallel-size is 1"),
    ((3, 1, False), r"--tensor-parallel-size 3 must divide num_attention_heads"),
])
def test_expert_layouts_refused_naming_the_flag(tiny_model_factory: Callable[..., Path], layout: tuple[int, int, bool],
                                                message: str) -> None:
    config = ModelConfig.from_pretrained(tiny_model_factory("qwen3_moe", seed=6, **QWEN3_MOE))
    with pytest.raises(ValueError, match=message):
        ParallelLayout(*layout).validate(config)


def test_expert_parallel_needs_experts(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"--expert-parallel splits a mixture of experts' experts; llama has none"):
        ParallelLayout(2, 1, expert_parallel=True).validate(ModelConfig.from_pretrained(tiny_model_dir))
