"""Load a PEFT LoRA adapter directory and check it can be served on a given base model.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors`
with one `lora_A` [r, in] and one `lora_B` [out, r] tensor per adapted projection, named
like `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. Everything is
validated before a `LoRAAdapter` is returned; anything we cannot serve exactly raises
`AdapterError` naming the problem and the offending value.

The returned B already carries the module's scaling (alpha / r, or alpha / sqrt(r) with
rsLoRA, after PEFT's `rank_pattern` / `alpha_pattern`), so the delta is `x @ A.T @ B.T`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import safe_open

from loraplex.platform.models.arch import ModelArch

logger = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLED_WEIGHTS_NAME = "adapter_model.bin"

SUPPORTED_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_ATTENTION_MODULES = SUPPORTED_MODULES[:4]
_PARENT = {m: "self_attn" if m in _ATTENTION_MODULES else "mlp" for m in SUPPORTED_MODULES}
_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<key>model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)"
    r"\.(?P<module>\w+))\.lora_(?P<ab>[AB])\.weight"
)

# Config fields that change the forward math in ways we do not implement: field -> the
# values that are harmless (PEFT's defaults, plus their empty spellings).
_REJECTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),
    "trainable_token_indices": (None, [], {}),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "use_bdlora": (None, {}),
    "arrow_config": (None, {}),
    "kasa_config": (None, {}),
}
# Initialisations that rewrite the base weights (W - B A, quantised residual...): such an
# adapter only fits the modified base unless PEFT converted it back when saving.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# What PEFT's LoraConfig assumes when a key is absent from the file.
_PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8}


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message says why."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapted projection: delta(x) = x @ a.T @ b.T (b already scaled)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated adapter; `key` identifies its content, not its name or location."""

    name: str
    path: Path
    key: bytes
    modules: Mapping[tuple[int, str], LoRAModuleWeights]

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.modules)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.a, m.b))

    @property
    def key_hex(self) -> str:
        return self.key.hex()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Picklable (the read-only module map is rebuilt): tensor-parallel workers get
        the adapters rank 0 writes into its slots."""
        return _rebuild_adapter, (self.name, self.path, self.key, dict(self.modules))


def _rebuild_adapter(
    name: str, path: Path, key: bytes, modules: dict[tuple[int, str], LoRAModuleWeights]
) -> LoRAAdapter:
    return LoRAAdapter(name, path, key, MappingProxyType(modules))


def expected_lora_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each supported base projection."""
    q_out = arch.num_heads * arch.head_dim
    kv_out = arch.num_kv_heads * arch.head_dim
    return {
        "q_proj": (q_out, arch.hidden_size),
        "k_proj": (kv_out, arch.hidden_size),
        "v_proj": (kv_out, arch.hidden_size),
        "o_proj": (arch.hidden_size, q_out),
        "gate_proj": (arch.intermediate_size, arch.hidden_size),
        "up_proj": (arch.intermediate_size, arch.hidden_size),
        "down_proj": (arch.hidden_size, arch.intermediate_size),
    }


def load_peft_adapter(
    path: str | Path, arch: ModelArch, max_rank: int, name: str | None = None
) -> LoRAAdapter:
    """Reads and validates a PEFT LoRA directory; AdapterError if it cannot be served."""
    path = Path(path)
    config = _read_config(path)
    _check_config_is_plain_lora(config)
    tensors = _read_tensors(path / WEIGHTS_NAME)
    pairs = _pair_lora_tensors(tensors, arch)
    modules: dict[tuple[int, str], LoRAModuleWeights] = {}
    for (layer, module), (a_name, b_name) in sorted(pairs.items(), key=_layer_then_module):
        a, b = tensors[a_name], tensors[b_name]
        _check_ranks(a_name, a, b_name, b, max_rank)
        _check_finite(a_name, a)
        _check_finite(b_name, b)
        scaling = _module_scaling(config, _module_key(a_name), a.shape[0])
        a32 = a.to(torch.float32).contiguous()
        b32 = (b.to(torch.float32) * scaling).contiguous()
        modules[(layer, module)] = LoRAModuleWeights(a=a32, b=b32, scaling=scaling)
    scalings = {k: m.scaling for k, m in modules.items()}
    adapter = LoRAAdapter(
        name=name if name is not None else path.name,
        path=path,
        key=_identity_key(scalings, tensors),
        modules=MappingProxyType(modules),
    )
    logger.info(
        "loaded adapter %r from %s: %d modules, rank %d, %d bytes, key %s",
        adapter.name,
        path,
        len(modules),
        adapter.rank,
        adapter.num_bytes,
        adapter.key_hex,
    )
    return adapter


