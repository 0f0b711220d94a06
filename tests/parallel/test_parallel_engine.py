"""Nodes whose model spans T x P rank processes (common/parallel/executor.py, worker.py): real processes,
real shared memory, gloo; greedy fp32 outputs equal to one rank's (with and without speculative decoding), a
dead rank fails the node, bad layouts fail at start-up, and KV moves between disaggregated nodes of different
layouts."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.config.engine_config import SpeculativeConfig, SpeculativeMethod
from common.engine.llm import LLM
from common.parallel.executor import ParallelModelRunner, RankFailed, rank_cpus
from common.parallel.worker import micro_batches
from common.sampling.params import SamplingParams
from tandem_cli.launcher import Launcher, Topology
from tests.conftest import make_tiny_model
from tests.e2e.test_disaggregated import generate, request, wait_all_blocks_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(20, 49000, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def three_kv_heads_dir(tmp_path_factory: pytest.TempPathFactory, tiny_served_model_dir: Path) -> Path:
    """Like the tiny served model, with 6 heads over 3 KV heads (T = 3, as the bundled model) and 4 layers."""
    directory = tmp_path_factory.mktemp("tiny-kv3")
    make_tiny_model(directory, "llama", seed=5, vocab_size=49152, hidden_size=96, intermediate_size=192,
                    num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_served_model_dir / name).exists():
            shutil.copy(tiny_served_model_dir / name, directory / name)
    return directory


def outputs(model_dir: Path, batch: list[list[int]], params: SamplingParams = GREEDY,
            **layout: object) -> list[list[int]]:
    with LLM(model_dir, dtype="float32", **layout) as llm:  # type: ignore[arg-type]
        return [c.token_ids for c in llm.generate(batch, params)]


@pytest.fixture(scope="module")
def single_rank(three_kv_heads_dir: Path) -> list[list[int]]:
    return outputs(three_kv_heads_dir, prompts(5))


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2},
                                    {"tensor_parallel_size": 3, "pipeline_parallel_size": 2},
                                    {"tensor_parallel_size": 3, "parallel_collective": "gloo"}],
                         ids=["T3", "P2", "T3xP2", "T3-gloo"])  # replicated KV heads: test_tp_model.py (T=4)
def test_greedy_outputs_equal_one_rank(three_kv_heads_dir: Path, single_rank: list[list[int]],
                                       layout: dict[str, object]) -> None:
    assert outputs(three_kv_heads_dir, prompts(5), **layout) == single_rank


def test_a_long_prompt_in_chunks_with_micro_batches(three_kv_heads_dir: Path) -> None:
    """A prompt prefilled in several chunks beside decodes (mixed steps) through 2 stages x 2 micro-batches."""
    from common.config.engine_config import SchedulerConfig

    batch = prompts(3, seed=2) + [list(range(100, 400))]

    def run(**layout: object) -> list[list[int]]:
        with LLM(three_kv_heads_dir, dtype="float32", scheduler=SchedulerConfig(max_prefill_chunk=64),
                 **layout) as llm:  # type: ignore[arg-type]
            return [c.token_ids for c in llm.generate(batch, GREEDY)]

    assert run(pipeline_parallel_size=2, tensor_parallel_size=3) == run()


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}], ids=["T3", "P2"])
def test_bundled_model_layouts_equal_one_rank(smollm2_dir: Path, layout: dict[str, object]) -> None:
    with LLM(smollm2_dir, dtype="float32") as llm:
        batch = [llm.encode("The capital of France is"), llm.encode("def fibonacci(n):")]
        expected = [c.token_ids for c in llm.generate(batch, GREEDY_16)]
    assert outputs(smollm2_dir, batch, GREEDY_16, **layout) == expected


def test_quantized_shards_run(three_kv_heads_dir: Path, single_rank: list[list[int]]) -> None:
    got = outputs(three_kv_heads_dir, prompts(5), tensor_parallel_size=3, quantization="int8")
    agree = sum(a == b for g, s in zip(got, single_rank, strict=True) for a, b in zip(g, s, strict=True))
    assert agree >= 0.8 * sum(len(s) for s in single_rank)  # int8 of a random model: most tokens agree


def test_a_dead_rank_fails_the_node_with_its_name(three_kv_heads_dir: Path) -> None:
    llm = LLM(three_kv_heads_dir, dtype="float32", tensor_parallel_size=3)
    try:
        runner = llm.engine.runner
        assert isinstance(runner, ParallelModelRunner)
        assert llm.generate([prompts(1)[0]], GREEDY)[0].token_ids
        os.kill(runner.pids[1], signal.SIGKILL)
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) .*killed by signal 9"):
            llm.generate([prompts(1, seed=3)[0]], GREEDY)
    finally:
        llm.close()
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in runner.pids)


def _zombie(pid: int) -> bool:
    try:
        return " Z " in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True


@pytest.mark.parametrize(("layout", "message"), [
    ({"tensor_parallel_size": 4}, "--tensor-parallel-size 4"),
    ({"pipeline_parallel_size": 5}, "--pipeline-parallel-size 5"),
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be >= 1"),
])
def test_bad_layouts_fail_at_start_naming_the_flag(three_kv_heads_dir: Path, layout: dict[str, object],
                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(three_kv_heads_dir, dtype="float32", **layout)  # type: ignore[arg-type]


def spec_batch() -> list[list[int]]:
    """Prompts that repeat a motif (the n-gram lookup drafts, and the target accepts drafts) and random ones
    (where it also drafts, from single-token matches, and the target rejects drafts)."""
    return [(p * 5)[: 4 * len(p)] for p in prompts(3, seed=8)] + prompts(3, seed=9)


NGRAM = SpeculativeConfig(method=SpeculativeMethod.NGRAM, num_speculative_tokens=4, max_batch_size=16)
GREEDY_24 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(tiny_served_model_dir: Path) -> list[list[int]]:
    """One process, no speculation."""
    return outputs(tiny_served_model_dir, spec_batch(), GREEDY_24)


def speculating(model_dir: Path, batch: list[list[int]], params: list[SamplingParams], spec: SpeculativeConfig,
                **layout: object) -> tuple[list[list[int]], int, int]:
    """Outputs with ``spec`` across ranks, and the drafts proposed and accepted; every block freed."""
    with LLM(model_dir, dtype="float32", speculative=spec, **layout) as llm:  # type: ignore[arg-type]
        assert isinstance(llm.engine.runner, ParallelModelRunner)
        got = [c.token_ids for c in llm.generate(batch, params)]
        scheduler, kv = llm.engine.scheduler, llm.engine.kv
        kv.check_integrity()
        assert kv.num_used_blocks == 0
        return got, scheduler.num_draft_tokens, scheduler.num_accepted_tokens


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}],
                         ids=["T2", "P2", "T2xP2"])
def test_ngram_speculation_across_ranks_equals_plain_greedy(tiny_served_model_dir: Path,
                                                            plain_greedy: list[list[int]],
                                                            layout: dict[str, object]) -> None:
    """The node proposes, the ranks run the drafts as more query tokens and return every verified row's
    logits, the node verifies: greedy output is plain decoding's, and drafts were accepted, not only rejected."""
    batch = spec_batch()
    got, drafts, accepted = speculating(tiny_served_model_dir, batch, [GREEDY_24] * len(batch), NGRAM, **layout)
    assert got == plain_greedy
    assert drafts > accepted > 0


