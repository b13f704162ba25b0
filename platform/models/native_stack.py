"""The CPU engine's decoder layers as one native call (kernels/decoder_stack.py).

A batch-1 CPU step spent about a fifth of its time in Python between operators: module
calls, attribute lookups, splits and views, some 100 us per layer. `NativeDecoderStack`
gathers a `LlamaForCausalLM`'s norm weights, prepacked projections and LoRA slots once,
and each forward hands the whole layer loop to C++, which calls the same operators in
the same order (its output is the Python loop's bit for bit). Every step runs it:
decodes and prefill chunks alike, with or without adapters in the batch.

The projections may be oneDNN-prepacked, plain or int8 (`quantization`). The model
keeps its Python loop where the stack does not apply (`unsupported_reason`): another
kernel backend, tensor parallelism, a mix of projection kinds, or half-precision
weights this CPU widens to fp32 for its matmuls. `enforce_eager: true` keeps it
everywhere.
"""

from __future__ import annotations

import logging

import torch

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.backends import prefill_lens
from loraplex.kernels.cpu_matmul import PackedWeight, cpu_lacks_half_matmul
from loraplex.kernels.decoder_stack import (
    StackAttention,
    StackLoRA,
    StackWeights,
    decoder_stack,
)
from loraplex.kernels.int4_matmul import Int4Weight
from loraplex.kernels.int8_matmul import Int8Weight
from loraplex.kernels.lora import LoRABatch
from loraplex.platform.layers.linear import MergedLinear
from loraplex.platform.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_EMPTY_LENS = torch.empty(0, dtype=torch.int64)
_EMPTY_INT8 = torch.empty(0, 0, dtype=torch.int8)
_EMPTY_INT32 = torch.empty(0, dtype=torch.int32)
_EMPTY_F32 = torch.empty(0, dtype=torch.float32)
_EMPTY_UINT8 = torch.empty(0, 0, dtype=torch.uint8)


def _projections(model: LlamaForCausalLM) -> list[MergedLinear]:
    """Per layer: qkv, o, gate_up, down (the stack's order)."""
    result: list[MergedLinear] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        result += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return result


