"""Sliding-window attention end to end (issue 36): Mistral with ``sliding_window``, Qwen2 / Qwen3 with
``use_sliding_window`` over mixed full and sliding layers, greedy fp32 output identical to transformers.

Windows are shorter than the prompts; the paged runs go through chunked prefill (chunks smaller than the
window and the prompt), prefix-cache reuse (the same prompts twice) and n-gram speculative verification, with
the fused C++ ops on and off and the compiled decode kernel on and off (TANDEM_CPU_KERNELS=0: PyTorch's decode).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from common.config.model_config import ModelConfig
from common.model.loader import load_model
from tests.model.test_families import _hf, _hf_greedy, _with_tokenizer, generate_cli

# name -> (model_type, overrides of the tiny config (hidden 64, vocab 128)), each with a window shorter than
# the prompts below.
WINDOWED: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", {"sliding_window": 5}),
    # layer 0 full, layers 1 and 2 sliding (max_window_layers)
    "qwen2-mixed": ("qwen2", {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 6,
                              "max_window_layers": 1}),
    # layer_types: sliding, full, sliding
    "qwen3-mixed": ("qwen3", {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 16, "use_sliding_window": True, "sliding_window": 4,
                              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
}
EXPECTED_WINDOWS = {"mistral": (5, 5), "qwen2-mixed": (None, 6, 6), "qwen3-mixed": (4, None, 4)}
GREEDY_TOKENS = 12


def _model_dir(factory: Callable[..., Path], name: str, **extra: Any) -> Path:
    model_type, overrides = WINDOWED[name]
    return factory(model_type, seed=5, **{**overrides, **extra})


def _windowless(factory: Callable[..., Path], name: str) -> Path:
    """The same weights without the window (the seed fixes them): what the window must change."""
    model_type, overrides = WINDOWED[name]
    if model_type == "mistral":
        return factory(model_type, seed=5, **{**overrides, "sliding_window": None})
    whole = {**overrides, "use_sliding_window": False}
    if "layer_types" in overrides:  # transformers cannot build sliding layers without a window
        whole["layer_types"] = ["full_attention"] * len(overrides["layer_types"])
    return factory(model_type, seed=5, **whole)


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_layer_windows_are_read_as_transformers_sets_them(tiny_model_factory: Callable[..., Path], name: str) -> None:
    config = ModelConfig.from_pretrained(_model_dir(tiny_model_factory, name))
    assert config.layer_windows == EXPECTED_WINDOWS[name]
    hf = _hf(_model_dir(tiny_model_factory, name)).config
    hf_windows = [hf.sliding_window if getattr(hf, "layer_types", None) is None or hf.layer_types[i] ==
                  "sliding_attention" else None for i in range(hf.num_hidden_layers)]
    assert list(config.layer_windows) == hf_windows


@pytest.mark.parametrize("fused", ["on", "off"])
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_ragged_logits_match_transformers(tiny_model_factory: Callable[..., Path], name: str, fused: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    model_dir = _model_dir(tiny_model_factory, name)
    model = load_model(model_dir, dtype="float32")
    lengths = [5, 1, 17, 40]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]
    meta = AttentionMetadata.build(lengths, [0] * len(lengths))
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor([t for s in seqs for t in s]),
                                            torch.cat([torch.arange(n) for n in lengths]), meta))
        expected = torch.cat([_hf(model_dir)(torch.tensor([s])).logits[0] for s in seqs])
        unwindowed = torch.cat([_hf(_windowless(tiny_model_factory, name))(torch.tensor([s])).logits[0]
                                for s in seqs])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert (expected - unwindowed).abs().max() > 1e-2  # the window matters for these prompts


def _greedy_runs(model_dir: Path, prompts: list[list[int]], speculative: bool) -> tuple[list[list[int]], Any]:
    """Greedy completions of ``prompts`` twice (the second time from the prefix cache) through the offline LLM,
    in 4-token blocks and 3-token prefill chunks."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    spec = (SpeculativeConfig(method=SpeculativeMethod.NGRAM, num_speculative_tokens=3, max_batch_size=8)
            if speculative else None)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", cache=CacheConfig(block_size=4, num_blocks=256),
             scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=3),
             speculative=spec) as llm:
        assert llm.model.decode_step is None  # the one-call C++ step reads whole sequences: not for windows
        # blocks before the window are freed early only when every layer is windowed (mistral here)
        windows = llm.model.config.layer_windows
        assert llm.engine.kv.window == (None if None in windows else max(w for w in windows if w is not None))
        first = [c.token_ids for c in llm.generate(prompts, params)]
        assert llm.engine.kv.prefix_cache_hits == 0
        second = [c.token_ids for c in llm.generate(prompts, params)]
        assert llm.engine.kv.prefix_cache_hits > 0  # the second pass started from cached blocks
        assert first == second
        stats = (llm.engine.scheduler.num_draft_tokens, llm.engine.scheduler.num_accepted_tokens)
    return first, stats


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize(("fused", "cpu_kernels"), [("on", "1"), ("off", "1"), ("on", "0"), ("off", "0")])
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_offline_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path], name: str,
                                                           fused: str, cpu_kernels: str, speculative: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    monkeypatch.setenv("TANDEM_CPU_KERNELS", cpu_kernels)
    model_dir = _with_tokenizer(_model_dir(tiny_model_factory, name))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 14)]
    prompts.append((prompts[0][:4] * 5)[:17])  # repetitive: the n-gram lookup finds drafts
    got, (drafts, _accepted) = _greedy_runs(model_dir, prompts, speculative)
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion == _hf_greedy(model_dir, prompt, GREEDY_TOKENS), name
    if speculative:
        assert drafts > 0  # verification ran over the window


