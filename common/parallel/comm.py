"""Collectives between the ranks of one tensor- or pipeline-parallel node.

A node of T x P ranks runs each rank in its own process (common/parallel/worker.py). The model's parallel
layers (common/parallel/tp_layers.py) reach the other ranks of their tensor-parallel group only through a
``Communicator``: an in-place sum (``all_reduce_``, after each row-parallel layer and the vocab-parallel
embedding) and a gather (``all_gather``). Pipeline stages hand hidden states on with ``send`` / ``recv``.

Implementations: ``SingleRank`` (T = 1: every collective is the identity), ``GlooComm`` (torch.distributed
over gloo, any hosts; NCCL on CUDA) and, on one host, the shared-memory all-reduce
(common/parallel/shm_comm.py), which avoids gloo's per-call cost for the small tensors of a decode step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class Communicator(Protocol):
    """The collectives of one group of ranks (a tensor-parallel group, or a pipeline's stages)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` (equal shapes), concatenated along ``dim`` in rank order."""
        ...

    def close(self) -> None: ...


class SingleRank:
    """A group of one: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def close(self) -> None:
        pass


class GlooComm:
    """torch.distributed collectives over a process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int]) -> None:
        import torch.distributed as dist

        self.group = group
        self.ranks = ranks  # global ranks of the group, in group-rank order
        self._rank = ranks.index(dist.get_rank())

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if len(self.ranks) > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        if len(self.ranks) == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in self.ranks]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def close(self) -> None:
        pass
