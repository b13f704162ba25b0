"""Collectives between the tensor-parallel ranks of one engine.

A `TPGroup` wraps one torch.distributed process group built directly from a TCPStore
(gloo on CPU, NCCL on CUDA), not the process-global default group, so one process may
hold several engines and tests may run ranks as threads. Every collective waits at most
`timeout_s`: a dead or stuck peer raises instead of hanging the engine.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

IDLE_WAIT = datetime.timedelta(days=7)
"""How long a worker waits for rank 0's next step (workers die with their replica, which
owns them, so this only bounds a wait nobody will end)."""


class TPGroup:
    """Rank `rank` of `size`; `size == 1` makes every collective a no-op."""

    def __init__(
        self,
        rank: int,
        size: int,
        process_group: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self._pg = process_group
        self.device = device or torch.device("cpu")
        """Where the group's tensors live (CUDA for NCCL)."""

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def connect(
        cls,
        rank: int,
        size: int,
        port: int,
        device: torch.device,
        timeout_s: float,
        store: dist.Store | None = None,
    ) -> TPGroup:
        """Joins the group whose TCPStore rank 0 serves on 127.0.0.1:`port` (rank 0
        passes the store it made with `make_store`)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(rank, size, pg, device)

    @staticmethod
    def make_store(size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's store on a free port of 127.0.0.1 (read it from `.port`)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        return dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        if self.size > 1:
            self._pg.allreduce([tensor]).wait()
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenates every rank's [..., sizes[r]] along the last dimension, in rank
        order (uneven sizes allowed: padded to the largest for the collective)."""
        if self.size == 1:
            return tensor
        width = max(sizes)
        padded = torch.zeros(*tensor.shape[:-1], width, dtype=tensor.dtype, device=tensor.device)
        padded[..., : tensor.shape[-1]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._pg.allgather([parts], [padded]).wait()
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes, strict=True)], dim=-1)

    def broadcast_object(self, obj: Any = None, idle_wait: bool = False) -> Any:
        """Rank 0's `obj` on every rank (pickled; rank 0 returns its own object).

        `idle_wait` (a worker waiting for the next step) lets the first receive wait up
        to `IDLE_WAIT` instead of the group's timeout: an engine may sit idle for long.
        """
        if self.size == 1:
            return obj
        device = self.device
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        length = length.to(device)
        if idle_wait:
            self._pg.broadcast(length, 0, IDLE_WAIT).wait()
        else:
            self._pg.broadcast(length, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        payload = payload.to(device)
        self._pg.broadcast(payload, 0).wait()
        if self.rank == 0:
            return obj
        return pickle.loads(payload.cpu().numpy().tobytes())
