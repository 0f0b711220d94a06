"""One rank of a tensor/pipeline-parallel node: ``python -m common.parallel.worker`` (started by the node).

Reads ``WorkerInit`` then ``WorkerCommand`` frames on stdin, answers each with a ``WorkerReply`` on stdout
(common/parallel/channel.py); logs go to stderr, the node's log. At start it pins itself to its cores (one
torch thread per core), joins the node's gloo process group, loads the model and keeps only its shard
(common/parallel/tp_model.py), maps the node's shared KV cache and logits buffer, and answers ready.

A step: the first pipeline stage embeds the tokens, every stage runs its layers (the tensor-parallel group
all-reduces after each row-parallel layer) and hands the hidden states to the next stage; the last stage
writes its vocabulary columns of the sampled rows' logits into the shared buffer. A draft pass
(``WorkerStep.num_layers``, ``--speculative draft_layers``) runs only the first layers: the stage holding the
last of them final-norms and sends the hidden states straight to the last stage's LM head. With P > 1 the step's
sequences are split into micro-batches that flow through the stages one after another, so that stage s
works on micro-batch m while stage s + 1 works on m - 1 (GPipe's schedule within one step).

Any failure is answered with an error and the rank exits: the node fails (common/parallel/executor.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import IO, TYPE_CHECKING

from common.parallel.channel import ChannelClosed, read_frame, write_frame
from tandem.v1 import worker_pb2

if TYPE_CHECKING:
    import torch

    from common.attention.metadata import AttentionMetadata
    from common.parallel.comm import Communicator

log = logging.getLogger("tandem.worker")


def micro_batches(query_lens: list[int], count: int) -> list[tuple[int, int]]:
    """Split sequences (in order) into at most ``count`` contiguous groups of about equal token counts;
    (first sequence, end sequence) per group, none empty."""
    n = len(query_lens)
    count = max(1, min(count, n))
    total = sum(query_lens)
    groups: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, q in enumerate(query_lens):
        acc += q
        left_groups = count - len(groups) - 1
        if left_groups > 0 and acc >= total * (len(groups) + 1) / count and n - (i + 1) >= left_groups:
            groups.append((start, i + 1))
            start = i + 1
    groups.append((start, n))
    return [g for g in groups if g[0] < g[1]]


class TimedComm:
    """The tensor-parallel communicator, adding the time of each collective to ``owner.collective_seconds``."""

    def __init__(self, comm: Communicator, owner: Rank) -> None:
        self.comm = comm
        self.owner = owner

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.comm.all_reduce_(tensor)
        self.owner.collective_seconds += time.perf_counter() - start
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        start = time.perf_counter()
        out = self.comm.all_gather(tensor, dim)
        self.owner.collective_seconds += time.perf_counter() - start
        return out

    def close(self) -> None:
        self.comm.close()


class Rank:
    """This process's shard of the model and what it needs to run a step."""

    def __init__(self, init: worker_pb2.WorkerInit) -> None:
        import torch
        import torch.distributed as dist

        from common.config.model_config import ModelConfig
        from common.kv.kv_cache import KVCache, KVCacheSpec
        from common.kv.shared_segment import SharedSegment
        from common.model.loader import load_model
        from common.parallel.comm import GlooComm
        from common.parallel.layout import ParallelLayout, stage_layers
        from common.parallel.tp_model import KVCacheShard, prepare_shard, shard_model

        self.init = init
        if init.cpus:
            os.sched_setaffinity(0, list(init.cpus))
        torch.set_num_threads(max(1, len(init.cpus)))
        t, p = init.tensor_parallel_size, init.pipeline_parallel_size
        world = t * p
        dist.init_process_group("gloo", init_method=init.dist_init_method, rank=init.rank, world_size=world)
        config = ModelConfig.from_pretrained(init.model_dir)
        layout = ParallelLayout(t, p, init.expert_parallel)
        layout.validate(config)
        self.placement = layout.placement(init.rank, config)
        tp_groups = [dist.new_group(list(range(s * t, (s + 1) * t))) for s in range(p)]
        stage = self.placement.pp_rank
        if init.collective == "shm" and t > 1:
            from common.parallel.shm_comm import ShmComm

            self.tp_comm: Communicator = ShmComm.attach(init.shm_comm_name, self.placement.tp_rank, t)
        else:
            self.tp_comm = GlooComm(tp_groups[stage], list(range(stage * t, (stage + 1) * t)))
        # the float model as loaded: shard_model slices its rows and columns, then the after-load pass runs
        self.model = load_model(init.model_dir, init.dtype, "cpu", init.attention_backend, prepare=False)
        self.collective_seconds = 0.0
        shard_model(self.model, self.placement, TimedComm(self.tp_comm, self))
        from common.quant.config import QuantConfig

        quant = QuantConfig.parse(init.quantization or "none", init.quantization_group_size or 32)
        prepare_shard(self.model, quant, init.quantization_kernel)
        self.dtype = self.model.dtype
        spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, init.block_size,
                           str(self.dtype).removeprefix("torch."))
        self._kv_segment = SharedSegment.open(init.kv_segment, init.kv_nonce)
        self.kv = KVCacheShard.for_rank(KVCache.mapped(spec, init.num_blocks, self._kv_segment), self.placement)
        self._logits_segment = SharedSegment.open(init.logits_segment, init.logits_nonce)
        self.logits = self._logits_segment.data().view(torch.float32).view(init.max_rows, config.vocab_size)
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_layers
        self.stage_layers = stage_layers(config.num_layers, p)  # every stage's [l0, l1): where a draft pass ends
        self.first, self.last = stage == 0, stage == p - 1
        self.prev_rank = init.rank - t if not self.first else None
        self.next_rank = init.rank + t if not self.last else None
        self.weight_bytes = self.model.weight_bytes

    def step(self, step: worker_pb2.WorkerStep) -> None:
        import torch
        import torch.distributed as dist

        from common.attention.metadata import AttentionMetadata
        from common.parallel.tp_model import shard_logits, stage_forward

        query_lens, context_lens = list(step.query_lens), list(step.context_lens)
        tables: list[list[int]] = []
        offset = 0
        for n in step.table_lens:
            tables.append(list(step.block_ids[offset:offset + n]))
            offset += n
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        # A draft pass (num_layers > 0) runs the first num_layers layers only: the stage holding the last of
        # them final-norms and hands the hidden states to the last stage (the LM head); the stages between
        # them skip. A whole step ends on the last stage, as a draft pass through every layer does.
        num_layers = step.num_layers or self.num_layers
        if num_layers > self.num_layers:
            raise ValueError(f"a draft pass through {num_layers} layers: the model has {self.num_layers}")
        l0, l1 = self.placement.layers
        idle = l0 >= num_layers  # past the pass's layers: only the last stage has work (the LM head)
        if idle and not self.last:
            return
        ends_pass = l0 < num_layers <= l1
        end_stage = next(s for s, (a, b) in enumerate(self.stage_layers) if a < num_layers <= b)
        ids = torch.tensor(list(step.input_ids), dtype=torch.long)
        positions = torch.tensor(list(step.positions), dtype=torch.long)
        groups = micro_batches(query_lens, self.init.num_micro_batches) if len(query_lens) else []
        rows = list(step.sample_rows)
        sends: list[dist.Work] = []
        out_row = 0
        for first_seq, end_seq in groups:
            t0, t1 = starts[first_seq], starts[end_seq]
            if idle:  # the normed hidden states from the stage that ended the pass, no residual
                hidden = self._recv(t1 - t0, self.placement.pp_group[end_stage], with_residual=False)[0]
            else:
                meta: AttentionMetadata = AttentionMetadata.build(
                    query_lens[first_seq:end_seq], context_lens[first_seq:end_seq], tables[first_seq:end_seq],
                    self.init.block_size)
                if self.first:
                    x: torch.Tensor = ids[t0:t1]
                    residual: torch.Tensor | None = None
                else:
                    assert self.prev_rank is not None
                    x, residual = self._recv(t1 - t0, self.prev_rank)
                hidden, residual = stage_forward(self.model, x, positions[t0:t1], meta, self.kv, residual,
                                                 step.num_layers or None)
                if not ends_pass:
                    assert self.next_rank is not None
                    sends.extend(self._send(hidden, residual, self.next_rank))
                    continue
                if not self.last:
                    sends.extend(self._send(hidden, None, self.placement.pp_group[-1]))
                    continue
            mine = [r - t0 for r in rows if t0 <= r < t1]
            if mine:
                v0, v1 = self.placement.vocab
                part = shard_logits(self.model, hidden[mine])
                self.logits[out_row:out_row + len(mine), v0:v1] = part[:, : v1 - v0]
                out_row += len(mine)
        for work in sends:
            work.wait()

    def _send(self, hidden: torch.Tensor, residual: torch.Tensor | None, dst: int) -> list[torch.distributed.Work]:
        """hidden [n, hidden] (and the residual stream beside it, when given) to global rank ``dst``."""
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        payload = torch.stack([hidden] if residual is None else [hidden, residual])
        work = dist.isend(payload.contiguous(), dst)
        self.collective_seconds += time.perf_counter() - start
        return [work] if work is not None else []

    def _recv(self, num_tokens: int, src: int, with_residual: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``_send`` sent from global rank ``src``: (hidden, residual stream or None)."""
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        buf = torch.empty((2 if with_residual else 1, num_tokens, self.hidden_size), dtype=self.dtype)
        dist.recv(buf, src)
        self.collective_seconds += time.perf_counter() - start
        return buf[0], buf[1] if with_residual else None


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> int:
    import torch

    init = read_frame(stdin, worker_pb2.WorkerInit)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank-{init.rank} %(levelname)s %(name)s: %(message)s")
    try:
        rank = Rank(init)
    except Exception as exc:
        log.exception("rank %d failed to start", init.rank)
        write_frame(stdout, worker_pb2.WorkerReply(step_id=0, error=f"{type(exc).__name__}: {exc}"))
        return 1
    write_frame(stdout, worker_pb2.WorkerReply(step_id=0, weight_bytes=rank.weight_bytes))
    with torch.inference_mode():
        while True:
            try:
                command = read_frame(stdin, worker_pb2.WorkerCommand)
            except ChannelClosed:
                return 0  # the node is gone
            if command.WhichOneof("kind") != "step":
                return 0
            start = time.perf_counter()
            rank.collective_seconds = 0.0
            try:
                rank.step(command.step)
            except Exception as exc:
                log.exception("rank %d failed in step %d", init.rank, command.step.step_id)
                write_frame(stdout, worker_pb2.WorkerReply(step_id=command.step.step_id,
                                                           error=f"{type(exc).__name__}: {exc}"))
                return 1
            write_frame(stdout, worker_pb2.WorkerReply(step_id=command.step.step_id,
                                                       forward_seconds=time.perf_counter() - start,
                                                       collective_seconds=rank.collective_seconds))


if __name__ == "__main__":
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the frames
    sys.exit(serve(sys.stdin.buffer, out))
