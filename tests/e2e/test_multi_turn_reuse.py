"""A conversation's next turn over the disaggregated system reuses the decode node's KV of the turns before it
(issue 38): the gateway records, for each finished request, the blocks of its prompt and answer against the decode
node that served it; the next turn, whose prompt starts with them, is routed there and prefilled locally over its
prefix cache — only the new message is computed — instead of prefilling the whole history again on a prefill
node. Greedy tokens stay the colocated engine's."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tandem_cli.launcher import Launcher, Topology
from tests.e2e.test_disaggregated import generate, prompts, reference, request, wait_all_blocks_free

pytestmark = pytest.mark.e2e


def test_next_turn_prefills_on_the_decode_node_that_holds_the_history(tiny_served_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    topology = Topology(num_prefill=1, num_decode=2, free_ports=True,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "256", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "24", "--stats-interval-s", "0.3",
                                      "--shutdown-grace-s", "1"))
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    system, first_message, second_message = (prompts(1, seed=s)[0] for s in (7, 8, 9))
    turn1 = [*system, *first_message, *range(300, 340)][:80]  # 80 tokens: past max_tokens, to a prefill node
    with Launcher(topology, log_dir=tmp_path, env=env) as launcher:
        target = launcher.gateway.target
        answer1, last1 = generate(target, request(turn1, 40))
        turn2 = [*turn1, *answer1, *second_message[:10]]
        answer2, last2 = generate(target, request(turn2, 12))
        wait_all_blocks_free(launcher)
    assert answer1 == reference(tiny_served_model_dir, [turn1], 40)[0]
    assert answer2 == reference(tiny_served_model_dir, [turn2], 12)[0]
    # turn 1: prefilled on the prefill node; turn 2: on the decode node that decoded turn 1, from its cache
    assert last1.timings.prefill_node.startswith("prefill") and last1.timings.decode_node.startswith("decode")
    assert last2.timings.prefill_node == last2.timings.decode_node == last1.timings.decode_node
    history = len(turn1) + len(answer1) - 1  # every token's K/V but the last answer token's
    assert last2.usage.cached_tokens == history // 16 * 16  # its full blocks


def test_next_turn_on_a_prefill_node_restores_the_answer_from_the_shared_tier(tiny_served_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """Fully disaggregated (every prompt to a prefill node) with ``--kv-offload shared``: the decode node writes
    turn 1's prompt and answer to the shared directory when it lets go of them, and the prefill node that gets
    turn 2 restores all of it from there (the answer it never computed included) and prefills only the new
    message; the decode node already holds the history, so only the new blocks cross. The history's last, partly
    filled block goes there too, so the prefill starts exactly at the history's end. Greedy tokens unchanged."""
    shared = tmp_path / "shared"
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "256", "--kv-timeout-s", "20", "--grace-s", "1",
                                   "--kv-offload", "shared", "--kv-offload-dir", str(shared),
                                   "--kv-offload-gb", "0.05"),
                        gateway_args=("--local-prefill-max-tokens", "0", "--stats-interval-s", "0.3",
                                      "--shutdown-grace-s", "1"))
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    system, first_message, second_message = (prompts(1, seed=s)[0] for s in (7, 8, 9))
    turn1 = [*system, *first_message, *range(300, 340)][:80]
    with Launcher(topology, log_dir=tmp_path / "logs", env=env) as launcher:
        target = launcher.gateway.target
        answer1, _ = generate(target, request(turn1, 40))
        wait_all_blocks_free(launcher)  # the decode node let go of turn 1: its blocks are written behind
        history = len(turn1) + len(answer1) - 1  # every token's K/V but the last answer token's
        names = {p.name for p in shared.rglob("*.kv")}
        for _ in range(100):  # bounded: the writes land within milliseconds
            if len(names) >= history // 16 + 1:
                break
            time.sleep(0.05)
            names = {p.name for p in shared.rglob("*.kv")}
        assert len(names) >= history // 16 + 1  # turn 1's full blocks, the answer's among them, and its tail
        turn2 = [*turn1, *answer1, *second_message[:10]]
        answer2, last2 = generate(target, request(turn2, 12))
        wait_all_blocks_free(launcher)
    assert answer1 == reference(tiny_served_model_dir, [turn1], 40)[0]
    assert answer2 == reference(tiny_served_model_dir, [turn2], 12)[0]
    assert last2.timings.prefill_node.startswith("prefill") and last2.timings.decode_node.startswith("decode")
    assert history % 16 and last2.usage.cached_tokens == history  # all of it: pool (turn 1's prompt) + tier
    assert not list(shared.rglob("*.kv"))  # every node removed the files it wrote when it stopped
