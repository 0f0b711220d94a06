"""A node whose model spans T x P rank processes: the ``ModelRunner`` the node's engine drives.

The node keeps its scheduler, KV cache manager, sampler and KV connector in one place, as with one rank;
only the forward runs in the ranks (``python -m common.parallel.worker``, one process per rank, each
pinned to its own cores with one torch thread per core). Per step the node:

1. applies the step's block copies to the KV cache itself (the cache is shared memory, see below);
2. sends every rank the same ``WorkerStep`` (the chunks' tokens, positions and block tables) on its stdin;
3. waits for every rank's ``WorkerReply``: then every rank's KV writes for the step have landed, and the
   last pipeline stage's ranks have written their vocabulary columns of the sampled rows' logits into the
   shared logits buffer;
4. samples from that buffer with its own sampler (seeded randomness, penalties: one place, as with T = 1).

Shared memory, one host: the node's whole KV cache (``[num_blocks, layers, 2, block_size, kv_heads,
head_dim]``) is one shared segment that every rank maps; a rank reads and writes only its KV heads (and,
under pipeline parallelism, its layers). The KV connectors (prefill's producer, decode's consumer and the
same-host shared-memory transport) therefore see one complete cache whatever T and P are, so KV moves
between nodes of any two layouts (prefill T = 1 -> decode T = 3, T = 3 -> T = 1) unchanged: each decode rank
finds exactly its heads in the blocks the transfer filled. The same holds for the logits.

Speculative decoding: the node proposes (the proposer needs the requests' tokens, or a draft model of its
own, never the target's weights), the drafts ride along in the step's ``WorkerStep`` as more query tokens
(their KV lands in the draft slots the scheduler reserved), the ranks return the logits of every row a
verification reads (``sample_rows``), and the node verifies and samples exactly as one process does
(the ``ModelRunner`` it extends: one code path). ``--speculative ngram`` and ``draft_model`` (the draft runs in the
node process, on its own KV) need nothing more from the ranks. ``draft_layers`` drafts with the target's own
first L layers, which live in the ranks: each draft token is one more round trip, a ``WorkerStep`` with
``num_layers = L`` (one token per speculating sequence; the stage holding layer L - 1 final-norms and hands
the hidden states to the last stage, whose LM head writes the logits into the shared buffer), so k drafts
cost k draft passes before the step's forward. The passes write layers < L's KV into the reserved draft
slots, which the verifying forward overwrites, exactly as ``EarlyLayers`` does in one process.

A rank that dies (or fails) fails the node: the step raises ``RankFailed``, the engine thread ends every
request with an engine error (UNAVAILABLE at the node's API) and the node exits for its supervisor
(``tandem up``, compose) to restart it.
"""

from __future__ import annotations

import logging
import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.config.engine_config import SpeculativeConfig
from common.engine.flat_batch import FlatBatch
from common.engine.model_runner import ModelRunner, kv_cache_spec, sample_rows
from common.engine.scheduler_output import StepResult
from common.kv.kv_cache import KVCache
from common.kv.shared_segment import SharedSegment
from common.parallel.channel import ChannelClosed, read_frame, write_frame
from common.sampling.params import MAX_SPECULATIVE_TOKENS
from common.serving.port_reservation import reserve_port
from common.spec_decode.proposer import EarlyLayers
from tandem.v1 import worker_pb2

if TYPE_CHECKING:
    from common.engine.scheduler_output import SchedulerOutput
    from common.model.llama import LlamaForCausalLM
    from common.parallel.shm_comm import ShmCommSegment

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600.0  # every rank loads the model (and may build the CPU kernels) before it answers
STEP_TIMEOUT_S = 600.0


class RankFailed(RuntimeError):
    """A rank process died, failed or stopped answering: the node cannot run its model anymore."""