def test_windowed_greedy_differs_from_the_whole_sequence(tiny_model_factory: Callable[..., Path]) -> None:
    """transformers' own greedy changes with the window here, so the identity above says the window is read."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 14)]
    for name in WINDOWED:
        windowed = [_hf_greedy(_model_dir(tiny_model_factory, name), p, GREEDY_TOKENS) for p in prompts]
        whole = [_hf_greedy(_windowless(tiny_model_factory, name), p, GREEDY_TOKENS) for p in prompts]
        assert windowed != whole, name


def test_windowed_mistral_through_tandem_generate(tiny_model_factory: Callable[..., Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _with_tokenizer(_model_dir(tiny_model_factory, "mistral"))
    prompt = "t17 t3 t99 t42 t8 t120 t64 t17 t3 t99 t42"
    for extra in ([], ["--speculative", "ngram"]):
        stdout, _, expected = generate_cli(model_dir, prompt, GREEDY_TOKENS, capsys, *extra)
        assert stdout == prompt + expected + "\n", extra


def test_decode_step_is_not_installed_for_a_window(tiny_model_factory: Callable[..., Path]) -> None:
    """The same shapes without the window take the one-call C++ step (where it builds); with it, op by op."""
    whole = load_model(_windowless(tiny_model_factory, "mistral"), dtype="float32")
    if whole.decode_step is None:
        pytest.skip("the one-call decode step does not build or apply on this machine")
    windowed = load_model(_model_dir(tiny_model_factory, "mistral"), dtype="float32")
    assert windowed.decode_step is None and windowed.fused_ops.name == "cpp"


def test_windowed_blocks_are_freed_mid_request(tiny_model_factory: Callable[..., Path]) -> None:
    """Mistral with window 5 in 4-token blocks: a 14-token prompt prefilled in one step keeps only the blocks a
    later query reads (the query at q reads q - 4 .. q), with exact ids, and the output stays transformers'."""
    from common.engine.llm import LLM
    from common.kv.kv_cache_manager import NULL_BLOCK as N
    from common.sampling.params import SamplingParams

    model_dir = _with_tokenizer(_model_dir(tiny_model_factory, "mistral"))
    prompt = torch.randint(3, 128, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", cache=CacheConfig(block_size=4, num_blocks=16),
             scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=None)) as llm:
        kv = llm.engine.kv
        tables, used, tokens = [], [], []
        for delta in llm.stream([prompt], params):
            tokens += delta.token_ids
            if not delta.finished:
                (running,) = llm.engine.scheduler.running
                tables.append(kv.block_table(running.request_id))
                used.append(kv.num_used_blocks)
            kv.check_integrity()
        assert kv.num_used_blocks == 0
        kv.check_integrity()
    assert tables == [
        [N, N, 2, 3],  # computed 14: the next query (14) reads 10..14, blocks 0 and 1 (0..7) freed
        [N, N, 2, 3],  # computed 15
        [N, N, N, 3],  # computed 16: block 2 (8..11) freed
        [N, N, N, 3, 4],  # computed 17: block 4 from the head of the free queue
        [N, N, N, 3, 4],  # computed 18
    ]
    assert used == [2, 2, 1, 2, 2]  # never more than ceil(5 / 4) + 1 blocks, against 5 for the whole sequence
    assert tokens == _hf_greedy(model_dir, prompt, 6)


