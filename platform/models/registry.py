"""HF architecture name -> model class; model loading."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from loraplex.platform.arch import ModelArch
from loraplex.platform.models.compressed_tensors import (
    INT4_LM_HEAD_MODE,
    INT4_MODE,
    int8_is_packed,
    read_checkpoint_quantization,
    read_int4_scheme,
)
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
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> tuple[nn.Module, ModelArch]:
    """Builds the model for `folder/config.json` on `device` in `dtype` with the named
    layer kernels (rank `rank`'s shard when `group` spans several ranks) and loads its
    safetensors weights, its projections quantized to int8 in `quantization`'s mode
    (an int8 compressed-tensors checkpoint's stored int8 weights, in its own mode
    unless `quantization` names another; an int4 one's as stored, `quantization`
    unset)
    (kernels/int8_matmul.py; None: none), the LM head too with `quantize_lm_head` (W8A8
    over an int4 checkpoint); returns (model in eval mode, arch)."""
    arch = ModelArch.from_folder(folder)
    group = group or TPGroup.single()
    layout = TPLayout.create(arch, rank, group.size)
    model = model_class_for(arch.architecture)(arch, dtype, device, kernels, layout, group)
    config = json.loads((Path(folder) / "config.json").read_text())
    checkpoint_mode = read_checkpoint_quantization(config)
    if checkpoint_mode == INT4_MODE:
        if quantization is not None:
            raise ValueError("an int4 checkpoint runs as stored: leave quantization unset")
        head_mode = INT4_LM_HEAD_MODE if quantize_lm_head else None
        model.load_weights(
            folder, head_mode, quantize_lm_head, int4_scheme=read_int4_scheme(config)
        )
        return model.eval(), arch
    model.load_weights(
        folder,
        quantization or checkpoint_mode,
        quantize_lm_head,
        checkpoint_mode is not None,
        int8_packed=checkpoint_mode is not None and int8_is_packed(config),
    )
    return model.eval(), arch
