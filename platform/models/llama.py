"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) on the paged KV cache.

One forward runs the step's flattened tokens (see attention_metadata.py):
    input_ids [T] -> embed [T, hidden] -> num_layers x (attention, MLP) -> norm -> [T, hidden]
q/k/v and gate/up are fused projections (one matmul each); their slice sizes are
kept on the layers, and each projection adds its tokens' LoRA deltas when the step
has a `LoRABatch` (see kernels/lora.py and `enable_lora`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.backends import get_backend
from loraplex.kernels.cpu_matmul import PackedWeight, linear
from loraplex.kernels.int8_matmul import Int8Weight
from loraplex.kernels.lora import LoRABatch, PendingExpand
from loraplex.platform.arch import ModelArch
from loraplex.platform.layers.attention import PagedAttention
from loraplex.platform.layers.linear import MergedLinear, RowParallelLinear
from loraplex.platform.layers.norm import RMSNorm
from loraplex.platform.layers.rotary import RotaryEmbedding
from loraplex.platform.models.compressed_tensors import Int4Scheme
from loraplex.platform.models.weights import WeightTarget, load_checkpoint
from loraplex.platform.parallel.group import TPGroup
from loraplex.platform.parallel.layout import TPLayout, split

if TYPE_CHECKING:
    from loraplex.adapters.saved_modules import SavedModuleSlots
    from loraplex.platform.models.native_stack import NativeDecoderStack

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    """q/k/v column-parallel by heads, o row-parallel (see parallel/layout.py)."""

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        device: torch.device,
        kernels: str,
        layout: TPLayout,
        group: TPGroup,
    ) -> None:
        super().__init__()
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = arch.head_dim
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = MergedLinear(
            arch.hidden_size,
            (q_size, kv_size, kv_size),
            arch.qkv_bias,
            dtype,
            device,
            row_ranges=(layout.q_rows, layout.kv_rows, layout.kv_rows),
        )
        self.o_proj = RowParallelLinear(
            q_size, arch.hidden_size, arch.o_bias, dtype, device, layout.q_rows, group
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, arch.head_dim, kernels)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None,
    ) -> tuple[torch.Tensor, PendingExpand | None]:
        """hidden [T, hidden], cos/sin [T, 1, Dh/2] -> ([T, hidden], o_proj's pending
        LoRA expand or None: `MergedLinear.forward_deferred`)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden, lora).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj.forward_deferred(self.attn(q, k, v, cos, sin, kv_cache, meta), lora)


class LlamaMLP(nn.Module):
    """gate/up column-parallel, down row-parallel over the intermediate dimension."""

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        device: torch.device,
        kernels: str,
        layout: TPLayout,
        group: TPGroup,
    ) -> None:
        super().__init__()
        self.kernels = get_backend(kernels)
        size = arch.intermediate_size
        self.gate_up_proj = MergedLinear(
            arch.hidden_size,
            (size, size),
            arch.mlp_bias,
            dtype,
            device,
            row_ranges=(layout.intermediate, layout.intermediate),
        )
        self.down_proj = RowParallelLinear(
            size, arch.hidden_size, arch.mlp_bias, dtype, device, layout.intermediate, group
        )

    def forward(
        self, hidden: torch.Tensor, lora: LoRABatch | None
    ) -> tuple[torch.Tensor, PendingExpand | None]:
        """down(silu(gate(x)) * up(x)): [T, hidden] -> ([T, hidden], down_proj's pending
        LoRA expand or None). gate_up's own pending expand runs inside the
        SiLU-and-mul."""
        gate_up, pending = self.gate_up_proj.forward_deferred(hidden, lora)
        activated = self.kernels.silu_and_mul(gate_up, pending)
        return self.down_proj.forward_deferred(activated, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        device: torch.device,
        kernels: str,
        layout: TPLayout,
        group: TPGroup,
    ) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, dtype, device, kernels)
        self.self_attn = LlamaAttention(arch, dtype, device, kernels, layout, group)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, dtype, device, kernels)
        self.mlp = LlamaMLP(arch, dtype, device, kernels, layout, group)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        pending: PendingExpand | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor, PendingExpand | None]:
        """Returns (this layer's MLP output, residual stream before it, the MLP output's
        pending LoRA expand); output + expand + residual is the layer's output, added
        by the next norm. `pending`: the previous layer's (None: none left)."""
        normed, residual = self.input_layernorm(hidden, residual, pending)
        hidden, pending = self.self_attn(normed, cos, sin, kv_cache, meta, lora)
        normed, residual = self.post_attention_layernorm(hidden, residual, pending)
        hidden, pending = self.mlp(normed, lora)
        return hidden, residual, pending


