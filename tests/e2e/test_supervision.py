"""Supervision under the launcher (``tandem up``): a node or the gateway killed with SIGKILL is started
again with backoff, serves within 60 s, and the gateway routes to it again; the rest never stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from test_disaggregated import generate, prompts, request, wait_all_blocks_free

from common.serving.port_reservation import reserve_port
from tandem_cli.child_setup import PARENT_PID_ENV, PIN_CPUS_ENV
from tandem_cli.launcher import ColocatedTopology, Launcher, RestartPolicy, Topology, is_serving

pytestmark = pytest.mark.e2e
BACK_WITHIN_S = 60.0


def test_restart_policy_backs_off_exponentially_and_resets_after_a_long_run() -> None:
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=8.0, reset_after_s=30.0)
    waits: list[float] = []
    previous = None
    for _ in range(6):  # a crash loop: each run shorter than reset_after_s
        previous = policy.next_backoff(previous, ran_s=2.0)
        waits.append(previous)
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert policy.next_backoff(8.0, ran_s=31.0) == 1.0  # it ran a while: a fresh failure
    with pytest.raises(ValueError, match="initial_backoff_s"):
        RestartPolicy(initial_backoff_s=0)


_ADOPT = ("import os; from tandem_cli.child_setup import adopt_launcher_settings; adopt_launcher_settings(); "
          f"print(sorted(os.sched_getaffinity(0)), os.environ.get('{PARENT_PID_ENV}'))")


def test_a_child_pins_its_cores_and_refuses_to_outlive_its_launcher() -> None:
    """What ``tandem up`` used to do in a preexec_fn (unsafe beside the supervisor's thread) the child does
    itself: pin the cores it was given, arm the death signal, and not start if its launcher is gone; the
    settings leave its environment, so its own children are not bound to the launcher."""
    core = sorted(os.sched_getaffinity(0))[-1]
    env = {**os.environ, PIN_CPUS_ENV: str(core), PARENT_PID_ENV: str(os.getpid())}
    done = subprocess.run([sys.executable, "-c", _ADOPT], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"[{core}]", "None"]
    gone = {**env, PARENT_PID_ENV: "1"}  # not this child's parent: as if the launcher died before it armed
    done = subprocess.run([sys.executable, "-c", _ADOPT], env=gone, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "launcher (pid 1) has exited" in done.stderr


def _kill(launcher: Launcher, name: str) -> int:
    old = launcher.procs[name]
    os.kill(old.pid, signal.SIGKILL)
    old.wait(10)
    return old.pid


def _wait_back(launcher: Launcher, name: str, old_pid: int) -> float:
    """Seconds until ``name`` runs as a new process and answers its health check."""
    start = time.monotonic()
    spec = next(s for s in launcher.specs if s.name == name)
    while time.monotonic() - start < BACK_WITHIN_S:
        proc = launcher.procs[name]
        if proc.pid != old_pid and proc.poll() is None and is_serving(spec.target, 1.0):
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"{name} was not back within {BACK_WITHIN_S:.0f} s; see {launcher.log_path(name)}")


def test_killed_processes_come_back_and_serve(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "128", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    events: list[str] = []
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0)
    with Launcher(topology, log_dir=tmp_path, restart=policy, on_event=events.append) as launcher:
        gateway = launcher.gateway.target
        ps = prompts(4, seed=21)
        expected, _ = generate(gateway, request(ps[0], 6))
        for k, name in enumerate(("decode-0", "prefill-0", "gateway"), start=1):
            old_pid = _kill(launcher, name)
            _wait_back(launcher, name, old_pid)
            # With one node of each role, a request that completes went through the restarted one.
            deadline = time.monotonic() + BACK_WITHIN_S
            while True:
                try:
                    tokens, last = generate(gateway, request(ps[0], 6))
                    break
                except grpc.RpcError:  # the gateway's next Stats poll has not seen the node yet
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.3)
            assert tokens == expected, name  # the restarted process computes the same (greedy) tokens
            assert last.timings.prefill_node == "prefill-0" and last.timings.decode_node == "decode-0"
            assert launcher.restarts[name] == 1 and sum(launcher.restarts.values()) == k
        for p in ps[1:]:
            assert len(generate(gateway, request(p, 4))[0]) == 4
        wait_all_blocks_free(launcher)
        # The survivors were never restarted, and each restart was reported and marked in its log.
        log = "\n".join(events)
        for name in ("decode-0", "prefill-0", "gateway"):
            assert f"{name} exited with signal SIGKILL" in log and f"restarted {name} (restart 1" in log
            assert f"{name} is serving again" in log or launcher.procs[name].poll() is None
            assert "--- tandem up: restart 1 of" in (tmp_path / f"{name}.log").read_text(errors="replace")
    # Ctrl-C / SIGTERM still stop everything, restarted processes included, and quietly: Triton stays out
    # of CPU processes (tandem_cli/triton_import.py), so no nanobind leak reports at exit.
    assert all(proc.poll() is not None for proc in launcher.procs.values())
    for log_file in tmp_path.glob("*.log"):
        assert "nanobind" not in log_file.read_text(errors="replace"), log_file.name


def _listen(port: int) -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    return held


def test_a_node_whose_port_was_taken_moves_to_another_and_serves(tiny_served_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A port reserved for a node and taken by another process before the node binds it (a race the
    reservation makes rare, not impossible): the node exits with EXIT_ADDRESS_IN_USE, the launcher gives
    it new ports, rewrites the gateway's node list, and the deployment serves."""
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True, http_port=None, metrics_base_port=0,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "64", "--grace-s", "1"),
                        gateway_args=("--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    events: list[str] = []
    launcher = Launcher(topology, log_dir=tmp_path, on_event=events.append)
    taken = next(s for s in launcher.specs if s.name == "decode-0")
    with _listen(taken.port), launcher:
        moved = next(s for s in launcher.specs if s.name == "decode-0")
        assert moved.port != taken.port and moved.metrics_port != taken.metrics_port
        assert moved.target in launcher.gateway.args[launcher.gateway.args.index("--decode") + 1]
        assert any("decode-0: a port was taken" in e for e in events)
        tokens, _ = generate(launcher.gateway.target, request(prompts(1)[0], 4))
        assert len(tokens) == 4


def test_a_fixed_port_in_use_is_refused_naming_the_port(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    """Without free ports (``tandem up``, ``tandem serve``) a taken port is the user's to free: the launcher
    says which port, and the node's log says why."""
    port = reserve_port()
    topology = ColocatedTopology(replicas=1, base_port=port,
                                 model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"))
    refused = pytest.raises(RuntimeError, match=f"colocated-0 could not listen on its port {port}")
    with _listen(port), refused, Launcher(topology, log_dir=tmp_path):
        pass
    assert "cannot listen on 127.0.0.1:" in (tmp_path / "colocated-0.log").read_text()
