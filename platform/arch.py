"""Model shape and rope facts parsed once from a Hugging Face `config.json`.

Accepts both config generations: transformers >= 5 writes `rope_parameters`
(`rope_theta`, `rope_type`, scaling keys); older files write `rope_theta` plus an
optional `rope_scaling` dict (`type` or `rope_type`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class _FamilyRules:
    """How one HF architecture spells its biases: None means 'read the config key'."""

    qkv_bias: bool | None
    o_bias: bool | None
    mlp_bias: bool | None


_FAMILIES: dict[str, _FamilyRules] = {
    "LlamaForCausalLM": _FamilyRules(qkv_bias=None, o_bias=None, mlp_bias=None),
    "MistralForCausalLM": _FamilyRules(qkv_bias=False, o_bias=False, mlp_bias=False),
    "Qwen2ForCausalLM": _FamilyRules(qkv_bias=True, o_bias=False, mlp_bias=False),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_FAMILIES)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; scaling keys matter only for their rope_type."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> RopeConfig:
        params = dict(d.get("rope_scaling") or {})
        params.update(d.get("rope_parameters") or {})
        if "max_position_embeddings" in d:
            params.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (need 1.0)")
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        fields: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
        try:
            if rope_type in ("linear", "llama3"):
                fields["factor"] = float(params["factor"])
            if rope_type == "llama3":
                fields["low_freq_factor"] = float(params["low_freq_factor"])
                fields["high_freq_factor"] = float(params["high_freq_factor"])
                fields["original_max_position_embeddings"] = int(
                    params["original_max_position_embeddings"]
                )
        except KeyError as missing:
            raise ValueError(f"rope_type {rope_type!r} needs the key {missing}") from None
        return cls(**fields)


@dataclass(frozen=True)
class ModelArch:
    """Everything the model code and the KV cache planner need from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelArch:
        """Parses an HF config dict; ValueError for unsupported architectures or ropes."""
        names = d.get("architectures") or []
        if not names or names[0] not in _FAMILIES:
            raise ValueError(
                f"unsupported architecture {names[0] if names else None!r}; "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = names[0]
        rules = _FAMILIES[architecture]
        num_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        if d.get("sliding_window") and d.get("use_sliding_window", True):
            logger.warning(
                "%s sets sliding_window=%s; loraplex ignores it (full attention)",
                architecture,
                d["sliding_window"],
            )
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_config(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if rules.qkv_bias is None else rules.qkv_bias,
            o_bias=attention_bias if rules.o_bias is None else rules.o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if rules.mlp_bias is None else rules.mlp_bias,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelArch:
        """Reads `folder/config.json`."""
        return cls.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
        """Bytes of K and V one token occupies across all layers (with `num_kv_heads`
        heads: a tensor-parallel rank's share; default all of them)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * heads * self.head_dim * dtype.itemsize
