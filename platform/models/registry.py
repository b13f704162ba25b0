"""HF architecture name -> model class; model loading and KV cache allocation."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from loraplex.platform.models.arch import ModelArch
from loraplex.platform.models.llama import LlamaForCausalLM

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
    folder: str | Path, dtype: torch.dtype, device: torch.device | str, kernels: str = "torch"
) -> tuple[nn.Module, ModelArch]:
    """Builds the model for `folder/config.json` on `device` in `dtype` with the named
    layer kernels and loads its safetensors weights; returns (model in eval mode, arch)."""
    arch = ModelArch.from_folder(folder)
    model = model_class_for(arch.architecture)(arch, dtype, device, kernels)
    model.load_weights(folder)
    return model.eval(), arch


def allocate_kv_caches(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, num_kv_heads, block_size, head_dim] tensor per layer
    (zeros, so padded reads of never-written slots stay finite)."""
    shape = (2, num_blocks, arch.num_kv_heads, block_size, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
