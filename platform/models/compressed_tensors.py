"""Checkpoints already quantized in the compressed-tensors format (what llm-compressor
writes and vLLM reads) that the engine serves, on the decoder layers' Linear
projections (the LM head stays unquantized: `ignore` lists it, and only it):

- int8 weights per output channel, symmetric (`int-quantized` / `naive-quantized`),
  stored as `<proj>.weight` (int8 [out, in]) and `<proj>.weight_scale` ([out, 1]); the
  activations either quantized per token on the fly (W8A8, `input_activations` int8
  dynamic per token) or not quantized (W8A16); or packed four to an int32 as
  llm-compressor writes W8A16 (`pack-quantized`, 8 bits: `<proj>.weight_packed` int32
  [out, in / 4], kernels/int_packing.py, and `<proj>.weight_shape`);
- int4 weights (`pack-quantized`, W4A16, what llm-compressor's GPTQ, AWQ and W4A16
  round-to-nearest recipes write), per group of inputs or per output channel,
  symmetric or with zero points, stored as `<proj>.weight_packed` (int32 [out, in / 8],
  kernels/int4_matmul.py's `pack_int4` layout), `<proj>.weight_scale` ([out, groups]),
  `<proj>.weight_zero_point` (asymmetric only: int32 [out / 8, groups], packed along
  the output dimension) and `<proj>.weight_shape`; activations not quantized. Groups
  in activation order (`actorder: group`, a `weight_g_idx` per input) are refused.

`read_checkpoint_quantization(config)` reads config.json's `quantization_config` and
names the mode the projections run in (an int8 mode of kernels/int8_matmul.py, or
INT4_MODE), or raises ValueError naming the first field this engine cannot serve
exactly; `read_int4_scheme(config)` gives an int4 checkpoint's groups, and
`int8_is_packed(config)` whether an int8 one's weights are packed.
`checkpoint_quantization_config(mode)` is the config a checkpoint of that mode carries
(`loraplex quantize` writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANT_METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized")
"""The formats of int8 checkpoints."""
PACKED_FORMAT = "pack-quantized"
"""int4 (W4A16) checkpoints, and int8 W8A16 as llm-compressor writes them."""
INT4_MODE = "int4_weight_only"
INT4_LM_HEAD_MODE = "dynamic"
"""The int8 mode an int4 checkpoint's LM head runs in under `quantize_lm_head` (W8A8)."""
INT4_STRATEGIES = ("group", "channel")
INT4_ACTORDERS = (None, "weight", "static")
"""Activation orders that store the weight in its own order (no `weight_g_idx`)."""
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


@dataclass(frozen=True)
class Int4Scheme:
    """An int4 checkpoint's weights: `group_size` inputs share a scale (and a zero
    point unless `symmetric`); None: one group per output channel."""

    group_size: int | None
    symmetric: bool


def read_checkpoint_quantization(config: dict[str, Any]) -> str | None:
    """The mode of a checkpoint's config.json: 'dynamic' (W8A8) or 'weight_only' (W8A16)
    int8, or INT4_MODE (W4A16); None when it holds no `quantization_config`."""
    group = _config_group(config)
    if group is None:
        return None
    packed = config["quantization_config"].get("format") == PACKED_FORMAT
    weights = group.get("weights")
    if packed and not (isinstance(weights, dict) and weights.get("num_bits") == 8):
        _int4_weights(group)
        return INT4_MODE
    _check_args("weights", weights, WEIGHT_ARGS)
    if packed:
        if group.get("input_activations") is not None:
            raise ValueError(
                f"compressed-tensors {PACKED_FORMAT} int8 input_activations are not served "
                "(W8A16 only)"
            )
        return "weight_only"
    activations = group.get("input_activations")
    if activations is None:
        return "weight_only"
    _check_args("input_activations", activations, ACTIVATION_ARGS)
    return "dynamic"


def int8_is_packed(config: dict[str, Any]) -> bool:
    """Whether an int8 checkpoint's weights are packed four to an int32
    (`pack-quantized`, W8A16) rather than stored as int8."""
    return (config.get("quantization_config") or {}).get("format") == PACKED_FORMAT


def read_int4_scheme(config: dict[str, Any]) -> Int4Scheme:
    """The groups of an int4 (INT4_MODE) checkpoint's config.json."""
    group = _config_group(config)
    if group is None or config["quantization_config"].get("format") != PACKED_FORMAT:
        raise ValueError(f"not an int4 ({PACKED_FORMAT}) compressed-tensors checkpoint")
    return _int4_weights(group)


def _config_group(config: dict[str, Any]) -> dict[str, Any] | None:
    """The one config group of a served compressed-tensors `quantization_config`."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != QUANT_METHOD:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"quantization_config quant_method {method!r} is not served; only "
            f"{QUANT_METHOD!r} checkpoints (int8 W8A8 and W8A16 per channel, int4 W4A16) are"
        )
    if quantization.get("format") not in (*FORMATS, PACKED_FORMAT):
        raise ValueError(
            f"compressed-tensors format {quantization.get('format')!r} is not served "
            f"(need one of {(*FORMATS, PACKED_FORMAT)})"
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
    ignored = quantization.get("ignore") or []
    if ignored != ["lm_head"]:
        raise ValueError(
            f"compressed-tensors ignore={ignored!r} is not served: every decoder projection "
            "is quantized and only lm_head stays unquantized (ignore: ['lm_head'])"
        )
    return group


def _int4_weights(group: dict[str, Any]) -> Int4Scheme:
    """The int4 scheme of a `pack-quantized` config group, checked."""
    weights = group.get("weights")
    _check_args("weights", weights, {"num_bits": 4, "type": "int", "dynamic": False})
    strategy = weights.get("strategy")
    if strategy not in INT4_STRATEGIES:
        raise ValueError(
            f"compressed-tensors weights.strategy={strategy!r} is not served for int4 "
            f"(need one of {INT4_STRATEGIES})"
        )
    group_size = weights.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size >= 1):
        raise ValueError(f"compressed-tensors weights.group_size={group_size!r} is not served")
    if weights.get("actorder") not in INT4_ACTORDERS:
        raise ValueError(
            f"compressed-tensors weights.actorder={weights.get('actorder')!r} is not served "
            "(groups in activation order need a g_idx per input)"
        )
    if not isinstance(weights.get("symmetric"), bool):
        raise ValueError(
            f"compressed-tensors weights.symmetric={weights.get('symmetric')!r} is not served"
        )
    if group.get("input_activations") is not None:
        raise ValueError("compressed-tensors int4 input_activations are not served (W4A16 only)")
    return Int4Scheme(group_size if strategy == "group" else None, weights["symmetric"])


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
    """config.json's `quantization_config` of an int8 checkpoint in `mode`: W8A8
    `int-quantized`, W8A16 `pack-quantized` (as llm-compressor writes each)."""
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
        "format": "int-quantized" if mode == "dynamic" else PACKED_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def checkpoint_int4_config(scheme: Int4Scheme) -> dict[str, Any]:
    """config.json's `quantization_config` of an int4 (W4A16) checkpoint of `scheme`."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": "channel" if scheme.group_size is None else "group",
        "group_size": scheme.group_size,
        "dynamic": False,
        "observer": "minmax",
        "actorder": None,
    }
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
    }
    return {
        "quant_method": QUANT_METHOD,
        "format": PACKED_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