def test_sampled_and_greedy_requests_speculate_together_across_ranks(tiny_served_model_dir: Path,
                                                                     plain_greedy: list[list[int]]) -> None:
    """Seeded sampled requests verify by speculative sampling beside greedy ones (a mixed batch, drafts and
    plain rows in one step): the greedy ones keep plain decoding's output, the sampled ones run to length."""
    batch = spec_batch()
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    params = [GREEDY_24, sampled, GREEDY_24, sampled, GREEDY_24, sampled]
    got, drafts, _ = speculating(tiny_served_model_dir, batch, params, NGRAM, tensor_parallel_size=2)
    assert got[::2] == plain_greedy[::2]
    assert [len(g) for g in got[1::2]] == [24, 24, 24] and drafts > 0


def test_a_draft_model_speculates_for_ranks(tiny_served_model_dir: Path, plain_greedy: list[list[int]]) -> None:
    """The draft model runs in the node process on its own KV (the target's own copy starts from the prompt
    K/V the ranks wrote into the shared cache): greedy output is plain decoding's, nearly every draft kept."""
    spec = SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model=str(tiny_served_model_dir),
                             num_speculative_tokens=4, max_batch_size=16)
    batch = spec_batch()
    got, drafts, accepted = speculating(tiny_served_model_dir, batch, [GREEDY_24] * len(batch), spec,
                                        tensor_parallel_size=2)
    assert got == plain_greedy
    assert drafts > 0 and accepted >= 0.9 * drafts


