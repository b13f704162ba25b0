"""Device tier of the adapter store: `max_loras` slots in the projections' LoRA stacks.

Each step the runner asks for the step's adapters to be resident (`activate`). An
adapter already in a slot keeps it; a missing one takes a free slot, else the least
recently used slot that no adapter of this step needs. The scheduler admits at most
`max_loras` distinct adapters among running requests, so a slot is always found.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.adapters.saved_modules import SavedModuleSlots
from loraplex.kernels.backends import KernelBackend, get_backend
from loraplex.kernels.lora import LoRAStack

logger = logging.getLogger(__name__)


class LoRAProjection(Protocol):
    """What the slots need of a projection layer (the platform's `MergedLinear`)."""

    lora: LoRAStack | None
    output_sizes: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]: ...

    def enable_lora(self, max_loras: int, max_rank: int, backend: KernelBackend) -> LoRAStack: ...

    def lora_shard(
        self, index: int, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


LoRATargets = dict[tuple[int, str], tuple[LoRAProjection, int]]
"""(layer index, PEFT module name) -> (projection, slice index): the model's `lora_targets()`."""


@dataclass
class SlotStats:
    loads: int = 0
    evictions: int = 0
    load_seconds: float = 0.0


class LoRASlots:
    def __init__(
        self,
        targets: LoRATargets,
        max_loras: int,
        max_rank: int,
        backend: str,
        saved_modules_allowed: bool = True,
    ) -> None:
        """`backend` names the kernel backend the model was built with (its stacks'
        layout and LoRA kernels). `saved_modules_allowed` False (tensor parallelism):
        adapters with `modules_to_save` are refused when written."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 to allocate slots, got {max_loras}")
        self.targets = targets
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.projections: list[LoRAProjection] = list(
            {id(module): module for module, _ in targets.values()}.values()
        )
        kernels = get_backend(backend)
        for module in self.projections:
            module.enable_lora(max_loras, max_rank, kernels)
        stack = self.projections[0].lora
        self.saved = SavedModuleSlots(
            max_loras, stack.a.dtype, stack.a.device, saved_modules_allowed
        )
        """Each slot's adapter's own embedding table and LM head (adapters/saved_modules.py)."""
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        """adapter key -> slot, least recently used first."""
        self._adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._recent_loads: list[tuple[int, LoRAAdapter]] = []
        self.failed_adapter: LoRAAdapter | None = None
        """The adapter whose write failed in the last `activate` (its slot stays empty)."""
        self.stats = SlotStats()

    @property
    def num_bytes(self) -> int:
        return sum(module.lora.num_bytes for module in self.projections) + self.saved.num_bytes

    @property
    def resident(self) -> list[LoRAAdapter]:
        """Adapters currently in a slot."""
        return [adapter for adapter in self._adapters if adapter is not None]

    def slot_ranks(self) -> list[int]:
        """Rank of the adapter in each slot (0 for an empty slot)."""
        return [adapter.rank if adapter else 0 for adapter in self._adapters]

    def activate(self, adapters: Iterable[LoRAAdapter]) -> dict[bytes, int]:
        """Makes every adapter resident; returns adapter key -> slot."""
        wanted = {adapter.key: adapter for adapter in adapters}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, only {self.max_loras} slots")
        for key in wanted:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        self.failed_adapter = None
        for key, adapter in wanted.items():
            if key not in self._slot_of:
                try:
                    self.load(adapter, self._free_slot(wanted))
                except Exception:
                    self.failed_adapter = adapter
                    raise
        return {key: self._slot_of[key] for key in wanted}

    def clear(self) -> None:
        """Empties every slot (after a failed step, nothing in them is trusted)."""
        self._slot_of.clear()
        self._adapters = [None] * self.max_loras
        for slot in range(self.max_loras):
            self.saved.clear(slot)
        self._recent_loads = []

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        """(slot, adapter) written since the last call: what tensor-parallel workers
        must write into the same slots of their shards."""
        loads, self._recent_loads = self._recent_loads, []
        return loads

    def _free_slot(self, wanted: dict[bytes, LoRAAdapter]) -> int:
        for slot, adapter in enumerate(self._adapters):
            if adapter is None:
                return slot
        victim = next(key for key in self._slot_of if key not in wanted)
        slot = self._slot_of.pop(victim)
        logger.info("evicting adapter %s from slot %d", self._adapters[slot].name, slot)
        self._adapters[slot] = None
        self.stats.evictions += 1
        return slot

    @torch.no_grad()
    def load(self, adapter: LoRAAdapter, slot: int) -> None:
        """Writes `adapter` into `slot` of every projection (this rank's shard of it)."""
        started = time.perf_counter()
        previous = self._adapters[slot]
        if previous is not None:
            self._slot_of.pop(previous.key, None)
        self._adapters[slot] = None
        for module in self.projections:
            module.lora.a[slot].zero_()
            module.lora.b[slot].zero_()
        self.saved.write(slot, adapter)
        rank = adapter.rank
        for (layer, name), weights in adapter.modules.items():
            module, index = self.targets[(layer, name)]
            stack = module.lora
            start, size = module.offsets[index], module.output_sizes[index]
            cols = slice(index * rank, index * rank + weights.rank)
            a, b = module.lora_shard(index, weights.a, weights.b)
            stack.a[slot, cols].copy_(a)
            stack.b[slot, start : start + size, cols].copy_(b)
        self._adapters[slot] = adapter
        self._slot_of[adapter.key] = slot
        self._recent_loads.append((slot, adapter))
        elapsed = time.perf_counter() - started
        self.stats.loads += 1
        self.stats.load_seconds += elapsed
        logger.info(
            "adapter %s (rank %d, %s) -> slot %d in %.1f ms",
            adapter.name,
            rank,
            adapter.key_hex[:12],
            slot,
            elapsed * 1e3,
        )
