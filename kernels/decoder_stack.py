"""A Llama-family model's decoder layers in one native call on a CPU
(csrc/decoder_stack.cpp): what a captured decode graph is on a GPU.

Semantics of `decoder_stack` (every operator as the Python layer loop on the 'cpu'
backend calls it, in the same order, so the result is that loop's bit for bit):

    residual = hidden
    per layer l:  normed, residual = rms_norm(hidden, residual)
                  q, k, v = split(qkv(normed)); rotate q and k; write k, v to the cache
                  attn = paged attention (decodes, then prefill chunks)
                  hidden = o(attn)
                  normed, residual = rms_norm(hidden, residual)
                  hidden = down(silu_and_mul(gate_up(normed)))
    -> rms_norm(hidden, residual)[0]                                   [T, hidden]

where each projection is x @ W.T + b plus, when the step has adapters, each token's
LoRA delta (cpu_ops.lora_add over that projection's slots). The product is oneDNN's
prepacked linear, F.linear, an int8 one as `Int8Weight` computes it
(kernels/int8_matmul.py: W8A8 at every batch, or weight-only in bf16), or an int4 one
as `Int4Weight` does (kernels/int4_matmul.py).

Shapes: hidden [T, hidden] contiguous (the embedded tokens); cos / sin [T, Dh/2];
kv_caches [L] of [2, N, Hkv, B, Dh]; the first `num_decodes` tokens are decodes with
block tables [D, W] and key counts [D], the rest the prefill chunks, with a block table
[P, W], query length and sequence length [P] per chunk (backends.prefill_lens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels import cpu_ops
from loraplex.kernels.int4_matmul import INT4_GEMV_ROWS
from loraplex.kernels.int8_matmul import DYNAMIC_MIN_ROWS

PROJECTIONS_PER_LAYER = 4
"""qkv, o, gate_up, down: the order of the projections within a layer."""
PROJECTION_KINDS = ("packed", "plain", "int8_dynamic", "int8_weight_only", "int4")
"""How the projections multiply; see `StackWeights.weights`."""


@dataclass(frozen=True)
class StackWeights:
    """What the stack reads of the model, gathered once."""

    norm_weights: list[torch.Tensor]
    """[2L + 1]: each layer's input and post-attention norm, then the final norm."""
    projection: str
    """One of PROJECTION_KINDS."""
    weights: list[torch.Tensor]
    """'packed': [4L] oneDNN-prepacked weights; 'plain': [4L] of [out, in]; int8: [28L],
    per projection q [out, in] int8 ('int8_weight_only'; else empty), q.T [in, out]
    ('int8_dynamic'; else empty), its per-channel scales [out] in fp32 and bf16,
    `int8_matmul.pack_vnni(q)`'s two tensors ('int8_dynamic' on a CPU with VNNI; else
    empty) and the activations' input scales [in] (`Int8Weight.input_scales`; else
    empty); 'int4': [24L], per projection `Int4Weight`'s torch packing and its scales
    and zeros (empty where it has none), its packed values, scales and zero points (else
    empty), and int64 [out, in, group size, torch's group size, torch's padded in]."""
    biases: list[torch.Tensor | None]
    head_shape: tuple[int, int, int]
    """(query heads, kv heads, head dim)."""
    eps: float
    scale: float
    """Attention's softmax scale."""


@dataclass(frozen=True)
class StackAttention:
    """One step's cache writes and per-token attention tables."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefill_tables: torch.Tensor
    prefill_query_lens: torch.Tensor
    prefill_seq_lens: torch.Tensor


@dataclass(frozen=True)
class StackLoRA:
    """One step's adapters: each projection's slots and each token's slot."""

    lora_a: list[torch.Tensor]
    """[4L] fp32 A slots [max_loras, R, in]."""
    lora_b: list[torch.Tensor]
    """[4L] fp32 rank-major B slots [max_loras, out, R]."""
    slice_ends: tuple[tuple[int, ...], ...]
    """Where each output slice ends, for qkv, o, gate_up and down (3, 1, 2 and 1
    slices): what the zero blocks of a fused projection's block-diagonal B are."""
    token_slots: torch.Tensor
    """[T] int64, -1: base model."""
    slot_ranks: torch.Tensor
    """[max_loras] int64 rank per slot, or empty (every column)."""


_EMPTY = torch.empty(0, dtype=torch.int64)


def decoder_stack(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layers: StackWeights,
    kv_caches: list[torch.Tensor],
    attention: StackAttention,
    lora: StackLoRA | None,
) -> torch.Tensor:
    """The model's layers and final norm over `hidden` (see the module docstring);
    writes the step's K/V into `kv_caches` and returns the normed hidden [T, hidden]."""
    return cpu_ops.ops().decoder_stack(
        hidden,
        cos,
        sin,
        layers.norm_weights,
        layers.weights,
        layers.biases,
        layers.projection,
        INT4_GEMV_ROWS if layers.projection == "int4" else DYNAMIC_MIN_ROWS,
        kv_caches,
        attention.slot_mapping,
        attention.num_decodes,
        attention.decode_tables,
        attention.decode_lens,
        attention.prefill_tables,
        attention.prefill_query_lens,
        attention.prefill_seq_lens,
        lora.lora_a if lora is not None else [],
        lora.lora_b if lora is not None else [],
        [len(ends) for ends in lora.slice_ends] if lora is not None else [],
        [end for ends in lora.slice_ends for end in ends] if lora is not None else [],
        lora.token_slots if lora is not None else _EMPTY,
        lora.slot_ranks if lora is not None else _EMPTY,
        list(layers.head_shape),
        layers.eps,
        layers.scale,
    )