def test_windowed_prompt_longer_than_the_pool_is_prefilled_chunk_by_chunk(tiny_model_factory: Callable[..., Path],
                                                                         ) -> None:
    """Mistral with window 5 in 4-token blocks: a 60-token prompt (15 blocks) in a 5-block pool, prefilled in
    3-token chunks; admission takes the first chunk's block, each chunk adds its own and frees those behind the
    window, so the pool never holds more than blocks_needed(5 + 3 + 2) = 3, and the output stays transformers'."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    model_dir = _with_tokenizer(_model_dir(tiny_model_factory, "mistral"))
    prompt = torch.randint(3, 128, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", cache=CacheConfig(block_size=4, num_blocks=5),
             scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=3)) as llm:
        kv = llm.engine.kv
        assert kv.blocks_needed(len(prompt)) > kv.pool.num_blocks
        tokens = []
        for delta in llm.stream([prompt], params):
            tokens += delta.token_ids
            kv.check_integrity()
        assert kv.num_used_blocks == 0 and kv.pool.peak_used_blocks <= 3
        assert llm.engine.scheduler.num_preemptions == 0
    assert tokens == _hf_greedy(model_dir, prompt, 6)


def _long_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (60, 23)]


def _long_prompt_run(model_dir: Path, num_blocks: int, max_tokens: int = 6, **llm_args: Any
                     ) -> tuple[list[list[int]], int, int, int]:
    """The two ``_long_prompts`` (60 and 23 tokens, 4-token blocks, 3-token chunks) through a small pool: the
    tokens, the pool's peak, the drafts proposed and those accepted."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    prompts = _long_prompts()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", cache=CacheConfig(block_size=4, num_blocks=num_blocks),
             scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=3),
             **llm_args) as llm:
        kv = llm.engine.kv
        assert kv.blocks_needed(len(prompts[0]) + max_tokens) > num_blocks  # the whole sequence would not fit
        got = [c.token_ids for c in llm.generate(prompts, params)]
        kv.check_integrity()
        assert kv.num_used_blocks == 0
        s = llm.engine.scheduler
        return got, kv.pool.peak_used_blocks, s.num_draft_tokens, s.num_accepted_tokens


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_windowed_blocks_are_freed_early_at_two_ranks(tiny_model_factory: Callable[..., Path],
                                                      layout: dict[str, int]) -> None:
    """T x P rank processes free blocks behind the window as one process does: a freed slot travels to the ranks
    as NULL_BLOCK (-1), which no query reads; the output stays transformers'."""
    model_dir = _with_tokenizer(_model_dir(tiny_model_factory, "mistral"))
    got, peak, _, _ = _long_prompt_run(model_dir, num_blocks=8, **layout)
    assert peak <= 2 * 3  # each request: the window (5) and a chunk (3), blocks_needed(5 + 3 + 2) = 3
    for prompt, tokens in zip(_long_prompts(), got, strict=True):
        assert tokens == _hf_greedy(model_dir, prompt, 6)