def early_layers(num_layers: int) -> SpeculativeConfig:
    """The target's first layers draft, k fixed (adaptive k would follow measured costs: counters vary)."""
    return SpeculativeConfig(method=SpeculativeMethod.DRAFT_LAYERS, draft_layers=num_layers,
                             num_speculative_tokens=3, max_batch_size=16, adaptive=False)


def one_process(model_dir: Path, batch: list[list[int]], params: SamplingParams,
                spec: SpeculativeConfig) -> tuple[list[list[int]], int, int]:
    with LLM(model_dir, dtype="float32", speculative=spec) as llm:
        got = [c.token_ids for c in llm.generate(batch, params)]
        return got, llm.engine.scheduler.num_draft_tokens, llm.engine.scheduler.num_accepted_tokens


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}],
                         ids=["T2", "P2", "T2xP2"])
def test_early_layer_speculation_across_ranks_equals_plain_greedy(tiny_served_model_dir: Path,
                                                                  plain_greedy: list[list[int]],
                                                                  layout: dict[str, object]) -> None:
    """Each draft token is a pass of the ranks through the first layer (with P = 2: stage 0 ends it and hands
    the normed hidden states to stage 1's LM head, whose own layer skips): greedy output is plain decoding's,
    and the drafts are one process's early-layer drafts (the same drafted and accepted counts)."""
    batch, spec = spec_batch(), early_layers(1)
    got, drafts, accepted = speculating(tiny_served_model_dir, batch, [GREEDY_24] * len(batch), spec, **layout)
    assert got == plain_greedy
    assert (got, drafts, accepted) == one_process(tiny_served_model_dir, batch, GREEDY_24, spec)
    assert drafts >= accepted > 0


def test_sampled_and_greedy_requests_draft_with_early_layers_across_ranks(tiny_served_model_dir: Path,
                                                                         plain_greedy: list[list[int]]) -> None:
    """Seeded sampled requests sample their drafts from the early layers' distributions (the probabilities
    speculative sampling verifies against) beside greedy ones: greedy keeps plain decoding's output."""
    batch = spec_batch()
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    params = [GREEDY_24, sampled, GREEDY_24, sampled, GREEDY_24, sampled]
    got, drafts, _ = speculating(tiny_served_model_dir, batch, params, early_layers(1), pipeline_parallel_size=2)
    assert got[::2] == plain_greedy[::2]
    assert [len(g) for g in got[1::2]] == [24, 24, 24] and drafts > 0


@pytest.mark.parametrize(("layout", "num_layers"), [({"pipeline_parallel_size": 2}, 3),
                                                    ({"pipeline_parallel_size": 3}, 2),
                                                    ({"tensor_parallel_size": 3}, 3)],
                         ids=["P2-L3", "P3-L2", "T3-L3"])
