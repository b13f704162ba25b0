"""Checkpoints already quantized in the compressed-tensors format (what llm-compressor
writes and vLLM reads) that the engine serves: int8 weights per output channel,
symmetric, on the decoder layers' Linear projections, stored as `<proj>.weight` (int8
[out, in]) and `<proj>.weight_scale` ([out, 1]); the activations either quantized per
token on the fly (W8A8, `input_activations` int8 dynamic per token) or not quantized
(W8A16). The LM head stays unquantized (`ignore` lists it, and only it).

`read_checkpoint_quantization(config)` reads config.json's `quantization_config` and
names the int8 mode (kernels/int8_matmul.py) the projections run in, or raises
ValueError naming the first field this engine cannot serve exactly.
`checkpoint_quantization_config(mode)` is the config a checkpoint of that mode carries
(`loraplex quantize` writes it).
"""

from __future__ import annotations

from typing import Any

QUANT_METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized")
WEIGHT_ARGS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "channel",
    "group_size": None,
    "dynamic": False,
}
ACTIVATION_ARGS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "group_size": None,
    "dynamic": True,
}
"""The fields that decide the math (others, observers and the like, only say how a
quantizer chose the values)."""


def read_checkpoint_quantization(config: dict[str, Any]) -> str | None:
    """The int8 mode ('dynamic' for W8A8, 'weight_only' for W8A16) of a checkpoint's
    config.json, None when it holds no `quantization_config`."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != QUANT_METHOD:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"quantization_config quant_method {method!r} is not served; only "
            f"{QUANT_METHOD!r} int8 checkpoints (W8A8, W8A16 per channel) are"
        )
    if quantization.get("format") not in FORMATS:
        raise ValueError(
            f"compressed-tensors format {quantization.get('format')!r} is not served "
            f"(need one of {FORMATS})"
        )
    if quantization.get("kv_cache_scheme") is not None:
        raise ValueError("compressed-tensors kv_cache_scheme is not served")
    groups = quantization.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"need exactly one compressed-tensors config group, got {len(groups)}")
    (group,) = groups.values()
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"config group targets {group.get('targets')!r}, need ['Linear']")
    if group.get("output_activations") is not None:
        raise ValueError("compressed-tensors output_activations are not served")
    _check_args("weights", group.get("weights"), WEIGHT_ARGS)
    ignored = quantization.get("ignore") or []
    if ignored != ["lm_head"]:
        raise ValueError(
            f"compressed-tensors ignore={ignored!r} is not served: every decoder projection "
            "is int8 and only lm_head stays unquantized (ignore: ['lm_head'])"
        )
    activations = group.get("input_activations")
    if activations is None:
        return "weight_only"
    _check_args("input_activations", activations, ACTIVATION_ARGS)
    return "dynamic"


def _check_args(where: str, args: Any, wanted: dict[str, Any]) -> None:
    if not isinstance(args, dict):
        raise ValueError(f"compressed-tensors {where} must be an object, got {args!r}")
    for field, value in wanted.items():
        if args.get(field) != value:
            raise ValueError(
                f"compressed-tensors {where}.{field}={args.get(field)!r} is not served "
                f"(need {value!r})"
            )


def checkpoint_quantization_config(mode: str) -> dict[str, Any]:
    """config.json's `quantization_config` of a checkpoint in `mode`."""
    group: dict[str, Any] = {
        "targets": ["Linear"],
        "weights": {**WEIGHT_ARGS, "observer": "minmax", "actorder": None},
        "input_activations": (
            {**ACTIVATION_ARGS, "observer": None, "actorder": None} if mode == "dynamic" else None
        ),
        "output_activations": None,
    }
    return {
        "quant_method": QUANT_METHOD,
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
