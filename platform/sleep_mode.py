"""Sleep and wake: an idle engine gives its memory back to a job that shares the machine
(a training loop between its rollouts), then takes it again.

Asleep, an engine holds no KV cache (each layer's tensor is released; the prefix cache
goes with it) and, on a GPU, its weights (the model's parameters and buffers) sit in
pinned host memory, while its LoRA slots stay where they are; the decode graphs, which
captured the old buffers' addresses, are dropped. Waking allocates
a zeroed KV cache of the same shape, moves the weights back and captures the graphs
again. On a CPU the weights are host memory already: sleep releases the KV cache only.

`SleepReport` says what moved and how long it took.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from loraplex.platform.layers.linear import MergedLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SleepReport:
    """One sleep or wake: its wall time, and the bytes it released or allocated."""

    seconds: float
    kv_cache_bytes: int
    """KV cache memory released (sleep) or allocated again (wake)."""
    weight_bytes: int
    """Weights moved to host memory (sleep) or back (wake); 0 on a CPU."""

    def as_dict(self) -> dict[str, float]:
        return {
            "seconds": round(self.seconds, 4),
            "kv_cache_bytes": self.kv_cache_bytes,
            "weight_bytes": self.weight_bytes,
        }


@dataclass(frozen=True)
class KVShape:
    """What one layer's KV cache tensor is allocated as again on wake."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def release_kv_caches(kv_caches: list[torch.Tensor]) -> tuple[list[KVShape], int]:
    """Replaces every layer's KV tensor in `kv_caches` (in place: the runner keeps the
    list) by an empty one; returns what to allocate on wake and the bytes released."""
    shapes = [KVShape(tuple(t.shape), t.dtype, t.device) for t in kv_caches]
    released = sum(t.numel() * t.element_size() for t in kv_caches)
    kv_caches[:] = [torch.empty(0, dtype=s.dtype, device=s.device) for s in shapes]
    return shapes, released


def restore_kv_caches(kv_caches: list[torch.Tensor], shapes: list[KVShape]) -> int:
    """Allocates zeroed KV tensors of `shapes` into `kv_caches` (in place); the bytes."""
    kv_caches[:] = [torch.zeros(s.shape, dtype=s.dtype, device=s.device) for s in shapes]
    return sum(t.numel() * t.element_size() for t in kv_caches)


def move_tensors(modules: list[nn.Module], device: torch.device) -> int:
    """Moves the parameters and buffers of `modules` to `device` in place (the modules
    and whoever holds them keep working with the moved tensors); host copies are pinned
    so that waking copies at full bandwidth. A projection whose LoRA shrink is folded
    into its weight (layers/linear.py) is unfolded before its weight leaves, so the
    folded tensor is freed, and folded again once its weight is back beside its slots.
    Returns the bytes moved (0 when they are on `device` already)."""
    moved = 0
    pin = device.type == "cpu" and torch.cuda.is_available()
    projections = [m for module in modules for m in module.modules() if isinstance(m, MergedLinear)]
    for projection in projections:
        if projection.weight.device != device:
            projection.unfold_lora_shrink()
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.device == device:
                continue
            copy = tensor.data.to(device)
            tensor.data = copy.pin_memory() if pin else copy
            moved += tensor.numel() * tensor.element_size()
    for projection in projections:
        if projection.lora is not None and projection.lora.a.device == projection.weight.device:
            projection.fold_lora_shrink()
    return moved
