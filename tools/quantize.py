"""`loraplex quantize`: writes a compressed-tensors checkpoint (the format
llm-compressor writes and vLLM reads; platform/models/compressed_tensors.py) from a
float HF folder, round to nearest, for every decoder layer's q/k/v/o/gate/up/down
projection:

    W8A8, W8A16 (int8 per output channel, symmetric):
        <proj>.weight             int8 [out, in]   q = round(W / s) within [-127, 127] (W8A8)
        <proj>.weight_packed      int32 [out, in / 4], q packed four to a word, and
        <proj>.weight_shape       int64 [2]        (W8A16, as llm-compressor writes it)
        <proj>.weight_scale       [out, 1]         s = max |W[n]| / 127, in the weight's dtype
    W4A16 (int4 per group of `group_size` inputs, or per channel; symmetric, or with
    zero points: kernels/int4_matmul.py's `quantize_int4`):
        <proj>.weight_packed      int32 [out, in / 8]   (`pack_int4`)
        <proj>.weight_scale       [out, groups]         in the weight's dtype
        <proj>.weight_zero_point  int32 [out / 8, groups], packed along the output
                                  channels (asymmetric only)
        <proj>.weight_shape       int64 [2]

Every other tensor (the embedding table, norms, the LM head) is copied unchanged, and
so are the tokenizer and generation files (not loraplex's own markers). 'W8A8' marks
the activations as quantized per token on the fly, the others leave them unquantized.
No calibration data: dynamic activations need none, and the weights are rounded to
nearest.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from loraplex.kernels.int4_matmul import pack_int4, quantize_int4
from loraplex.kernels.int_packing import pack_ints
from loraplex.platform.models.compressed_tensors import (
    Int4Scheme,
    checkpoint_int4_config,
    checkpoint_quantization_config,
)
from loraplex.platform.models.weights import checkpoint_files

logger = logging.getLogger(__name__)

SCHEMES = {"W8A8": "dynamic", "W8A16": "weight_only", "W4A16": "int4_weight_only"}
INT4_GROUP_SIZE = 128
"""W4A16's default group size (llm-compressor's W4A16 preset's)."""
PROJECTION = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
)


def quantize_projection(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], scale [out, 1] in the weight's dtype): see the module
    docstring; the int8 values are rounded with the scale as stored."""
    wide = weight.float()
    scale = (wide.abs().amax(dim=1, keepdim=True) / 127.0).to(weight.dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.round(wide / scale.float()).clamp_(-127, 127).to(torch.int8)
    return quantized.contiguous(), scale.contiguous()


def quantize_projection_int4(weight: torch.Tensor, scheme: Int4Scheme) -> dict[str, torch.Tensor]:
    """The W4A16 tensors of one projection, by suffix (see the module docstring)."""
    quantized, scale, zero = quantize_int4(weight, scheme.group_size, scheme.symmetric)
    tensors = {
        "_packed": pack_int4(quantized),
        "_scale": scale,
        "_shape": torch.tensor(list(weight.shape), dtype=torch.int64),
    }
    if zero is not None:
        tensors["_zero_point"] = pack_int4(zero.t().contiguous()).t().contiguous()
    return tensors


def quantize_folder(
    source: Path,
    out: Path,
    scheme: str = "W8A8",
    group_size: int | None = INT4_GROUP_SIZE,
    symmetric: bool = True,
) -> Path:
    """Writes the quantized checkpoint of the HF folder `source` into `out` (created;
    must not hold a checkpoint already) and returns `out`. `group_size` (None: per
    channel) and `symmetric` apply to W4A16 only."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {tuple(SCHEMES)}, got {scheme!r}")
    int4 = Int4Scheme(group_size, symmetric) if scheme == "W4A16" else None
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config") is not None:
        raise ValueError(f"{source} is already quantized")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise ValueError(f"{out} already holds a checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    files = checkpoint_files(source)
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names = list(handle.keys())
            for name in tqdm(names, desc=f"quantizing {file.name}", unit="tensor"):
                tensor = handle.get_tensor(name)
                if PROJECTION.fullmatch(name) and int4 is not None:
                    for suffix, value in quantize_projection_int4(tensor, int4).items():
                        tensors[name + suffix] = value
                elif PROJECTION.fullmatch(name) and scheme == "W8A16":
                    quantized, tensors[name + "_scale"] = quantize_projection(tensor)
                    tensors[name + "_packed"] = pack_ints(quantized, 8)
                    tensors[name + "_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
                elif PROJECTION.fullmatch(name):
                    tensors[name], tensors[name + "_scale"] = quantize_projection(tensor)
                else:
                    tensors[name] = tensor.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = (
        checkpoint_int4_config(int4)
        if int4 is not None
        else checkpoint_quantization_config(SCHEMES[scheme])
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():
        skipped = (
            path.suffix == ".safetensors"
            or path.name.startswith("loraplex_")
            or path.name in ("config.json", "model.safetensors.index.json")
        )
        if path.is_file() and not skipped:
            shutil.copy2(path, out / path.name)
    quantized = sum(1 for name in tensors if PROJECTION.fullmatch(name.removesuffix("_packed")))
    logger.info("wrote %s: %d projections quantized (%s)", out, quantized, scheme)
    return out