def _layer_then_module(item: tuple[tuple[int, str], Any]) -> tuple[int, int]:
    (layer, module), _ = item
    return layer, SUPPORTED_MODULES.index(module)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise AdapterError(f"adapter directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise AdapterError(f"adapter path {str(path)!r} is not a directory")
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise AdapterError(f"{CONFIG_NAME} is missing in {str(path)!r}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    if not (path / WEIGHTS_NAME).is_file():
        if (path / PICKLED_WEIGHTS_NAME).is_file():
            raise AdapterError(
                f"{str(path)!r} has only {PICKLED_WEIGHTS_NAME}: pickled .bin adapters are not "
                f"supported, convert it to {WEIGHTS_NAME}"
            )
        raise AdapterError(f"{WEIGHTS_NAME} is missing in {str(path)!r}")
    return config


def _check_config_is_plain_lora(config: dict[str, Any]) -> None:
    """Rejects other PEFT methods and LoRA variants whose forward we do not implement."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported; only 'LORA' adapters are")
    if config.get("use_dora"):
        raise AdapterError("DoRA is not supported (use_dora=true)")
    for field, harmless in _REJECTED_UNLESS.items():
        value = config.get(field)
        if not any(value == ok and type(value) is type(ok) for ok in harmless):
            raise AdapterError(f"{field}={value!r} is not supported (need one of {harmless})")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_MODIFYING_INITS):
        raise AdapterError(
            f"init_lora_weights={init!r} adapters were trained on modified base weights; "
            "save them with path_initial_model_for_weight_conversion first"
        )
    _check_scaling_fields(config)


def _check_scaling_fields(config: dict[str, Any]) -> None:
    """r, lora_alpha and the values of rank_pattern / alpha_pattern must be positive numbers."""

    def check(where: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise AdapterError(f"{where}={value!r} in {CONFIG_NAME} must be a positive number")

    for field, default in _PEFT_DEFAULTS.items():
        check(field, config.get(field, default))
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{field}={pattern!r} in {CONFIG_NAME} must be an object")
        for key, value in pattern.items():
            check(f"{field}[{key!r}]", value)


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(file, framework="pt") as f:
            return {tensor_name: f.get_tensor(tensor_name) for tensor_name in f.keys()}
    except Exception as err:  # safetensors raises its own error types, and OSError
        raise AdapterError(f"{file} is corrupt or truncated: {err}") from None


def _pair_lora_tensors(
    tensors: dict[str, torch.Tensor], arch: ModelArch
) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, module) -> (A tensor name, B tensor name), checking names and shapes."""
    shapes = expected_lora_shapes(arch)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(tensor_name)
        module = match["module"] if match else None
        if match is None or _PARENT.get(module) != match["parent"]:
            raise AdapterError(
                f"unsupported target module in tensor {tensor_name!r}; only LoRA A/B of the "
                f"decoder-layer projections {', '.join(SUPPORTED_MODULES)} are supported"
            )
        layer = int(match["layer"])
        if layer >= arch.num_layers:
            raise AdapterError(
                f"tensor {tensor_name!r} is for layer {layer} but the base model has "
                f"{arch.num_layers} layers (adapter made for another base model?)"
            )
        _check_shape(tensor_name, tensor, match["ab"], shapes[module])
        found.setdefault((layer, module), {})[match["ab"]] = tensor_name
    if not found:
        raise AdapterError(f"{WEIGHTS_NAME} holds no LoRA tensors")
    for (layer, module), names in found.items():
        for missing, present in (("A", "B"), ("B", "A")):
            if missing not in names:
                raise AdapterError(
                    f"layers.{layer}.{module} has lora_{present} ({names[present]!r}) "
                    f"but no lora_{missing}"
                )
    return {k: (v["A"], v["B"]) for k, v in found.items()}


def _check_shape(tensor_name: str, tensor: torch.Tensor, ab: str, out_in: tuple[int, int]) -> None:
    if not tensor.is_floating_point():
        raise AdapterError(f"tensor {tensor_name!r} has dtype {tensor.dtype}, need floating point")
    out_features, in_features = out_in
    shape = tuple(tensor.shape)
    ok = len(shape) == 2 and (shape[1] == in_features if ab == "A" else shape[0] == out_features)
    if not ok:
        expected = f"[r, {in_features}]" if ab == "A" else f"[{out_features}, r]"
        raise AdapterError(
            f"tensor {tensor_name!r} has shape {list(shape)}, expected {expected} for this "
            "base model (adapter made for another base architecture?)"
        )


def _check_ranks(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor, max_rank: int) -> None:
    if a.shape[0] != b.shape[1]:
        raise AdapterError(
            f"rank mismatch: {a_name!r} has rank {a.shape[0]} but {b_name!r} has rank {b.shape[1]}"
        )
    if a.shape[0] > max_rank:
        raise AdapterError(
            f"rank {a.shape[0]} of {_module_key(a_name)} exceeds max_lora_rank {max_rank}"
        )


def _check_finite(tensor_name: str, tensor: torch.Tensor) -> None:
    if not torch.isfinite(tensor).all():
        raise AdapterError(f"tensor {tensor_name!r} contains NaN or Inf values")


def _module_key(tensor_name: str) -> str:
    """The module's name inside the HF model, as PEFT matches patterns against it."""
    match = _TENSOR_NAME.fullmatch(tensor_name)
    assert match is not None
    return match["key"]


def _pattern_value(pattern: dict[str, Any], module_key: str, default: Any) -> Any:
    """PEFT's rule: the first key (in file order) that matches the whole name or a dotted
    suffix of it, as a regex, wins."""
    for key in pattern:
        try:
            matched = re.match(rf"(.*\.)?({key})$", module_key)
        except re.error as err:
            raise AdapterError(f"pattern key {key!r} is not a valid regex: {err}") from None
        if matched:
            return pattern[key]
    return default


def _module_scaling(config: dict[str, Any], module_key: str, tensor_rank: int) -> float:
    r = config.get("r", _PEFT_DEFAULTS["r"])
    alpha = config.get("lora_alpha", _PEFT_DEFAULTS["lora_alpha"])
    r = _pattern_value(config.get("rank_pattern") or {}, module_key, r)
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_key, alpha)
    if r != tensor_rank:
        raise AdapterError(
            f"{module_key} has rank {tensor_rank} in {WEIGHTS_NAME} but {CONFIG_NAME} "
            f"gives r={r} for it"
        )
    if config.get("use_rslora"):
        return float(alpha) / math.sqrt(r)
    return float(alpha) / r


def _identity_key(
    scalings: dict[tuple[int, str], float], tensors: dict[str, torch.Tensor]
) -> bytes:
    """blake2b over the per-module scalings (the config's whole effect on outputs) and
    every tensor's name, dtype, shape and raw bytes, in sorted order."""
    digest = hashlib.blake2b(digest_size=16)
    for (layer, module), scaling in sorted(scalings.items()):
        digest.update(f"scaling {layer} {module} {scaling.hex()}\n".encode())
    for tensor_name in sorted(tensors):
        tensor = tensors[tensor_name].contiguous()
        digest.update(f"tensor {tensor_name} {tensor.dtype} {list(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.digest()