def unsupported_reason(model: LlamaForCausalLM) -> str | None:
    """Why `model` must keep its Python layer loop, or None when the stack runs it."""
    if type(model) is not LlamaForCausalLM:
        return f"no native stack for {type(model).__name__}"
    if model.kernels != "cpu":
        return f"the {model.kernels!r} kernel backend"
    if model.layout.sharded or model.group.size > 1:
        return "tensor parallelism"
    kind = _projection_kind(_projections(model))
    if kind is None:
        return "projections of different kinds"
    if kind == "plain" and cpu_lacks_half_matmul(model.dtype):
        return f"{model.dtype} matmuls widened to fp32 on this CPU"
    norms = [
        n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    if len({n.eps for n in [*norms, model.norm]}) != 1:
        return "norms with different eps"
    return None


def _projection_kind(projections: list[MergedLinear]) -> str | None:
    """The stack's name for how every projection multiplies, or None for a mix (or
    int8 products without the native ops)."""
    products = [p.packed for p in projections]
    if all(isinstance(p, PackedWeight) for p in products):
        return "packed"
    if all(p is None for p in products):
        return "plain"
    if all(isinstance(p, Int8Weight) and p.native for p in products):
        modes = {p.mode for p in products}
        if len(modes) == 1:
            return f"int8_{modes.pop()}"
    if all(isinstance(p, Int4Weight) and p.native for p in products):
        return "int4"
    return None


def _weights(kind: str, projections: list[MergedLinear]) -> list[torch.Tensor]:
    """`StackWeights.weights` for projections of `kind`."""
    if kind == "packed":
        return [p.packed.packed for p in projections]
    if kind == "plain":
        return [p.weight for p in projections]
    if kind == "int4":
        return [tensor for p in projections for tensor in _int4_tensors(p.packed)]
    weights: list[torch.Tensor] = []
    for p in projections:
        int8 = p.packed
        if int8.mode == "dynamic":
            packed, col_sums = int8.vnni if int8.vnni is not None else (_EMPTY_INT8, _EMPTY_INT32)
            input_scales = int8.input_scales if int8.input_scales is not None else _EMPTY_F32
            weights += [_EMPTY_INT8, int8.quantized_t, int8.scale, int8.scale_bf16]
            weights += [packed, col_sums, input_scales]
        else:
            weights += [int8.quantized, _EMPTY_INT8, int8.scale, int8.scale_bf16]
            weights += [_EMPTY_INT8, _EMPTY_INT32, _EMPTY_F32]
    return weights


def _int4_tensors(int4: Int4Weight) -> list[torch.Tensor]:
    """One int4 projection's six tensors of `StackWeights.weights`."""
    gemv = int4.gemv
    meta = [int4.out_features, int4.in_features, int4.group_size]
    meta += [gemv.group_size, gemv.padded_in] if gemv is not None else [0, 0]
    return [
        gemv.packed if gemv is not None else _EMPTY_UINT8,
        gemv.scales_and_zeros if gemv is not None else _EMPTY_F32,
        int4.packed,
        int4.scale,
        int4.zero if int4.zero is not None else _EMPTY_INT8,
        torch.tensor(meta, dtype=torch.int64),
    ]


class NativeDecoderStack:
    """`model`'s layers and final norm through `kernels.decoder_stack`."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        projections = _projections(model)
        kind = _projection_kind(projections)
        norms: list[torch.Tensor] = []
        for layer in model.layers:
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        attention = model.layers[0].self_attn
        self._projections = projections
        self._weights = StackWeights(
            norm_weights=[*norms, model.norm.weight],
            projection=kind,
            weights=_weights(kind, projections),
            biases=[p.bias for p in projections],
            head_shape=(attention.num_heads, attention.num_kv_heads, attention.head_dim),
            eps=model.norm.eps,
            scale=attention.attn.scale,
        )
        self._lora_slots: tuple[list[torch.Tensor], list[torch.Tensor], tuple[int, ...]] | None = (
            None
        )
        """Every projection's A and B slots and the slices of qkv, o, gate_up, down."""

    @classmethod
    def maybe(cls, model: LlamaForCausalLM) -> NativeDecoderStack | None:
        """The stack for `model`, or None (logged) where it keeps its Python loop."""
        reason = unsupported_reason(model)
        if reason is not None:
            logger.info("decoder layers run layer by layer in Python: %s", reason)
            return None
        return cls(model)

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        """hidden [T, hidden] embedded tokens, cos / sin [T, 1, Dh/2] -> the final
        norm's output [T, hidden], as `LlamaForCausalLM.forward`'s layer loop."""
        return decoder_stack(
            hidden.contiguous(),
            cos.squeeze(1),
            sin.squeeze(1),
            self._weights,
            kv_caches,
            self._attention(meta),
            self._lora(lora),
        )

    @staticmethod
    def _attention(meta: AttentionMetadata) -> StackAttention:
        query_lens, seq_lens = (
            prefill_lens(meta) if meta.num_prefills else (_EMPTY_LENS, _EMPTY_LENS)
        )
        return StackAttention(
            slot_mapping=meta.slot_mapping,
            num_decodes=meta.num_decode_tokens,
            decode_tables=meta.decode_block_tables,
            decode_lens=meta.decode_seq_lens,
            prefill_tables=meta.prefill_block_tables,
            prefill_query_lens=query_lens,
            prefill_seq_lens=seq_lens,
        )

    def _lora(self, batch: LoRABatch | None) -> StackLoRA | None:
        """The step's adapters, or None where every token runs the base model. The
        slots are allocated once with the model's LoRA and written in place, so their
        tensors are gathered on the first step that uses them."""
        if batch is None or batch.empty or self._projections[0].lora is None:
            return None
        if self._lora_slots is None:
            self._lora_slots = (
                [p.lora.a for p in self._projections],
                [p.lora.b for p in self._projections],
                tuple(p.lora.slice_ends for p in self._projections[:4]),
            )
        lora_a, lora_b, slices = self._lora_slots
        return StackLoRA(
            lora_a=lora_a,
            lora_b=lora_b,
            slice_ends=slices,
            token_slots=batch.token_slots,
            slot_ranks=batch.slot_rank_tensor
            if batch.slot_rank_tensor is not None
            else _EMPTY_LENS,
        )
