"""One rank's parts, built the same way by rank 0 (`LLMEngine`) and by the
tensor-parallel ranks 1.. (`TPWorker`): the model's shard, its KV cache, its LoRA slots
and the runner over them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.slots import LoRASlots
from loraplex.platform.kv_cache import allocate_kv_caches
from loraplex.platform.model_runner import ModelRunner, StepFollowers
from loraplex.platform.models.registry import load_model
from loraplex.platform.parallel.group import TPGroup
from loraplex.platform.parallel.layout import TPLayout


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds from (plain values: it crosses to the workers' processes)."""

    folder: str
    dtype: torch.dtype
    device: str
    kernels: str
    """The kernel backend's name (kernels/selection.py)."""
    num_blocks: int
    """KV cache blocks per rank (rank 0 sizes them for all)."""
    block_size: int
    max_loras: int
    """Adapter slots; 0: LoRA off, no slots."""
    max_lora_rank: int
    quantization: str | None = None
    """The projections' int8 mode ('dynamic', 'weight_only'; None: `dtype`)."""
    quantize_lm_head: bool = False


def build_rank(
    spec: RankSpec,
    rank: int = 0,
    group: TPGroup | None = None,
    followers: StepFollowers | None = None,
) -> ModelRunner:
    """Loads rank `rank`'s shard of the model (the whole model without a `group` of
    several ranks), allocates its KV cache and LoRA slots, and returns the runner over
    them; `followers` (rank 0 of several ranks) get each step's inputs."""
    device = torch.device(spec.device)
    model, arch = load_model(
        Path(spec.folder),
        spec.dtype,
        device,
        spec.kernels,
        rank,
        group,
        spec.quantization,
        spec.quantize_lm_head,
    )
    layout = TPLayout.create(arch, rank, group.size if group is not None else 1)
    kv_caches = allocate_kv_caches(
        arch, spec.num_blocks, spec.block_size, spec.dtype, device, layout.num_kv_heads
    )
    slots = None
    if spec.max_loras > 0:
        slots = LoRASlots(
            model.lora_targets(),
            spec.max_loras,
            spec.max_lora_rank,
            spec.kernels,
            saved_modules_allowed=not layout.sharded,
        )
        model.saved_modules = slots.saved
    return ModelRunner(model, kv_caches, spec.block_size, device, slots, followers)
