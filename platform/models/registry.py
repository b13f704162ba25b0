"""HF architecture name -> model class; model loading and KV cache allocation."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from loraplex.platform.models.arch import ModelArch
from loraplex.platform.models.llama import LlamaForCausalLM
from loraplex.platform.parallel.group import TPGroup
from loraplex.platform.parallel.layout import TPLayout

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class_for(architecture: str) -> type[nn.Module]:
    """The class that runs `architecture`; ValueError naming the supported ones."""
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(_MODEL_CLASSES)}"
        ) from None


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    kernels: str = "torch",
    rank: int = 0,
    group: TPGroup | None = None,
) -> tuple[nn.Module, ModelArch]:
    """Builds the model for `folder/config.json` on `device` in `dtype` with the named
    layer kernels (rank `rank`'s shard when `group` spans several ranks) and loads its
    safetensors weights; returns (model in eval mode, arch)."""
    arch = ModelArch.from_folder(folder)
    group = group or TPGroup.single()
    layout = TPLayout.create(arch, rank, group.size)
    model = model_class_for(arch.architecture)(arch, dtype, device, kernels, layout, group)
    model.load_weights(folder)
    return model.eval(), arch


def allocate_kv_caches(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, num_kv_heads, block_size, head_dim] tensor per layer
    (zeros, so padded reads of never-written slots stay finite); `num_kv_heads`
    overrides the model's count with a tensor-parallel rank's share."""
    heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    shape = (2, num_blocks, heads, block_size, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]


def copy_blocks(kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: block dst <- block src in every layer's cache, for (src, dst) pairs."""
    if not copies:
        return
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in copies], device=device)
    dst = torch.tensor([d for _, d in copies], device=device)
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]