# draft -> (the draft's model directory arguments, quantization, acceptance it must reach)
DRAFTS: dict[str, tuple[dict[str, Any], str, float]] = {
    # another random model with a shorter window: its drafts are mostly rejected
    "other": ({"seed": 7, "sliding_window": 3, "num_hidden_layers": 1}, "none", 0.0),
    # the target's weights under another config (not its own copy: its KV is its own, computed in its frame)
    "same-weights": ({"seed": 5, "sliding_window": 5, "max_position_embeddings": 1000}, "none", 0.5),
    # the target's int8 copy: starts from the target's K/V of the blocks the table still holds
    "self-int8": ({"seed": 5, "sliding_window": 5}, "int8", 0.5),
}


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_a_windowed_draft_model_frees_blocks_early_and_stays_exact(tiny_model_factory: Callable[..., Path],
                                                                   draft: str, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """A windowed draft model beside a windowed target: the window the blocks are freed behind covers the
    draft's lag (its window and the step's drafts); the draft never reads a freed block (it restarts its
    context from the first block held, or copies the target's K/V of those blocks), the pool holds the window,
    and the greedy output stays transformers'."""
    from common.config.engine_config import SpeculativeConfig, SpeculativeMethod
    from common.spec_decode.draft_model import DraftModelProposer

    reads_freed = DraftModelProposer._reads_freed
    restarts: list[bool] = []

    def spy(self: DraftModelProposer, *args: Any) -> bool:
        restarts.append(reads_freed(self, *args))
        return restarts[-1]

    monkeypatch.setattr(DraftModelProposer, "_reads_freed", spy)
    model_dir = _with_tokenizer(_model_dir(tiny_model_factory, "mistral"))
    extra, quantization, acceptance = DRAFTS[draft]
    draft_dir = _with_tokenizer(tiny_model_factory("mistral", **extra))
    spec = SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model=str(draft_dir),
                             draft_quantization=quantization, num_speculative_tokens=3, adaptive=False)
    got, peak, drafted, accepted = _long_prompt_run(model_dir, num_blocks=12, max_tokens=16, speculative=spec)
    # window 5 + 3 drafts + 1: blocks_needed(9 + 3 + 2) = 4 per request, and the drafts' slots
    assert peak <= 2 * 5
    for prompt, tokens in zip(_long_prompts(), got, strict=True):
        assert tokens == _hf_greedy(model_dir, prompt, 16), draft
    assert drafted > 0 and accepted >= acceptance * drafted, (drafted, accepted)
    # the first step after each chunked prompt restarts the draft's context (the blocks before were freed);
    # later steps catch up within the window
    assert 2 <= sum(restarts) < len(restarts) / 2, restarts


def test_the_freeing_window_with_a_draft_model(tiny_model_factory: Callable[..., Path]) -> None:
    from common.config.engine_config import SpeculativeConfig, SpeculativeMethod
    from common.engine.engine_core import _kv_window

    target = load_model(_model_dir(tiny_model_factory, "mistral"), dtype="float32")
    spec = SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model="x", num_speculative_tokens=3)
    windowed = load_model(tiny_model_factory("mistral", seed=7, sliding_window=8, num_hidden_layers=1),
                          dtype="float32")
    whole = load_model(tiny_model_factory("mistral", seed=7, sliding_window=None, num_hidden_layers=1),
                       dtype="float32")
    assert _kv_window(target, None) == 5
    assert _kv_window(target, windowed, spec) == 8 + 3 + 1  # the larger window and the draft's lag
    assert _kv_window(target, whole, spec) is None  # a draft reading every block keeps them all