class LlamaForCausalLM(nn.Module):
    """The causal LM; parameters start uninitialized and are filled by `load_weights`.

    Under tensor parallelism (`layout.size > 1`) this is one rank's shard: its heads,
    MLP columns and vocabulary rows (embedding and LM head), with an all-reduce after
    each row-parallel projection and the embedding, and an all-gather of the logits.
    """

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: str = "torch",
        layout: TPLayout | None = None,
        group: TPGroup | None = None,
    ) -> None:
        """`kernels` names the kernel backend ('torch', 'cpu' or 'triton'; kernels/backends.py)."""
        super().__init__()
        device = torch.device(device)
        self.arch = arch
        self.dtype = dtype
        self.kernels = kernels
        self.layout = layout or TPLayout.single(arch)
        self.group = group or TPGroup.single()
        if self.group.size != self.layout.size:
            raise ValueError(f"layout for {self.layout.size} ranks, group of {self.group.size}")
        vocab_rows = self.layout.vocab[1]
        self.embed_tokens = nn.Parameter(
            torch.empty(vocab_rows, arch.hidden_size, dtype=dtype, device=device)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, device, kernels, self.layout, self.group)
            for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, kernels)
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope, device
        )
        self.packed_lm_head: PackedWeight | Int8Weight | None = None
        self.saved_modules: SavedModuleSlots | None = None
        """The LoRA slots' own embedding tables (adapters/saved_modules.py), set by
        the rank's builder when LoRA is on."""
        self.native_stack: NativeDecoderStack | None = None
        """The layer loop and final norm as one native call on a CPU
        (platform/models/native_stack.py), set by the engine; None: the Python loop."""
        if arch.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(
                torch.empty(vocab_rows, arch.hidden_size, dtype=dtype, device=device)
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]. `lora` says
        which adapter slot each token uses (None: every token runs the base model)."""
        saved = self.saved_modules
        if lora is not None and saved is not None and saved.has_embeddings:
            hidden = saved.embed(input_ids, lora, self._embed_base_vocabulary)
        else:
            hidden = self._embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        if self.native_stack is not None:
            return self.native_stack(hidden, cos, sin, kv_caches, meta, lora)
        residual = pending = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual, pending = layer(
                hidden, residual, pending, cos, sin, kv_cache, meta, lora
            )
        hidden, _ = self.norm(hidden, residual, pending)
        return hidden

    def _embed_base_vocabulary(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`_embed` of ids clamped to the base's vocabulary: the ids past it belong to
        adapters with a resized table, which replaces these rows."""
        return self._embed(input_ids.clamp(max=self.arch.vocab_size - 1))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: ids outside this rank's rows give zeros, and the
        all-reduce leaves every token its one nonzero row."""
        if not self.layout.sharded:
            return F.embedding(input_ids, self.embed_tokens)
        start, size = self.layout.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= size)
        hidden = F.embedding(local.clamp(0, size - 1), self.embed_tokens)
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> float32 logits [R, vocab] (on every rank)."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden, None).float()
        else:
            logits = linear(hidden, self.lm_head, None).float()
        if not self.layout.sharded:
            return logits
        sizes = [
            split(self.arch.vocab_size, self.layout.size, r)[1] for r in range(self.layout.size)
        ]
        return self.group.all_gather_last_dim(logits, sizes)

    def lora_targets(self) -> dict[tuple[int, str], tuple[MergedLinear, int]]:
        """(layer index, PEFT module name) -> (projection holding it, slice index)."""
        targets: dict[tuple[int, str], tuple[MergedLinear, int]] = {}
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
                targets[(i, name)] = (attn.qkv_proj, index)
            targets[(i, "o_proj")] = (attn.o_proj, 0)
            for index, name in enumerate(("gate_proj", "up_proj")):
                targets[(i, name)] = (mlp.gate_up_proj, index)
            targets[(i, "down_proj")] = (mlp.down_proj, 0)
        return targets

    def weight_targets(self) -> dict[str, WeightTarget]:
        """HF checkpoint tensor name -> where it goes in this model."""
        vocab_rows = (*self.layout.vocab, self.arch.vocab_size)
        targets: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": WeightTarget(self, "embed_tokens", rows=vocab_rows),
            "model.norm.weight": WeightTarget(self.norm, "weight"),
        }
        if not self.arch.tie_word_embeddings:
            targets["lm_head.weight"] = WeightTarget(self, "lm_head", rows=vocab_rows)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets[prefix + "input_layernorm.weight"] = WeightTarget(
                layer.input_layernorm, "weight"
            )
            targets[prefix + "post_attention_layernorm.weight"] = WeightTarget(
                layer.post_attention_layernorm, "weight"
            )
            for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
                targets[f"{prefix}self_attn.{name}.weight"] = WeightTarget(
                    attn.qkv_proj, "weight", index
                )
                if self.arch.qkv_bias:
                    targets[f"{prefix}self_attn.{name}.bias"] = WeightTarget(
                        attn.qkv_proj, "bias", index
                    )
            for index, name in enumerate(("gate_proj", "up_proj")):
                targets[f"{prefix}mlp.{name}.weight"] = WeightTarget(
                    mlp.gate_up_proj, "weight", index
                )
                if self.arch.mlp_bias:
                    targets[f"{prefix}mlp.{name}.bias"] = WeightTarget(
                        mlp.gate_up_proj, "bias", index
                    )
            for module, name, has_bias in (
                (attn.o_proj, "self_attn.o_proj", self.arch.o_bias),
                (mlp.down_proj, "mlp.down_proj", self.arch.mlp_bias),
            ):
                targets[f"{prefix}{name}.weight"] = WeightTarget(module, "weight", 0)
                if has_bias:
                    targets[f"{prefix}{name}.bias"] = WeightTarget(module, "bias", 0)
        return targets

    def load_weights(
        self,
        folder: str | Path,
        quantization: str | None = None,
        quantize_lm_head: bool = False,
        int8_checkpoint: bool = False,
        int4_scheme: Int4Scheme | None = None,
        int8_packed: bool = False,
    ) -> None:
        """Fills every parameter from the HF safetensors in `folder` (single or sharded),
        then prepacks the projections and the LM head for CPU matmuls where useful, or
        quantizes the projections (and with `quantize_lm_head` a copy of the LM head:
        a tied one stays the embedding table) to int8 in `quantization`'s mode. An
        `int8_checkpoint` (compressed-tensors, platform/models/compressed_tensors.py)
        holds the projections' int8 weights (`int8_packed`: four to an int32) and
        scales, which run as stored; an int4
        one (`int4_scheme`) its packed int4 weights, scales and zero points (W4A16,
        kernels/int4_matmul.py), also as stored."""
        projections = [m for m in self.modules() if isinstance(m, MergedLinear)]
        ignored = ["lm_head.weight"] if self.arch.tie_word_embeddings else []
        targets = self.weight_targets()
        if int8_checkpoint:
            for module in projections:
                module.prepare_int8_load(int8_packed)
            targets = _int8_targets(targets, int8_packed)
            stems = [n.removesuffix("_scale") for n in targets if n.endswith(".weight_scale")]
            ignored += [stem + "_zero_point" for stem in stems]
            ignored += [stem + "_shape" for stem in stems] if int8_packed else []
        if int4_scheme is not None:
            for module in projections:
                module.prepare_int4_load(int4_scheme.group_size, int4_scheme.symmetric)
            ignored += _int4_ignored(targets, int4_scheme)
            targets = _int4_targets(targets, int4_scheme)
        load_checkpoint(Path(folder), targets, ignored)
        native = self.kernels == "cpu"
        gains = self._smoothing_gains() if quantization == "dynamic" else {}
        for module in projections:
            if int4_scheme is not None:
                module.finish_int4_load(native)
            elif int8_checkpoint:
                module.finish_int8_load(quantization, native)
            elif quantization is None:
                if self.kernels != "triton":  # the Triton kernels run on a GPU (a CPU: tests)
                    module.pack()
            else:
                module.quantize(quantization, native, gains.get(module))
        if quantization is not None and quantize_lm_head:
            self.packed_lm_head = Int8Weight.from_float(
                self.lm_head,
                quantization,
                self.kernels == "cpu",
                self.norm.weight if quantization == "dynamic" else None,
            )
        else:
            self.packed_lm_head = PackedWeight.maybe(self.lm_head)

    def _smoothing_gains(self) -> dict[MergedLinear, torch.Tensor]:
        """The projections an RMSNorm feeds, each with that norm's weight: W8A8 quantizes
        their activations divided by it (kernels/int8_matmul.py, input gain)."""
        gains: dict[MergedLinear, torch.Tensor] = {}
        for layer in self.layers:
            gains[layer.self_attn.qkv_proj] = layer.input_layernorm.weight
            gains[layer.mlp.gate_up_proj] = layer.post_attention_layernorm.weight
        return gains


def _int4_targets(targets: dict[str, WeightTarget], scheme: Int4Scheme) -> dict[str, WeightTarget]:
    """`targets` for an int4 checkpoint: each decoder projection's `.weight` is held as
    `.weight_packed` ('int4_packed'), `.weight_scale` ('int4_scale') and, with zero
    points, `.weight_zero_point` ('int4_zero')."""
    result: dict[str, WeightTarget] = {}
    for name, target in targets.items():
        if target.attr == "weight" and isinstance(target.module, MergedLinear):
            stem = name.removesuffix(".weight")
            result[stem + ".weight_packed"] = dataclasses.replace(target, attr="int4_packed")
            result[stem + ".weight_scale"] = dataclasses.replace(target, attr="int4_scale")
            if not scheme.symmetric:
                result[stem + ".weight_zero_point"] = dataclasses.replace(target, attr="int4_zero")
        else:
            result[name] = target
    return result


def _int4_ignored(targets: dict[str, WeightTarget], scheme: Int4Scheme) -> list[str]:
    """An int4 checkpoint's tensors the engine does not read: each projection's
    `.weight_shape` (its shape is the model's, checked through the packed weight) and,
    symmetric, the zero points some writers store anyway (all zero)."""
    ignored: list[str] = []
    for name, target in targets.items():
        if target.attr == "weight" and isinstance(target.module, MergedLinear):
            stem = name.removesuffix(".weight")
            ignored.append(stem + ".weight_shape")
            if scheme.symmetric:
                ignored.append(stem + ".weight_zero_point")
    return ignored


def _int8_targets(targets: dict[str, WeightTarget], packed: bool) -> dict[str, WeightTarget]:
    """`targets` for an int8 checkpoint: each decoder projection's `.weight` is int8
    (its 'int8_weight'), or `packed` its `.weight_packed` ('int8_packed'), with its
    per-channel `.weight_scale` beside it."""
    result: dict[str, WeightTarget] = {}
    for name, target in targets.items():
        if target.attr == "weight" and isinstance(target.module, MergedLinear):
            if packed:
                result[name + "_packed"] = dataclasses.replace(target, attr="int8_packed")
            else:
                result[name] = dataclasses.replace(target, attr="int8_weight")
            scale = name.removesuffix(".weight") + ".weight_scale"
            result[scale] = dataclasses.replace(target, attr="int8_scale")
        else:
            result[name] = target
    return result
