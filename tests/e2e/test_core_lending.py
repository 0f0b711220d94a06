"""Core lending as ``tandem up`` lays it out: prefill node i runs its layers on decode node i's cores too while that
node is idle (common/engine/core_lending.py). The launcher's layout, then a real deployment on two cores."""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest

from tandem_cli.launcher import Launcher, Topology
from tests.e2e.test_disaggregated import generate, prompts, reference, request

CPUS = tuple(sorted(os.sched_getaffinity(0)))


def _flag(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_prefill_i_borrows_decode_i_cores_when_each_has_its_own() -> None:
    specs = {s.name: s for s in Topology(num_prefill=2, num_decode=1, cpus=(0, 1, 2), free_ports=True,
                                         cpu_lending=True).nodes()}
    prefill, other, decode = specs["prefill-0"], specs["prefill-1"], specs["decode-0"]
    path = _flag(decode.args, "--activity-file")
    assert path is not None and decode.files == (path,) and Path(path).name.endswith("decode-0.activity")
    assert prefill.cpus == (0,) and prefill.borrow_cpus == (2,) == decode.cpus
    assert _flag(prefill.args, "--borrow-cpus") == "2" and _flag(prefill.args, "--borrow-from") == path
    assert other.borrow_cpus == () and "--borrow-cpus" not in other.args  # one borrower per decode node
    # Cores shared round-robin (fewer than processes), or lending off: nothing lent.
    for topology in (Topology(cpus=(0,), free_ports=True, cpu_lending=True),
                     Topology(cpus=(0, 1), free_ports=True, cpu_lending=False)):
        assert all(not s.borrow_cpus and not s.files and "--activity-file" not in s.args
                   for s in topology.nodes())


def _up_lending(args: list[str]) -> bool:
    from tandem_cli.cli import build_parser
    from tandem_cli.up_command import cpu_lending

    return cpu_lending(build_parser().parse_args(["up", *args]))


def test_tandem_up_lends_where_the_nodes_can_honour_it() -> None:
    assert _up_lending([])
    assert not _up_lending(["--no-cpu-lending"])
    assert not _up_lending(["--device", "cuda"])
    assert not _up_lending(["--tensor-parallel-size", "2"])
    assert not _up_lending(["--prefill-pipeline-parallel-size", "2"])
    assert _up_lending(["--decode-tensor-parallel-size", "2"])  # the decode node's layout does not matter


@pytest.mark.e2e
@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_a_prefill_node_borrows_the_idle_decode_nodes_core(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True, cpus=CPUS[:2], cpu_lending=True,
                        metrics_base_port=0,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "256", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0", "--shutdown-grace-s", "1"))
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    batch = prompts(4, seed=3)
    expected = reference(tiny_served_model_dir, batch, 6)
    launcher = Launcher(topology, log_dir=tmp_path, env=env)
    with launcher:
        prefill = next(s for s in launcher.specs if s.role == "prefill")
        pid = launcher.procs[prefill.name].pid
        assert os.sched_getaffinity(pid) == {CPUS[0]}  # its own core; the borrowed one only while lent
        assert b"GOMP_SPINCOUNT=10000" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for ids, want in zip(batch, expected, strict=True):
            tokens, _ = generate(launcher.gateway.target, request(ids, 6))
            assert tokens == want  # the same tokens as one process on one thread
        with urllib.request.urlopen(f"http://127.0.0.1:{prefill.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        borrowed = re.search(r'tandem:prefill_layers_total\{cpus="borrowed",node="prefill-0"\} (\S+)', text)
        assert borrowed is not None and float(borrowed.group(1)) >= 2, text[-2000:]
        # The engine thread's OpenMP team is bound one thread per core: a worker on the borrowed core alone
        allowed = [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
        assert {CPUS[1]} in allowed and {CPUS[0], CPUS[1]} not in allowed, allowed
        activity = next(s for s in launcher.specs if s.role == "decode").files[0]
        assert Path(activity).exists()
    assert not Path(activity).exists()  # gone with the deployment