def test_early_layer_passes_that_span_or_skip_stages(three_kv_heads_dir: Path, single_rank: list[list[int]],
                                                     layout: dict[str, object], num_layers: int) -> None:
    """4 layers: a draft pass through 3 spans both stages of P = 2 (layers 0-1, 2-3: stage 1 runs one of its
    two); through 2 at P = 3 (layers 0-1, 2, 3) it ends in stage 0, stage 1 skips and stage 2 only runs the LM
    head. Greedy output is plain decoding's, the drafts one process's (some rejected, most accepted)."""
    batch, spec = prompts(5), early_layers(num_layers)
    got, drafts, accepted = speculating(three_kv_heads_dir, batch, [GREEDY] * len(batch), spec, **layout)
    assert got == single_rank
    assert (got, drafts, accepted) == one_process(three_kv_heads_dir, batch, GREEDY, spec)
    assert drafts > accepted > 0


def test_micro_batches_and_core_placement() -> None:
    assert micro_batches([5, 5, 5, 5], 2) == [(0, 2), (2, 4)]
    assert micro_batches([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert micro_batches([3], 4) == [(0, 1)]
    assert micro_batches([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    for lens in ([7, 1, 9, 2, 2], [1] * 9, [50, 50]):
        for k in (1, 2, 3, 4):
            groups = micro_batches(lens, k)
            assert groups[0][0] == 0 and groups[-1][1] == len(lens) and len(groups) <= k
            assert all(a < b for a, b in groups) and all(groups[i][1] == groups[i + 1][0]
                                                         for i in range(len(groups) - 1))
    assert rank_cpus([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], False)
    assert rank_cpus([0, 1], 3) == ([[0], [1], [0]], True)  # more ranks than cores: round-robin, shared


@pytest.fixture(scope="module")
def reference_tokens(three_kv_heads_dir: Path) -> list[list[int]]:
    return outputs(three_kv_heads_dir, prompts(4, seed=7))


@pytest.mark.e2e
@pytest.mark.parametrize(("prefill_layout", "decode_layout"), [((), ("--tensor-parallel-size", "3")),
                                                             (("--tensor-parallel-size", "3"), ())],
                         ids=["T1-to-T3", "T3-to-T1"])
def test_kv_moves_between_nodes_of_different_layouts(three_kv_heads_dir: Path, tmp_path: Path,
                                                     reference_tokens: list[list[int]],
                                                     prefill_layout: tuple[str, ...],
                                                     decode_layout: tuple[str, ...]) -> None:
    """Each decode rank finds exactly its KV heads in the blocks the transfer filled, whatever the layouts."""
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True, http_port=None,
                        model_args=("--model", str(three_kv_heads_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "128", "--kv-timeout-s", "20", "--grace-s", "1"),
                        prefill_args=prefill_layout, decode_args=decode_layout,
                        gateway_args=("--stats-interval-s", "0.3", "--shutdown-grace-s", "1",
                                      "--local-prefill-max-tokens", "0"))
    with Launcher(topology, log_dir=tmp_path) as launcher:
        got = [generate(launcher.gateway.target, request(p, 8))[0] for p in prompts(4, seed=7)]
        wait_all_blocks_free(launcher)  # every node's blocks back once the requests ended
    assert got == reference_tokens


@pytest.fixture
def _no_leftover_segments() -> Iterator[None]:
    from common.kv.shared_segment import PREFIX, SHM_DIR

    # This process's segments only (their names carry the creator's pid): other tests' run beside it.
    mine = f"{PREFIX}{os.getpid()}-*"
    before = {p.name for p in SHM_DIR.glob(mine)}
    yield
    after = {p.name for p in SHM_DIR.glob(mine)}
    assert after <= before, f"segments left behind: {sorted(after - before)}"


@pytest.mark.usefixtures("_no_leftover_segments")
def test_close_unlinks_every_segment(three_kv_heads_dir: Path) -> None:
    with LLM(three_kv_heads_dir, dtype="float32", tensor_parallel_size=3) as llm:
        llm.generate([prompts(1)[0]], GREEDY)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.e2e
def test_a_killed_rank_fails_its_requests_and_the_node_comes_back(three_kv_heads_dir: Path, tmp_path: Path,
                                                                  reference_tokens: list[list[int]]) -> None:
    """Under the launcher: SIGKILL of one decode rank -> requests on that node end UNAVAILABLE, the node exits
    (its engine is dead), the supervisor starts it again and it serves the same greedy tokens."""
    import time

    import grpc

    from tandem_cli.launcher import RestartPolicy

    topology = Topology(num_prefill=1, num_decode=1, free_ports=True, http_port=None,
                        model_args=("--model", str(three_kv_heads_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "128", "--kv-timeout-s", "20", "--grace-s", "1"),
                        decode_args=("--tensor-parallel-size", "3"),
                        gateway_args=("--stats-interval-s", "0.3", "--shutdown-grace-s", "1",
                                      "--local-prefill-max-tokens", "0"))
    with Launcher(topology, log_dir=tmp_path, restart=RestartPolicy(initial_backoff_s=0.5)) as launcher:
        gateway = launcher.gateway.target
        ps = prompts(4, seed=7)
        assert generate(gateway, request(ps[0], 8))[0] == reference_tokens[0]
        node = launcher.procs["decode-0"]
        ranks = _children(node.pid)
        assert len(ranks) == 3
        os.kill(ranks[2], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as failed:
            generate(gateway, request(ps[1], 64))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        node.wait(30)  # the node stops once its engine died...
        deadline = time.monotonic() + 90
        while True:  # ... and its supervisor starts it again
            try:
                assert generate(gateway, request(ps[1], 8))[0] == reference_tokens[1]
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, f"decode-0 did not serve again; see {launcher.log_path('decode-0')}"
                time.sleep(0.5)
        assert launcher.restarts["decode-0"] == 1
        wait_all_blocks_free(launcher)


@pytest.mark.slow
def test_tandem_generate_at_t2_equals_t1_and_transformers(tiny_served_model_dir: Path) -> None:
    """The issue's check: `tandem generate --model <tiny> --tensor-parallel-size 2 --dtype float32
    --temperature 0` prints T=1's text, and the tokens are transformers' greedy ones."""
    import subprocess
    import sys

    import transformers

    def cli(*extra: str) -> str:
        argv = [sys.executable, "-m", "tandem_cli", "generate", "--model", str(tiny_served_model_dir), "--dtype",
                "float32", "--temperature", "0", "--max-tokens", "10", "--ignore-eos", "--prompt",
                "The capital of France is", *extra]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    single = cli()
    assert cli("--tensor-parallel-size", "2") == single
    with LLM(tiny_served_model_dir, dtype="float32", tensor_parallel_size=2) as llm:
        ids = llm.encode("The capital of France is")
        ours = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_served_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()


def test_tandem_up_passes_each_roles_layout() -> None:
    import argparse

    from tandem_cli.up_command import decode_args, parallel_args

    args = argparse.Namespace(tensor_parallel_size=None, pipeline_parallel_size=2, prefill_tensor_parallel_size=None,
                              prefill_pipeline_parallel_size=None, decode_tensor_parallel_size=3,
                              decode_pipeline_parallel_size=1, speculative=None)  # no speculative flag given
    assert parallel_args(args, "prefill") == ("--pipeline-parallel-size", "2")
    assert parallel_args(args, "decode") == ("--tensor-parallel-size", "3", "--pipeline-parallel-size", "1")
    assert decode_args(args) == ("--tensor-parallel-size", "3", "--pipeline-parallel-size", "1")
    args.speculative = "ngram"  # the speculative flags given to `tandem up` go to the decode nodes
    assert decode_args(args)[-2:] == ("--speculative", "ngram")