@dataclass(frozen=True)
class ParallelLaunch:
    """What the node's ranks load and how they talk (from ModelSettings)."""

    model_dir: Path
    dtype: str  # resolved: float32 | bfloat16 | float16
    tensor_parallel_size: int
    pipeline_parallel_size: int
    attention_backend: str = "torch"
    quantization: str = "none"
    quantization_group_size: int = 32
    quantization_kernel: str = "auto"
    collective: str = "shm"  # shm | gloo: the tensor-parallel all-reduce
    num_micro_batches: int = 0  # pipeline micro-batches per step; 0: one per stage
    cpus: tuple[int, ...] = ()  # the node's cores; (): the process's affinity
    expert_parallel: bool = False  # a mixture of experts: whole experts per TP rank (common/parallel/layout.py)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def rank_cpus(cpus: list[int], world_size: int) -> tuple[list[list[int]], bool]:
    """Cores per rank: an even share each when there are enough, else one each, round-robin (True: shared)."""
    if not cpus:
        raise ValueError("no CPU to place the ranks on")
    if len(cpus) >= world_size:
        per = len(cpus) // world_size
        return [cpus[r * per:(r + 1) * per] for r in range(world_size)], False
    return [[cpus[r % len(cpus)]] for r in range(world_size)], True


class ParallelModelRunner(ModelRunner):
    """``ModelRunner`` whose forward runs in T x P rank processes; ``model`` is a weightless skeleton
    (the meta device: config and dtype only)."""

    def __init__(self, launch: ParallelLaunch, skeleton: LlamaForCausalLM, block_size: int, num_blocks: int,
                 max_rows: int, speculative: SpeculativeConfig | None = None,
                 draft_model: LlamaForCausalLM | None = None) -> None:
        """``max_rows``: the most sequences a step samples (max_num_seqs); a speculating step's draft rows are
        added to it here."""
        super().__init__(skeleton, block_size, num_blocks, speculative, draft_model,
                         kv_cache=KVCache(kv_cache_spec(skeleton, block_size), num_blocks, "cpu", shared=True))
        if isinstance(self.proposer, EarlyLayers):  # the same drafting, its passes run by the ranks
            self.proposer = RankEarlyLayers(self, self.proposer.num_layers)
        self.launch = launch
        self.collective_seconds = 0.0  # the slowest rank's time in collectives, summed over steps
        self.rank_seconds = 0.0  # the slowest rank's whole step, summed over steps
        if self.speculative.enabled:
            # verification reads k + 1 rows per speculating request: at most max_batch_size of them (the
            # scheduler's rule), each with at most MAX_SPECULATIVE_TOKENS drafts
            max_rows += min(max_rows, self.speculative.max_batch_size) * MAX_SPECULATIVE_TOKENS
        self.max_rows = max_rows
        self.vocab_size = skeleton.config.vocab_size
        self._procs: list[subprocess.Popen[bytes]] = []
        self._step_id = 0
        self._closed = False
        self._logits_segment = SharedSegment.create(max_rows * self.vocab_size * 4, num_slots=1)
        self._logits = self._logits_segment.data().view(torch.float32).view(max_rows, self.vocab_size)
        self._comm_segments: list[ShmCommSegment] = []
        try:
            self.weight_bytes = self._start(num_blocks)
        except BaseException:
            self.close()
            raise

    # ---- start and stop --------------------------------------------------------------------------

    def _start(self, num_blocks: int) -> int:
        launch = self.launch
        t, p = launch.tensor_parallel_size, launch.pipeline_parallel_size
        cpus = list(launch.cpus) or sorted(os.sched_getaffinity(0))
        placement, shared = rank_cpus(cpus, launch.world_size)
        if shared:
            log.warning("%d ranks on %d cores: ranks share cores round-robin, one thread each (slower than "
                        "one core per rank)", launch.world_size, len(cpus))
        comm_names = self._create_comm_segments(t, p)
        init_method = f"tcp://127.0.0.1:{reserve_port()}"
        assert self.kv_cache.segment is not None
        kv, logits = self.kv_cache.segment, self._logits_segment
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for rank in range(launch.world_size):
            init = worker_pb2.WorkerInit(
                rank=rank, tensor_parallel_size=t, pipeline_parallel_size=p, model_dir=str(launch.model_dir),
                dtype=launch.dtype, attention_backend=launch.attention_backend, quantization=launch.quantization,
                quantization_group_size=launch.quantization_group_size,
                quantization_kernel=launch.quantization_kernel, dist_init_method=init_method,
                collective=launch.collective, shm_comm_name=comm_names[rank // t] if comm_names else "",
                kv_segment=kv.name, kv_nonce=kv.nonce, num_blocks=num_blocks, block_size=self.block_size,
                logits_segment=logits.name, logits_nonce=logits.nonce, max_rows=self.max_rows,
                cpus=placement[rank], num_micro_batches=launch.num_micro_batches or p, device="cpu",
                expert_parallel=launch.expert_parallel)
            proc = subprocess.Popen([sys.executable, "-m", "common.parallel.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
            self._procs.append(proc)
            assert proc.stdin is not None
            write_frame(proc.stdin, init)
        replies = self._wait_replies(0, STARTUP_TIMEOUT_S, "starting")
        total = sum(r.weight_bytes for r in replies)
        log.info("%d ranks (tensor parallel %d x pipeline %d, %s all-reduce) up: %.0f MB of weights in all",
                 launch.world_size, t, p, launch.collective, total / 1e6)
        return total

    def _create_comm_segments(self, t: int, p: int) -> list[str]:
        """One shared-memory all-reduce segment per tensor-parallel group (one per pipeline stage)."""
        if t == 1 or self.launch.collective != "shm":
            return []
        from common.parallel.shm_comm import ShmComm

        names = []
        hidden = self.model.config.hidden_size
        max_bytes = 4 * hidden * 2048  # chunks of up to 2048 fp32 rows; larger tensors go in several rounds
        for _ in range(p):
            segment = ShmComm.create(t, max_bytes)
            self._comm_segments.append(segment)
            names.append(segment.name)
        return names

    def close(self) -> None:
        """Stop the ranks (shutdown, then terminate what is left) and unlink the shared segments."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    write_frame(proc.stdin, worker_pb2.WorkerCommand(shutdown=worker_pb2.WorkerShutdown()))
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for segment in self._comm_segments:
            segment.close()
        self._logits_segment.close()
        self.kv_cache.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult | None:
        """Propose here, run the forward (drafts riding along) in the ranks, verify and sample here."""
        self._begin_step(output)
        step_start = start = time.perf_counter()
        drafts, draft_probs = self._propose(output.chunks)
        self.draft_seconds += time.perf_counter() - start
        start = time.perf_counter()
        batch = FlatBatch.of(output.chunks, drafts, self.block_size)
        ends = batch.ends
        rows = sample_rows(output.chunks, drafts, ends)
        self._run_on_ranks(worker_pb2.WorkerStep(input_ids=batch.input_ids, positions=batch.positions,
                                                 query_lens=batch.query_lens, context_lens=batch.context_lens,
                                                 table_lens=[len(t) for t in batch.tables],
                                                 block_ids=[b for t in batch.tables for b in t], sample_rows=rows),
                           "running a step")
        self.num_steps += 1
        # the ranks wrote row j of the buffer for flat row rows[j]; indexing copies (the next step overwrites)
        index = {r: j for j, r in enumerate(rows)}
        result = self._sample(output.chunks, drafts, draft_probs, ends,
                              lambda wanted: self._logits[[index[r] for r in wanted]])
        end = time.perf_counter()
        self.forward_seconds += end - start
        return self._priced(output.chunks, drafts, result, end - step_start)

    def draft_pass(self, token_ids: list[int], positions: list[int], tables: list[list[int]],
                   num_layers: int) -> torch.Tensor:
        """One token per sequence through the ranks' first ``num_layers`` layers, the final norm and the LM head
        (``EarlyLayers.draft_logits`` across ranks): logits ``[len(token_ids), vocab]`` fp32, a copy."""
        n = len(token_ids)
        self._run_on_ranks(worker_pb2.WorkerStep(input_ids=token_ids, positions=positions, query_lens=[1] * n,
                                                 context_lens=positions, table_lens=[len(t) for t in tables],
                                                 block_ids=[b for t in tables for b in t], sample_rows=range(n),
                                                 num_layers=num_layers),
                           "running a draft pass")
        return self._logits[:n].clone()  # the next pass or step overwrites the buffer

    def _run_on_ranks(self, step: worker_pb2.WorkerStep, doing: str) -> None:
        """Send every rank ``step`` (numbered here) and wait until all answered: its KV writes and its
        ``sample_rows``' logits (rows 0.. of the buffer, in order) have landed."""
        if len(step.sample_rows) > self.max_rows:
            raise RankFailed(f"{len(step.sample_rows)} sampled rows exceed the logits buffer ({self.max_rows})")
        self._step_id += 1
        step.step_id = self._step_id
        command = worker_pb2.WorkerCommand(step=step)
        for rank, proc in enumerate(self._procs):
            assert proc.stdin is not None
            try:
                write_frame(proc.stdin, command)
            except (BrokenPipeError, OSError) as exc:
                raise RankFailed(self._describe_exit(rank, f"cannot be reached ({exc})")) from None
        replies = self._wait_replies(self._step_id, STEP_TIMEOUT_S, doing)
        self.collective_seconds += max(r.collective_seconds for r in replies)
        self.rank_seconds += max(r.forward_seconds for r in replies)

    def _wait_replies(self, step_id: int, timeout_s: float, doing: str) -> list[worker_pb2.WorkerReply]:
        """Every rank's reply to ``step_id``; RankFailed when one exits, reports an error or times out."""
        replies: dict[int, worker_pb2.WorkerReply] = {}
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            for rank, proc in enumerate(self._procs):
                assert proc.stdout is not None
                sel.register(proc.stdout, selectors.EVENT_READ, rank)
            while len(replies) < len(self._procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [r for r in range(len(self._procs)) if r not in replies]
                    raise RankFailed(f"ranks {late} did not answer within {timeout_s:g} s while {doing}")
                for key, _ in sel.select(min(left, 1.0)):
                    rank = int(key.data)
                    try:
                        reply = read_frame(key.fileobj, worker_pb2.WorkerReply)  # type: ignore[arg-type]
                    except (ChannelClosed, ValueError):
                        raise RankFailed(self._describe_exit(rank, f"exited while {doing}")) from None
                    if reply.error:
                        raise RankFailed(self._root_cause(rank, f"failed while {doing}: {reply.error}"))
                    if reply.step_id != step_id:
                        raise RankFailed(f"rank {rank} answered step {reply.step_id}, expected {step_id}")
                    replies[rank] = reply
                    sel.unregister(key.fileobj)
                for rank, proc in enumerate(self._procs):
                    if rank not in replies and proc.poll() is not None:
                        raise RankFailed(self._describe_exit(rank, f"exited while {doing}"))
        return [replies[r] for r in range(len(self._procs))]

    def _root_cause(self, rank: int, what: str) -> str:
        """A rank's error, unless another rank died: then that one (the others only saw it vanish)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            dead = [r for r, p in enumerate(self._procs) if r != rank and p.poll() not in (None, 0, 1)]
            if dead:
                return self._describe_exit(dead[0], f"exited (rank {rank}: {what})")
            time.sleep(0.05)
        return f"rank {rank} {what}"

    def _describe_exit(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        try:
            code = proc.wait(2.0) if proc.stdout is not None else proc.poll()  # its stdout closed: it is exiting
        except subprocess.TimeoutExpired:
            code = None
        how = "" if code is None else (f" (killed by signal {-code})" if code < 0 else f" (exit code {code})")
        return f"rank {rank} (pid {proc.pid}) {what}{how}"


class RankEarlyLayers(EarlyLayers):
    """``EarlyLayers`` whose draft passes run in the node's ranks (the target's layers live there)."""

    def __init__(self, runner: ParallelModelRunner, num_layers: int) -> None:
        super().__init__(runner.model, runner.kv_cache, runner.block_size, num_layers)
        self.runner = runner

    def draft_logits(self, token_ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        return self.runner.draft_pass(token_ids, positions, tables, self.num_layers)
