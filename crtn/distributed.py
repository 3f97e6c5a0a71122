"""Data-parallel training with ``torch.distributed``, launched by ``torchrun``.

    torchrun --standalone --nproc_per_node=2 -m crtn.train data.batch_size=16 ...

Each rank owns a contiguous slice of the B streams (``data.batch_size`` is the global
batch), with its own short-term memory and cache; gradients are averaged by
DistributedDataParallel, so the loss trajectory equals a single-process run with the
same global batch. Without torchrun (``WORLD_SIZE`` unset or 1) everything here is a
no-op. Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from crtn.config import uses_cache


class DistributedContext:
    """Rank, world size and device of this process, and the few collective operations training needs.

    Attributes:
        rank, world_size, local_rank: as set by torchrun (0, 1, 0 when not distributed).
        device: this rank's device.
        enabled: whether a process group is running.
    """

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        device: torch.device | None = None,
        enabled: bool = False,
    ):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device or torch.device("cpu")
        self.enabled = enabled

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics and checkpoints."""
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str = "cpu") -> DistributedContext:
        """Join the process group described by torchrun's environment variables, if any.

        Args:
            device: ``cpu``, ``cuda`` or ``auto``; with CUDA each rank uses ``cuda:LOCAL_RANK``.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if use_cuda else "gloo")
        return cls(rank=rank, world_size=world, local_rank=local, device=dev, enabled=True)

    def wrap(self, model: nn.Module) -> nn.Module:
        """DistributedDataParallel around ``model`` when distributed, else ``model`` itself.

        ``find_unused_parameters`` is on for crtn, whose query-side parameters are unused
        while the cache is still empty.
        """
        if not self.enabled:
            return model
        ids = [self.device] if self.device.type == "cuda" else None
        unused = uses_cache(model)
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=unused)

    def no_sync(self, ddp_model: nn.Module, last: bool):
        """Skip the gradient all-reduce on all but the ``last`` chunk of an accumulated batch."""
        if self.enabled and not last:
            return ddp_model.no_sync()
        return nullcontext()

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """Average of ``t`` over ranks (a copy; ``t`` itself is unchanged)."""
        if not self.enabled:
            return t
        t = t.detach().clone()
        tdist.all_reduce(t)
        return t / self.world_size

    def gather(self, obj: Any) -> list[Any] | None:
        """``obj`` of every rank, in rank order, on rank 0; None on the other ranks (a collective:
        all ranks must call it). Only rank 0 writes checkpoints, so only it receives the streams."""
        if not self.enabled:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        tdist.gather_object(obj, out, dst=0)
        return out

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (a collective), so that all ranks stop together."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def close(self) -> None:
        if self.enabled and tdist.is_initialized():
            tdist.destroy_process_group()
